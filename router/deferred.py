"""Queue before rejecting: requests wait a little for an admissible worker instead of a 429.

Dynamo defers dispatch past a queue threshold; llm-d's flow control orders waiting requests by
priority and drops them past a TTL. :class:`DeferredDispatch` puts both in front of the
dispatcher's admission (router/dispatch.py):

    q = DeferredDispatch(dispatcher, max_size=256, ttl_s=5.0)
    route = await q.route(req)      # Route, or raises Overloaded (-> 429 with Retry-After)

- With nobody waiting, a request is routed at once (no cost on the normal path).
- Refused by admission (every prefill worker past its limits), it waits in a bounded queue ordered
  by ``GenerateRequest.priority`` (lower first, vLLM's convention), then arrival. Only the head
  of the queue tries again, whenever the dispatcher releases load (``on_capacity``) and at least
  every ``poll_s``; so waiting requests are admitted in order and new arrivals never overtake them.
- A request that has waited ``ttl_s`` is refused with the dispatcher's ``Overloaded`` (its
  Retry-After). A full queue refuses the newcomer, unless it outranks the worst waiter, which is
  refused in its place.
- A waiter whose client went away (its task cancelled) leaves the queue.

One instance per event loop (the front door's); the dispatcher may call ``on_capacity`` from any
thread.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable

from tandem.core.messages import GenerateRequest
from tandem.core.types import Overloaded

from . import metrics as rm
from .dispatch import Dispatcher, Route
from .policies import retry_after_s

POLL_S = 0.05


class _Waiter:
    __slots__ = ("key", "req", "evicted", "done")

    def __init__(self, key: tuple, req: GenerateRequest):
        self.key, self.req, self.evicted, self.done = key, req, None, False

    def __lt__(self, other: "_Waiter") -> bool:
        return self.key < other.key


class DeferredDispatch:
    def __init__(self, dispatch: Dispatcher, max_size: int = 256, ttl_s: float = 5.0,
                 poll_s: float = POLL_S, refresh: Callable[[], None] | None = None):
        """``refresh``: called before every routing attempt (a backend that reports its workers'
        snapshots just in time, as the simulator does)."""
        self.dispatch, self.max_size, self.ttl_s, self.poll_s = dispatch, max_size, ttl_s, poll_s
        self.refresh = refresh
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
        me = _Waiter((req.priority, next(self._seq)), req)
        if len(self) >= self.max_size:
            worst = max((w for w in self._heap if not w.done), default=None)
            if worst is None or not me < worst:
                rm.QUEUE_WAIT.labels("full").observe(0.0)
                raise self._refusal(f"the dispatch queue is full ({self.max_size} waiting)")
            worst.evicted, worst.done = "a higher-priority request took its place in the full queue", True
        heapq.heappush(self._heap, me)
        rm.QUEUE_DEPTH.set(len(self))
        t0 = time.monotonic()
        deadline = t0 + self.ttl_s
        last: Overloaded | None = None
        try:
            while True:
                if me.evicted:
                    rm.QUEUE_WAIT.labels("evicted").observe(time.monotonic() - t0)
                    raise self._refusal(me.evicted)
                if self._head() is me:
                    try:
                        r = self._try(req)
                    except Overloaded as e:
                        last = e
                    else:
                        rm.QUEUE_WAIT.labels("admitted").observe(time.monotonic() - t0)
                        return r
                left = deadline - time.monotonic()
                if left <= 0:
                    rm.QUEUE_WAIT.labels("expired").observe(time.monotonic() - t0)
                    raise self._refusal(f"no worker admitted it within the dispatch queue's "
                                        f"{self.ttl_s:g}s", last)
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), min(self.poll_s, left))
                except asyncio.TimeoutError:
                    pass
        finally:
            me.done = True
            self._head()
            rm.QUEUE_DEPTH.set(len(self))
            self._wake.set()            # the next waiter may be the head now

    def _try(self, req: GenerateRequest) -> Route:
        if self.refresh is not None:
            self.refresh()
        return self.dispatch.route(req)

    def _refusal(self, why: str, last: Overloaded | None = None) -> Overloaded:
        if last is None:
            try:
                wait = retry_after_s(self.dispatch.view(), self.dispatch.limits)
            except Exception:  # noqa: BLE001 - a best-effort hint
                wait = 1
        else:
            wait = last.retry_after_s
        return Overloaded(f"{why}; every prefill worker is past its admission limits" if last is None
                          else f"{why}: {last}", wait)
