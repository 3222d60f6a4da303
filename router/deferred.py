"""Queue before rejecting: requests wait a little for an admissible worker instead of a 429."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable

from tandem.core.messages import GenerateRequest
from tandem.core.types import Overloaded

from . import metrics as rm
from .dispatch import Dispatcher, Route
from .policies import retry_after_s

POLL_S = 0.05
RATE_WINDOW = 32            # admissions the queue's admission rate is measured over
RATE_HORIZON_S = 30.0       # ... those older than this do not count
MAX_RETRY_AFTER_S = 60


class _Waiter:
    __slots__ = ("key", "req", "evicted", "done")

    def __init__(self, key: tuple[int, int, int], req: GenerateRequest):
        self.key, self.req, self.done = key, req, False
        self.evicted: str | None = None     # why it left the queue unserved

    def __lt__(self, other: "_Waiter") -> bool:
        return self.key < other.key


class DeferredDispatch:
    def __init__(self, dispatch: Dispatcher, max_size: int = 256, ttl_s: float = 5.0,
                 poll_s: float = POLL_S, refresh: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, prefer_sessions: bool = True):
        """``refresh``: called before every routing attempt (a backend that reports its workers'
        snapshots just in time, as the simulator does)."""
        self.dispatch, self.max_size, self.ttl_s, self.poll_s = dispatch, max_size, ttl_s, poll_s
        self.prefer_sessions = prefer_sessions
        self.refresh, self.clock = refresh, clock
        self._admitted: deque[float] = deque(maxlen=RATE_WINDOW)   # clock() of recent admissions
        self._promised_until = 0.0  # clock() at which the last promised retry slot ends
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        dispatch.on_capacity = self._capacity

    def __len__(self) -> int:
        return sum(1 for w in self._heap if not w.done)

    def _capacity(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and self._heap and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:        # the loop closed meanwhile
                pass

    def _head(self) -> _Waiter | None:
        while self._heap and self._heap[0].done:
            heapq.heappop(self._heap)
        return self._heap[0] if self._heap else None

    async def route(self, req: GenerateRequest) -> Route:
        if self._loop is None:
            self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        if self._head() is None:
            try:
                return self._try(req)
            except Overloaded:
                if self.max_size == 0:
                    raise
        return await self._wait(req)

    async def _wait(self, req: GenerateRequest) -> Route:
        fresh = 0 if self.prefer_sessions and self.dispatch.in_session(req) else 1
        wake = self._wake
        assert wake is not None, "route() made it"
        me = _Waiter((req.priority, fresh, next(self._seq)), req)
        if len(self) >= self.max_size:
            worst = max((w for w in self._heap if not w.done), default=None)
            if worst is None or not me < worst:
                rm.QUEUE_WAIT.labels("full").observe(0.0)
                raise self._refusal(f"the dispatch queue is full ({self.max_size} waiting)")
            worst.evicted, worst.done = "a higher-priority request took its place in the full queue", True
        heapq.heappush(self._heap, me)
        rm.QUEUE_DEPTH.set(len(self))
        t0 = self.clock()
        deadline = t0 + self.ttl_s
        last: Overloaded | None = None
        try:
            while True:
                if me.evicted:
                    rm.QUEUE_WAIT.labels("evicted").observe(self.clock() - t0)
                    raise self._refusal(me.evicted)
                if self._head() is me:
                    try:
                        r = self._try(req)
                    except Overloaded as e:
                        last = e
                    else:
                        rm.QUEUE_WAIT.labels("admitted").observe(self.clock() - t0)
                        return r
                left = deadline - self.clock()
                if left <= 0:
                    rm.QUEUE_WAIT.labels("expired").observe(self.clock() - t0)
                    me.done = True      # not among the waiters its Retry-After counts
                    raise self._refusal(f"no worker admitted it within the dispatch queue's "
                                        f"{self.ttl_s:g}s", last)
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), min(self.poll_s, left))
                except asyncio.TimeoutError:
                    pass
        finally:
            me.done = True
            self._head()
            rm.QUEUE_DEPTH.set(len(self))
            wake.set()                  # the next waiter may be the head now

    def _try(self, req: GenerateRequest) -> Route:
        if self.refresh is not None:
            self.refresh()
        r = self.dispatch.route(req)
        self._admitted.append(self.clock())
        return r

    def admission_rate(self) -> float | None:
        """Requests admitted per second over the recent admissions (None: fewer than two
        within ``RATE_HORIZON_S``)."""
        now = self.clock()
        recent = [t for t in self._admitted if now - t <= RATE_HORIZON_S]
        if len(recent) < 2 or recent[-1] <= recent[0]:
            return None
        return (len(recent) - 1) / (recent[-1] - recent[0])

    def retry_after_s(self, worker_s: int = 1, promise: bool = False) -> int:
        """The Retry-After of a refusal now: the requests waiting (:func:`len`) over
        :meth:`admission_rate`, at least ``worker_s`` (the workers' own prediction) and
        the end of the last promised retry slot; ``ttl_s`` at least when nothing was
        admitted lately."""
        waiting = len(self)
        rate = self.admission_rate()
        now = self.clock()
        if rate is None:
            queue_s = self.ttl_s if waiting else 0.0
        else:
            queue_s = waiting / rate
        wait = max(math.ceil(queue_s), worker_s, 1)
        if rate is not None:
            wait = max(wait, math.ceil(self._promised_until - now))
        wait = int(min(wait, MAX_RETRY_AFTER_S))
        if promise and rate is not None:
            self._promised_until = max(self._promised_until, now + wait) + 1.0 / rate
        return wait

    def _refusal(self, why: str, last: Overloaded | None = None) -> Overloaded:
        if last is None:
            try:
                worker_s = retry_after_s(self.dispatch.view(), self.dispatch.limits)
            except Exception:  # noqa: BLE001 - a best-effort hint
                worker_s = 1
        else:
            worker_s = last.retry_after_s
        wait = self.retry_after_s(worker_s, promise=True)
        head = (f"{why}; every prefill worker is past its admission limits" if last is None
                else f"{why}: {last}")
        return Overloaded(f"{head}; {len(self)} waiting in the dispatch queue: retry in {wait}s", wait)
