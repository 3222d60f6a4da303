"""Router leases: a decode worker stops the streams of a router that went away."""

from __future__ import annotations

import time
from typing import Callable

LEASE_S = 15.0        # a router silent this long is gone
TICK_S = 1.0          # how often the actor looks
JUMP_S = 3.0          # a tick this late means this worker itself was not running


class RouterLeases:
    def __init__(self, lease_s: float = LEASE_S, clock: Callable[[], float] = time.monotonic):
        self.lease_s, self.clock = lease_s, clock
        self.seen: dict[str, float] = {}
        self.leases: dict[str, float] = {}   # a router's own lease, when its heartbeat names one
        self.streams: dict[str, str] = {}
        self._last_tick = clock()

    def renew(self, router: str, lease_s: float | None = None) -> None:
        """``router`` is alive now; ``lease_s``: its lease from now on (None: the default)."""
        self.seen[router] = self.clock()
        if lease_s is not None:
            self.leases[router] = lease_s

    def _lease(self, router: str) -> float:
        return self.leases.get(router, self.lease_s)

    def open(self, rid: str, router: str | None) -> None:
        """``rid`` streams to ``router`` (None: a caller with no lease, never expired)."""
        if router is not None:
            self.streams[rid] = router
            self.seen.setdefault(router, self.clock())

    def close(self, rid: str) -> None:
        self.streams.pop(rid, None)

    def expired(self) -> list[str]:
        """The rids whose router's lease ran out (each returned once: closed here)."""
        now = self.clock()
        if now - self._last_tick > JUMP_S + TICK_S:   # we were stopped: nobody's fault but ours
            for r in self.seen:
                self.seen[r] = now
        self._last_tick = now
        gone = [rid for rid, r in self.streams.items() if now - self.seen.get(r, now) > self._lease(r)]
        for rid in gone:
            del self.streams[rid]
        live = set(self.streams.values())
        for r in [r for r, t in self.seen.items() if r not in live and now - t > 10 * self._lease(r)]:
            del self.seen[r]
            self.leases.pop(r, None)
        return gone
