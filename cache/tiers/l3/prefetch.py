"""The L3 tier's prefetch: a fetch's values read ahead into host staging, off the engine thread."""

from __future__ import annotations

import time

PREFETCH_JOBS = 16          # prefetch jobs that may wait; more requests are not prefetched


class L3Prefetch:

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

    def _prefetch_job(self, ask) -> None:
        if ask.stopped:
            return
        t0 = time.perf_counter()
        reach = self._reach(ask, self._exists(ask.refs))
        self._collect(reach, ask, t0, lambda ref, h, left: self._stage(ask, ref, h, left))

    def _stage(self, ask, ref: tuple[int, int], h: int, left: float) -> bytes | None:
        kind = self._payload(ref[0]).kind
        if ask.stopped:
            return None
        if self._staging.holds([(kind, h)])[0]:
            return b""
        payload = self._get(kind, h, left)
        if payload is not None:
            self.stats.prefetched_pages += 1
            self.stats.prefetch_dropped_pages += self._staging.put((kind, h), payload)
        return payload
