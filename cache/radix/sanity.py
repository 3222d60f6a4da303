"""Invariant check by recount: nothing the tree maintains incrementally is trusted."""

from __future__ import annotations

from typing import Any, Mapping

import torch


def _as_slots(v: Any) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.to(torch.int64).flatten()
    if isinstance(v, int):
        return torch.tensor([v], dtype=torch.int64)
    return torch.as_tensor(list(v), dtype=torch.int64)


def check_ownership(name: str, allocator, tree_parts: list, extra: Any) -> list[str]:
    """Pages of ``allocator`` are owned once: by the tree (``tree_parts``) or by ``extra``."""
    errs: list[str] = []
    ps = allocator.page_size
    tree = torch.cat([_as_slots(p) for p in tree_parts]) if tree_parts else torch.empty(0, dtype=torch.int64)
    if len(torch.unique(tree)) != len(tree):
        vals, counts = torch.unique(tree, return_counts=True)
        errs.append(f"[own:{name}] slots held twice by the tree: {vals[counts > 1][:8].tolist()}")
    tree_pages = torch.unique(tree // ps)
    allocated = allocator.allocated_pages()
    alloc_set = set(allocated.tolist())
    stray = [p for p in tree_pages.tolist() if p not in alloc_set]
    if stray:
        errs.append(f"[own:{name}] tree holds pages the allocator has free: {stray[:8]}")
    if extra is None:
        return errs
    extra = _as_slots(extra)
    req_pages = torch.unique(extra // ps)
    both = set(tree_pages.tolist()) & set(req_pages.tolist())
    if both:
        errs.append(f"[own:{name}] pages owned by the tree and by a request: {sorted(both)[:8]}")
    owned = set(tree_pages.tolist()) | set(req_pages.tolist())
    if owned != alloc_set:
        leaked = sorted(alloc_set - owned)
        free_but_held = sorted(owned - alloc_set)
        errs.append(f"[own:{name}] allocated pages owned by no one (leak): {leaked[:8]} "
                    f"({len(leaked)}); owned pages on the free list: {free_but_held[:8]} "
                    f"({len(free_but_held)})")
    return errs


def _check_pins(tree, nodes: list) -> list[str]:
    """Pins: the pinned set and each tenant's charge recounted; a pin covers a whole prefix."""
    E: list[str] = []
    pinned = {nd for nd in nodes if nd.pin}
    if tree.pins.nodes != pinned:
        E.append(f"[pin] pinned set ({len(tree.pins.nodes)}) != recount ({len(pinned)}): "
                 f"{sorted(n.id for n in tree.pins.nodes ^ pinned)[:8]} differ")
    charge: dict = {}
    expiries = {(u, i) for u, i, _ in tree.pins.expiry}
    for nd in pinned:
        charge[nd.pin_tenant] = charge.get(nd.pin_tenant, 0) + len(nd.key)
        if nd.parent is not tree.root and nd.parent.pin < nd.pin:
            E.append(f"[pin] {nd} pinned until {nd.pin} under {nd.parent} pinned until {nd.parent.pin}")
        if (nd.pin, nd.id) not in expiries:
            E.append(f"[pin] {nd} has no expiry entry for {nd.pin}")
    if charge != tree.pins.tokens:
        E.append(f"[pin] pin_tokens {tree.pins.tokens} != recount {charge}")
    return E


def check(tree, *, allocator=None, extra_owned: Any = None, host_allocator=None,
          host_stores: Mapping[str, Any] | None = None) -> list[str]:
    E: list[str] = []
    ps = tree.page_size
    root = tree.root
    comps = tree.components
    na = len(comps)
    if root.parent is not None or root.key != [] or root.value is None:
        E.append("[root] the root must have no parent, an empty key and a device value")
    if getattr(tree, "spills", None):
        E.append(f"[l3] {len(tree.spills)} spill(s) not written before the operation ended")
    nodes = []
    seen = {root}
    stack = [root]
    while stack:
        nd = stack.pop()
        nodes.append(nd)
        ndc = 0
        child_locks = 0
        for ck, c in nd.children.items():
            if c in seen:
                E.append(f"[struct] {c} reached twice")
                continue
            seen.add(c)
            stack.append(c)
            if c.parent is not nd:
                E.append(f"[struct] {c}.parent is {c.parent}, but it is a child of {nd}")
            if not c.key or len(c.key) % ps:
                E.append(f"[struct] {c} edge of {len(c.key)} tokens is not whole pages of {ps}")
            elif tree.child_key(c.key) != ck:
                E.append(f"[struct] {c} is filed under child key {ck!r}, not its first page")
            if c.start != nd.start + len(nd.key):
                E.append(f"[struct] {c}.start={c.start} but its parent ends at {nd.end}")
            ndc += c.value is not None
            child_locks += c.lock_ref
        if nd.ndc != ndc:
            E.append(f"[count] {nd}.ndc={nd.ndc} != {ndc} device children")
        if nd.lock_ref < 0:
            E.append(f"[lock] {nd} lock_ref {nd.lock_ref} < 0")
        if nd is not root and nd.lock_ref < child_locks:
            E.append(f"[lock] {nd} lock_ref {nd.lock_ref} < its children's {child_locks}")

    evictable = protected = host_size = 0
    aux_ev, aux_pr = [0] * na, [0] * na
    aux_unlocked: list[set] = [set() for _ in range(na)]
    aux_host_size = [0] * na
    aux_host_nodes: list[set] = [set() for _ in range(na)]
    leaves, host_nodes = set(), set()
    for nd in nodes:
        if nd is root:
            continue
        L = len(nd.key)
        if nd.value is None and nd.host is None:
            E.append(f"[tier] {nd} is dead: no device and no host data")
        if nd.value is not None:
            if len(nd.value) != L:
                E.append(f"[tier] {nd} device value covers {len(nd.value)} of {L} tokens")
            if nd.parent is not root and nd.parent.value is None:
                E.append(f"[tier] device {nd} under host-only {nd.parent} (a device hole)")
            if nd.lock_ref > 0:
                protected += L
            else:
                evictable += L
                if nd.ndc == 0:
                    leaves.add(nd)
        if nd.host is not None:
            host_nodes.add(nd)
            host_size += L
            if len(nd.host) != L:
                E.append(f"[tier] {nd} host value covers {len(nd.host)} of {L} tokens")
        if nd.hashes is not None and len(nd.hashes) != L // ps:
            E.append(f"[hash] {nd} has {len(nd.hashes)} page hashes for {L // ps} pages")
        for i, c in enumerate(comps):
            locks = nd.aux_lock[i]
            n_locks = sum(locks.values())
            if any(k <= 0 for k in locks.values()):
                E.append(f"[lock] {nd} {c.name} lock counts {locks} must be positive")
            if n_locks > nd.lock_ref:
                E.append(f"[lock] {nd} {c.name} lock {n_locks} > full lock {nd.lock_ref}")
            hv = nd.aux_host[i]
            if hv is not None:
                if nd.host is None:
                    E.append(f"[tier] {nd} holds a {c.name} host copy without a FULL host copy")
                if c.name == "swa" and len(hv) != L:
                    E.append(f"[tier] {nd} swa host rows cover {len(hv)} of {L} tokens")
                aux_host_size[i] += c.size(hv)
                aux_host_nodes[i].add(nd)
            v = nd.aux[i]
            if v is None:
                continue
            if nd.value is None:
                E.append(f"[tier] host-only {nd} still holds {c.name} data")
            if c.name == "swa" and len(v) != L:
                E.append(f"[tier] {nd} swa rows cover {len(v)} of {L} tokens")
            if locks:
                aux_pr[i] += c.size(v)
            else:
                aux_ev[i] += c.size(v)
                aux_unlocked[i].add(nd)

    if (tree.evictable, tree.protected) != (evictable, protected):
        E.append(f"[size] evictable={tree.evictable} protected={tree.protected} != recount "
                 f"{evictable}/{protected}")
    if tree.hosted.size != host_size or tree.hosted.nodes != host_nodes:
        E.append(f"[size] host_size={tree.hosted.size} ({len(tree.hosted.nodes)} nodes) != recount "
                 f"{host_size} ({len(host_nodes)} nodes)")
    for i, c in enumerate(comps):
        if (tree.aux.evictable[i], tree.aux.protected[i]) != (aux_ev[i], aux_pr[i]):
            E.append(f"[size] {c.name} evictable={tree.aux.evictable[i]} protected="
                     f"{tree.aux.protected[i]} != recount {aux_ev[i]}/{aux_pr[i]}")
        if tree.aux.unlocked[i] != aux_unlocked[i]:
            E.append(f"[set] {c.name} unlocked set ({len(tree.aux.unlocked[i])}) != recount "
                     f"({len(aux_unlocked[i])})")
        if tree.hosted.aux_size[i] != aux_host_size[i] or tree.hosted.aux_nodes[i] != aux_host_nodes[i]:
            E.append(f"[size] {c.name} host size={tree.hosted.aux_size[i]} "
                     f"({len(tree.hosted.aux_nodes[i])} nodes) != recount {aux_host_size[i]} "
                     f"({len(aux_host_nodes[i])} nodes)")
    if tree.leaves.nodes != leaves:
        E.append(f"[leaf] leaf set has {sorted(n.id for n in tree.leaves.nodes - leaves)[:8]} extra, "
                 f"{sorted(n.id for n in leaves - tree.leaves.nodes)[:8]} missing")
    live = {(nd.id, k) for k, _, nd in tree.leaves.heap}
    live_pinned = {(nd.id, k) for k, _, nd in tree.leaves.pheap}
    for nd in leaves:
        if not tree.policy.time_dependent and nd.hk != tree.policy.key(nd):
            E.append(f"[leaf] {nd} heap key {nd.hk} != policy key {tree.policy.key(nd)}")
        if (nd.id, nd.hk) not in (live_pinned if nd.pin else live):
            E.append(f"[leaf] {nd} has no live entry in the {'pinned ' if nd.pin else ''}heap")
    E += _check_pins(tree, nodes)

    if allocator is not None:
        parts = [nd.value for nd in nodes if nd is not root and nd.value is not None]
        extra = extra_owned.get("full") if isinstance(extra_owned, Mapping) else extra_owned
        E += check_ownership("full", allocator, parts, extra)
    for i, c in enumerate(comps):
        if getattr(c, "allocator", None) is None:
            continue
        parts = [nd.aux[i] for nd in nodes if nd is not root and nd.aux[i] is not None]
        parts = [p[p >= 0] if isinstance(p, torch.Tensor) else p for p in parts]
        extra = extra_owned.get(c.name) if isinstance(extra_owned, Mapping) else None
        E += check_ownership(c.name, c.allocator, parts, extra)
    if host_allocator is not None:
        parts = [nd.host for nd in host_nodes]
        E += check_ownership("host", host_allocator, parts, torch.empty(0, dtype=torch.int64))
    for i, c in enumerate(comps):
        store = (host_stores or {}).get(c.name)
        if store is not None:
            parts = [nd.aux_host[i] for nd in aux_host_nodes[i]]
            E += check_ownership(f"host:{c.name}", store, parts, torch.empty(0, dtype=torch.int64))
    return E
