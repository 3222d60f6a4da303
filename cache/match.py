"""What the cache answers: a match (:class:`MatchResult`) and its sizes (:class:`CacheStats`)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping, NamedTuple

import torch

from tandem.cache.radix.tree import Node, concat_values as _concat

_NO_COMPONENTS: Mapping[str, Any] = MappingProxyType({})


class MatchResult(NamedTuple):
    """What a match found. Node handles:

    - ``last_device_node``: deepest node every component accepts whose KV is on the device;
      ``device_indices`` (int64 ``[prefix_len]``) are the slots of the path down to it. Lock it.
    - ``best_match_node``: deepest accepted node on any tier; ``host_hit_length`` tokens below
      ``last_device_node`` are on the host only (``cache.host.restore(best_match_node)`` brings
      them back).
    - ``last_host_node``: deepest accepted node with a host copy (the root if none); without a
      host tier, ``last_device_node``.

    ``components`` maps a component name to what it returned (``"swa"``: SWA rows of the prefix,
    -1 where tombstoned; ``"mamba"``: a :class:`StateCopy` or None). A null cache's handles are
    None.
    """

    prefix_len: int
    pieces: list
    last_device_node: Node | None = None
    last_host_node: Node | None = None
    best_match_node: Node | None = None
    host_hit_length: int = 0
    components: Mapping[str, Any] = _NO_COMPONENTS

    @property
    def device_indices(self) -> torch.Tensor:
        """Slots of the matched device prefix (int64 ``[prefix_len]``), a new tensor each read."""
        return _concat(self.pieces)

    def __repr__(self) -> str:
        return (f"MatchResult(prefix_len={self.prefix_len}, host_hit_length={self.host_hit_length}, "
                f"last_device_node={self.last_device_node})")


class CacheStats(NamedTuple):
    """Sizes, O(1) (proven by :meth:`UnifiedRadixCache.check`). Tokens for FULL; for an
    auxiliary component, units of its pool (``components[name] = (evictable, protected)``)."""

    evictable: int = 0          # unlocked device tokens
    protected: int = 0          # locked device tokens
    host: int = 0               # tokens with a host copy (0 without a host tier)
    components: Mapping[str, tuple[int, int]] = _NO_COMPONENTS

    @property
    def device(self) -> int:
        return self.evictable + self.protected
