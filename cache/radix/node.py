"""A radix tree node: one edge of token pages, its values on each tier, locks and pin."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Hashable, Protocol

import torch

if TYPE_CHECKING:
    from tandem.cache.radix.eviction import EvictionPolicy, LeafHeap


class Node:
    __slots__ = ("id", "parent", "children", "key", "start", "value", "host", "lock_ref", "ndc",
                 "access", "created", "hits", "priority", "session", "aux", "aux_lock", "aux_host",
                 "hashes", "hk", "pin", "pin_tenant")

    def __init__(self, nid: int, parent: Node | None, key: list[int], start: int, value: Any,
                 tick: int, n_aux: int) -> None:
        self.id = nid
        self.parent = parent
        self.children: dict[Hashable, Node] = {}   # plain dict: a missing key must raise
        self.key = key
        self.start = start
        self.value = value
        self.host: Any = None                   # host pool slots (a tensor), or None
        self.lock_ref = 0
        self.ndc = 0
        self.access = tick
        self.created = tick
        self.hits = 0
        self.priority = 0
        self.session: Hashable | None = None
        # Per auxiliary component: data (None = tombstone) and locks {lock floor depth: count}.
        self.aux: list[Any] = [None] * n_aux
        self.aux_lock: list[dict[int, int]] = [{} for _ in range(n_aux)]
        self.aux_host: list[Any] = [None] * n_aux
        self.hashes: list[int] | None = None    # page hash chain, computed on first use (events, L3)
        self.hk: Any = None
        self.pin = 0.0                  # pinned until this clock time (0: not pinned; see radix/pins.py)
        self.pin_tenant: str | None = None   # the tenant whose pin budget holds these tokens

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    def __repr__(self) -> str:
        tier = ("D" if self.value is not None else "") + ("H" if self.host is not None else "")
        return f"Node(id={self.id}, [{self.start},{self.end}), {tier or '-'}, lock={self.lock_ref})"


def parent_of(nd: Node) -> Node:
    """``nd``'s parent; the root, or a node out of the tree, has none (ValueError)."""
    p = nd.parent
    if p is None:
        raise ValueError(f"{nd} has no parent: the root, or a node no longer in the tree")
    return p


def take_value(value: Any, a: int, b: int) -> Any:
    """Positions ``[a, b)`` of a node value (None: the positions themselves, as a range); a tensor
    piece is a copy."""
    if value is None:
        return range(a, b)
    piece = value[a:b]
    return piece.clone() if isinstance(piece, torch.Tensor) else piece


def cut_value(value: Any, m: int) -> tuple[Any, Any]:
    """A node value cut after ``m`` positions: (head, tail), copies for a tensor."""
    if isinstance(value, torch.Tensor):
        return value[:m].clone(), value[m:].clone()
    return value[:m], value[m:]


def concat_values(pieces: list) -> torch.Tensor:
    """One int64 tensor of the path's values: always a new tensor, never the tree's own."""
    if not pieces:
        return torch.empty(0, dtype=torch.int64)
    if all(type(p) is range for p in pieces):
        return torch.arange(pieces[0].start, pieces[-1].stop, dtype=torch.int64)
    return torch.cat([p if isinstance(p, torch.Tensor) else torch.as_tensor(list(p), dtype=torch.int64)
                      for p in pieces])


class TreePort(Protocol):
    """What the tree's parts (``aux``, ``hosted``, ``pins``: cache/radix/aux.py,
    cache/tiers/host_nodes.py, cache/radix/pins.py) read and call of the tree that owns them."""

    root: Node
    page_size: int
    components: tuple
    policy: EvictionPolicy
    leaves: LeafHeap
    record_events: bool
    spills: list | None

    def path(self, node: Node) -> list[Node]: ...
    def hashes(self, nd: Node) -> list[int]: ...
    def split(self, child: Node, m: int) -> Node: ...
    def delete_subtree(self, nd: Node) -> None: ...
    def spill(self, nd: Node, slots: Any, on_host: bool, aux: Sequence[tuple[int, Any, bool]] = ()) -> None: ...
    def event_store(self, nd: Node, medium: str) -> None: ...
    def event_remove(self, nd: Node, medium: str) -> None: ...
