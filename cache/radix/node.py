"""A radix tree node: one edge of token pages, its values on each tier, locks and pin."""

from __future__ import annotations

from typing import Any, Hashable


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
