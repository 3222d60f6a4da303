"""The L3 tier's prefetch: a fetch's values read ahead into host staging, off the engine thread."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.cache.tiers.l3.payload import Payload
    from tandem.cache.tiers.l3.reach import Reach
    from tandem.cache.tiers.l3.reads import Ask, L3TierStats
    from tandem.cache.tiers.l3.staging import Jobs, Staging
    from tandem.cache.tiers.l3.store import L3Store

PREFETCH_JOBS = 16          # prefetch jobs that may wait; more requests are not prefetched


class L3Prefetch:
    # L3Tier's (its __init__ sets them) and its L3Reads methods: this mixin reads ahead
    store: L3Store
    stats: L3TierStats
    _staging: Staging
    _jobs: Jobs

    if TYPE_CHECKING:
        def _exists(self, refs: list[tuple[str, int]]) -> list[bool]: ...
        def _reach(self, ask: Ask, found: list[bool]) -> Reach: ...
        def _payload(self, j: int) -> Payload: ...
        def _collect(self, reach: Reach, ask: Ask, t0: float,
                     load: Callable[[list[Any], list[int], float], list[Any]]) -> dict[Any, Any]: ...
        def _get_many(self, refs: list[Any], hashes: list[int], left: float) -> list[Any]: ...

    def prefetch(self, token_ids, m, *, session_id=None):
        """Start reading, on the prefetch thread, what :meth:`fetch` would read for ``m`` now; never waits
        on the store. Returns the job's handle (an ``Ask``: ``stop()`` it at admission), or None."""
        if not self.prefetching:
            return None
        found = self._lookup(token_ids, m)
        if found is None:
            return None
        ask = found[3]
        if not self._jobs.submit((ask,)):
            self.stats.prefetch_skipped += 1
            return None
        self.stats.prefetches += 1
        return ask

    @property
    def prefetching(self) -> bool:
        """Prefetch is on (``staging_bytes > 0``) and the store is up."""
        return self._staging.cap_bytes > 0 and self.store.up

    def prefetch_idle(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` until every queued prefetch job has run."""
        return self._jobs.idle(timeout_s)

    def _prefetch_job(self, ask: Ask) -> None:
        if ask.stopped:
            return
        t0 = time.perf_counter()
        reach = self._reach(ask, self._exists(ask.refs))
        self._collect(reach, ask, t0, lambda refs, hashes, left: self._stage(ask, refs, hashes, left))

    def _stage(self, ask: Ask, refs: list[Any], hashes: list[int], left: float) -> list[Any]:
        if ask.stopped:
            return [None] * len(refs)
        kinds = [self._payload(r[0]).kind for r in refs]
        held = self._staging.holds(list(zip(kinds, hashes)))
        out: list = [b"" if h else None for h in held]
        todo = [i for i, h in enumerate(held) if not h]
        if todo:
            got = self._get_many([refs[i] for i in todo], [hashes[i] for i in todo], left)
            for i, payload in zip(todo, got):
                out[i] = payload
                if payload is not None:
                    self.stats.prefetched_pages += 1
                    self.stats.prefetch_dropped_pages += self._staging.put((kinds[i], hashes[i]), payload)
        return out
