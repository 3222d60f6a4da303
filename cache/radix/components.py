"""Tree components: one reuse rule each, attached to the same radix tree.

FULL is the tree itself: every node's ``value`` (full-attention KV slots), valid along the whole
path. Auxiliary components (:class:`SWA`, :class:`Mamba`) keep their own data per node
(``node.aux[index]``, None = tombstone) and decide through the hooks of :class:`TreeComponent`
(``validator``, ``finalize``, ``reconcile``, ``split``, ``size``, ``free``, ``bind``) and its
``lock_span``. A match ends at the deepest node every component's validator accepts.

Host tier: a node's host copy of component data is ``node.aux_host[index]`` (same format, in the
component's host pool; see cache/tiers/host.py). It needs the node's FULL host copy.

Data (the memory model in full: cache/README.md):
- SWA: int64 rows ``[len(key)]`` of a separate SWA KV pool with its own allocator, ``-1`` where
  the engine already released a row (outside its window); when the tree adopts rows for a node
  whose full slots it already holds, the component writes the engine's ``full slot -> SWA row``
  table (``LayerKV.index_map``).
- MAMBA: one int, the row of a recurrent-state pool holding the state after the node's last
  token (a checkpoint). A matched state is never written in place: the match returns
  :class:`StateCopy` and the engine copies it into the request's private row first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


class _Full:
    """The FULL component: always present; implemented by the tree core itself."""

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
    """Base of auxiliary components: the hooks the tree calls, each with its contract."""

    name = "component"
    # A request's lock covers the nodes intersecting the last ``lock_span`` tokens of its path
    # (SWA: the window; MAMBA: the checkpoint node only); the same span is what a load-back from
    # the host tier brings to the device.
    lock_span = 1
    per_token = True                            # data per token (sliced) or one value per key end
    index = -1                                  # set by the tree: position in node.aux

    def __init__(self, allocator=None):
        self.allocator = allocator              # a PagedAllocator, or None (simulated mode)

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
        """An insert covers ``node`` with key positions ``[a, b)``; ``incoming`` is the whole
        per-insert value the caller handed over (``last``: the node ends the inserted key).
        Returns ``(keep, free)``: the node's new data and what to release (None: nothing)."""
        raise NotImplementedError

    def split(self, value: Any, m: int) -> tuple[Any, Any]:
        """Cut data when an edge is cut after ``m`` tokens: ``(upper, lower)``."""
        raise NotImplementedError

    def size(self, value: Any) -> int:
        """Units the data occupies in the component's pool (for the size counters)."""
        raise NotImplementedError

    def free(self, value: Any) -> None:
        """Execute a release through the component's allocator."""
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
        self.index_map = index_map              # engine's full slot -> SWA row table, or None

    def validator(self, host: bool = False):
        window, has = self.window, self.has(host)
        run, from_root = 0, True                # SWA tokens contiguous up to here; all so far?

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
            # The node's full slots now reach these rows (they may differ from the slots the
            # caller computed them under, which the caller frees as duplicates).
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
    lock_span = 1                               # only the node itself
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
