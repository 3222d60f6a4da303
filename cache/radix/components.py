"""Tree components: one reuse rule each, attached to the same radix tree."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from tandem.cache.radix.node import Node
    from tandem.cache.tiers.host_nodes import HostCopies


class _Full:

    name = "full"

    def __repr__(self) -> str:
        return "FULL"


FULL = _Full()


@dataclass(frozen=True)
class StateCopy:
    """MAMBA's match action: copy state row ``src`` into the request's private row before the
    request writes its state (the tree's row is shared and must stay intact)."""

    src: int


class TreeComponent:

    name = "component"
    lock_span = 1
    per_token = True
    index = -1

    def __init__(self, allocator=None):
        self.allocator = allocator

    def validator(self, host: bool = False) -> Callable[[Any], bool]:
        """A fresh per-match vote ``accept(node) -> bool``, fed every matched node in path order.
        ``host=True``: data on the host tier counts too (the restore anchor)."""
        raise NotImplementedError

    def has(self, host: bool) -> Callable[[Any], bool]:
        """``node -> bool``: the node has this component's data (on the device; or on either
        tier when ``host``)."""
        i = self.index
        if host:
            return lambda nd: nd.aux[i] is not None or nd.aux_host[i] is not None
        return lambda nd: nd.aux[i] is not None

    def bind(self, node, value: Any) -> None:
        """``value`` (device data) was placed on ``node`` by a load-back from the host (SWA
        rewrites ``index_map``)."""

    def finalize(self, nodes: list) -> Any:
        """What the engine needs about the accepted device path (``MatchResult.components[name]``)."""
        raise NotImplementedError

    def reconcile(self, node, current: Any, incoming: Any, a: int, b: int, last: bool) -> tuple[Any, Any]:
        """An insert covers ``node`` with key positions ``[a, b)``; ``incoming``: the whole
        per-insert value handed over (``last``: the node ends the inserted key)."""
        raise NotImplementedError

    def split(self, value: Any, m: int) -> tuple[Any, Any]:
        """Cut data when an edge is cut after ``m`` tokens: ``(upper, lower)``."""
        raise NotImplementedError

    def size(self, value: Any) -> int:
        raise NotImplementedError

    def free(self, value: Any) -> None:
        raise NotImplementedError


def _rows(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.as_tensor(list(value), dtype=torch.int64)


class SWA(TreeComponent):
    """Sliding-window attention: a boundary is reusable only if the ``window`` tokens before it
    (or the whole path, when shorter) still have SWA KV; released SWA data leaves tombstones."""

    name = "swa"

    def __init__(self, window: int, allocator=None, index_map: torch.Tensor | None = None):
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        super().__init__(allocator)
        self.window = window
        self.lock_span = window
        self.index_map = index_map

    def validator(self, host: bool = False):
        window, has = self.window, self.has(host)
        run, from_root = 0, True

        def accept(node) -> bool:
            nonlocal run, from_root
            if has(node):
                run += len(node.key)
            else:
                run, from_root = 0, False
            return from_root or run >= window
        return accept

    def finalize(self, nodes):
        """SWA rows of the matched prefix, int64 ``[prefix_len]``, -1 where tombstoned."""
        i = self.index
        parts = [_rows(nd.aux[i]) if nd.aux[i] is not None
                 else torch.full((len(nd.key),), -1, dtype=torch.int64) for nd in nodes]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def reconcile(self, node, current, incoming, a, b, last):
        part = incoming[a:b]
        if isinstance(part, torch.Tensor):
            if current is not None:
                # Rows the tree already holds for these tokens: the caller's copies are duplicates.
                dup = part[(part >= 0) & (part != _rows(current))]
                return current, (dup if len(dup) else None)
            if bool((part < 0).any()):
                # Partly released: cannot serve a window; release the rest, stay a tombstone.
                rest = part[part >= 0]
                return None, (rest if len(rest) else None)
            part = part.clone()
            self.bind(node, part)
            return part, None
        return (current if current is not None else part), None

    def bind(self, node, value) -> None:
        """Point the node's full slots at SWA rows ``value`` (``index_map[node.value] = value``)."""
        if self.index_map is not None and isinstance(node.value, torch.Tensor):
            self.index_map[node.value.to(self.index_map.device)] = value.to(self.index_map.device)

    def split(self, value, m):
        if isinstance(value, torch.Tensor):
            return value[:m].clone(), value[m:].clone()
        return value[:m], value[m:]

    def size(self, value) -> int:
        return len(value)

    def free(self, value) -> None:
        if self.allocator is not None and isinstance(value, torch.Tensor):
            value = value[value >= 0]
            if len(value):
                self.allocator.free(value)


class Mamba(TreeComponent):
    """Recurrent state: usable only at exact checkpoint nodes (the state after the node's last
    token). An insert hands over the state row for the key's end (or None: no checkpoint)."""

    name = "mamba"
    lock_span = 1
    per_token = False

    def validator(self, host: bool = False):
        return self.has(host)

    def finalize(self, nodes):
        return StateCopy(int(nodes[-1].aux[self.index])) if nodes else None

    def reconcile(self, node, current, incoming, a, b, last):
        if not last:
            return current, None
        if current is None:
            return int(incoming), None
        return current, (None if int(incoming) == current else int(incoming))

    def split(self, value, m):
        return None, value                      # the checkpoint stays at the lower node's end

    def size(self, value) -> int:
        return 1

    def free(self, value) -> None:
        if self.allocator is not None:
            self.allocator.free(torch.tensor([int(value)], dtype=torch.int64))


def vote(components: tuple[TreeComponent, ...], path: list[Node], hosted: HostCopies) -> tuple[int, int]:
    """``(n_dev, n_best)``: how many leading nodes of ``path`` end at the deepest boundary
    every component of a tree accepts with device data (``n_dev``) and with data on either tier
    (``n_best``: host copies of component data count, so a load-back can serve it)."""
    if not components:
        if not hosted.nodes:
            return len(path), len(path)
        for i, nd in enumerate(path):
            if nd.value is None:
                return i, len(path)
        return len(path), len(path)
    validators = [c.validator() for c in components]
    anywhere = [c.validator(host=True) for c in components] if any(hosted.aux_nodes) else None
    n_dev = n_best = 0
    on_device = True
    for i, nd in enumerate(path, 1):
        if nd.value is None:
            on_device = False
        ok = True
        for accept in validators:
            if not accept(nd):
                ok = False
        if ok and on_device:
            n_dev = i
        if anywhere is not None:
            ok = True
            for accept in anywhere:
                if not accept(nd):
                    ok = False
        if ok:
            n_best = i
    return n_dev, n_best


def insert_values(components: Sequence[TreeComponent], extra: Mapping[str, Any] | None, n: int,
                  simulated: bool) -> list | None:
    """Each auxiliary component's value for an insert of ``n`` tokens, from ``extra`` (by
    component name; a per-token one's tensor is int64 and covers ``n``); None without components.
    ``simulated`` (no pools): a missing value is the token positions (per token) or ``n``."""
    if not components:
        return None
    extra = extra or {}
    unknown = set(extra) - {c.name for c in components}
    if unknown:
        raise ValueError(f"extra has values for {sorted(unknown)}, which are not components "
                         f"of this cache ({sorted(c.name for c in components)})")
    out = []
    for c in components:
        v = extra.get(c.name)
        if v is None and simulated:
            v = range(n) if c.per_token else n
        elif c.per_token and isinstance(v, torch.Tensor):
            if len(v) < n:
                raise ValueError(f"{c.name} values cover {len(v)} tokens, need {n}")
            v = v.to(torch.int64)
        out.append(v)
    return out


def released_floor(components: Sequence[TreeComponent], aux: list | None, n: int, page_size: int) -> int:
    """The page-aligned position up to which a per-token component's values were released
    (negative ids: a sliding window's rows already freed), 0 when none were."""
    floor = 0
    for c, v in zip(components, aux or ()):
        if c.per_token and isinstance(v, torch.Tensor):
            neg = torch.nonzero(v[:n] < 0)
            if len(neg):
                floor = max(floor, int(neg[-1]) + 1)
    return min(n, -(-floor // page_size) * page_size)
