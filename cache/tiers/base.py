"""The two ports between the prefix cache and its tiers."""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Prefetch(Protocol):

    def stop(self) -> None:
        """Start no more reads (the request is being admitted: its load reads the rest)."""


@runtime_checkable
class KVTier(Protocol):
    """A place a node's KV can be besides the device. ``name`` is unique per cache."""

    name: str

    def bind(self, port: "CachePort") -> None:
        """Attach to the one cache that owns ``port`` (ValueError: another cache, or a cache
        this tier cannot serve). Called by the cache before the first request."""

    def lookup(self, token_ids: list[int], m) -> int:
        """Tokens past match ``m`` of ``token_ids`` (page-aligned) this tier may bring, with no
        I/O and no side effect; 0: :meth:`load` would add nothing."""

    def load(self, token_ids: list[int], m, *, session_id=None) -> bool:
        """Bring what this tier holds past match ``m`` onto the device and into the tree. True when
        the tree changed (the caller matches again)."""

    @property
    def prefetching(self) -> bool:
        """True when :meth:`prefetch` may start a read-ahead now."""

    def prefetch(self, token_ids: list[int], m, *, session_id=None) -> Prefetch | None:
        """Start reading, off the engine thread, what :meth:`load` would read for ``m`` now
        (never touches the tree or device memory off the engine thread); None: nothing queued."""

    def on_insert(self, node, created: bool, adopted: bool) -> None:
        """An insert ended at ``node``: ``created`` when it made new nodes, ``adopted`` when
        nodes may have adopted component data (a write-through tier copies them now)."""

    def on_evict(self, node) -> None:
        """``node``'s device copy is about to be dropped by a device eviction."""

    def on_spill(self, spills: Sequence[tuple]) -> None:
        """The last copies leaving the tree (``RadixTree.spills`` records), before their slots
        and rows are freed."""

    def as_dict(self) -> dict:
        """Counters for ``/debug/kv`` and ``/metrics``."""

    def close(self) -> None:
        """Stop the tier's threads and release its storage. Idempotent."""


class CachePort(Protocol):
    """What the cache offers a bound tier."""

    page_size: int
    allocator: Any
    components: tuple
    tree: Any                       # the RadixTree (read-only but for the placement verbs)

    @property
    def host(self) -> Any:
        """The cache's host tier, or None."""

    def key(self, token_ids: Sequence[int]) -> list[int]:
        """The page-aligned key of ``token_ids``."""

    def now(self) -> float:
        """The cache's clock (the one pins end on)."""

    def make_room(self, n: int) -> None:
        """Evict at least ``n`` tokens of unlocked device KV (if there is that much) and free
        their slots (the caller passes its shortfall)."""

    def make_room_aux(self, i: int, n: int) -> None:
        """Tombstone at least ``n`` rows of component ``i``'s unlocked device data (backed up to
        the host tier where it can be) and free them."""

    def make_room_host(self, n: int, i: int | None = None) -> None:
        """Evict at least ``n`` units of unlocked host copies (FULL, or component ``i``'s only)
        and free their host slots."""

    def insert_loaded(self, key: list[int], value, extra: Mapping[str, Any] | None,
                      session_id=None) -> int:
        """Insert pages a tier loaded (``value``: the device slots of ``key``); returns the
        length already cached (the caller frees its duplicate slots past its own prefix)."""

    def cache(self, token_ids, slots, last_node, *, extra=None, session_id=None):
        """``UnifiedRadixCache.cache``."""

    def settle(self) -> None:
        """Execute what the tree decided (frees, spills, events) and check invariants."""

    def record_spills(self) -> None:
        """From now on the tree records last copies leaving it (:meth:`KVTier.on_spill`)."""
