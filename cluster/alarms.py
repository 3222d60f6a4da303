"""Worker alarms, pushed: the supervisor rings a worker's alarm when it finds it suspect, dead, or
holding a KV write past the progress deadline, and every stream waiting on that worker wakes at once.
:func:`next_or_alarm` is how a stream waits: its worker's next chunk, or the failure the alarm says
(:class:`Stalled`, :class:`Died`) for the backend to look up in the stream's failure table.

    supervisor thread                      router loop
    _judge / mark_dead / _take_stats  ──►  Alarms.ring(wid) ──► call_soon_threadsafe(wake)
                                                                 └► next_or_alarm re-checks: raise or wait on

No poll: a wait re-checks only when rung, when its chunk comes, and once every ``SAFETY_S`` (a net for
a ring lost to a loop that was closing; slower than any deadline it could save).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from tandem.cluster.workers import WorkerRef
from tandem.core.types import StreamChunk

SAFETY_S = 5.0


class Alarms:
    """Per worker id, the rings of the streams waiting on it. Thread-safe: the supervisor rings from
    its thread (and the backend from the loop, when it finds a worker dead itself)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rings: dict[int, set[Callable[[], object]]] = {}

    def watch(self, wids: Iterable[int], ring: Callable[[], object]) -> Callable[[], None]:
        """``ring`` is called whenever one of ``wids`` is rung, until the returned ``unwatch`` is."""
        wids = tuple(wids)
        with self._lock:
            for w in wids:
                self._rings.setdefault(w, set()).add(ring)

        def unwatch() -> None:
            with self._lock:
                for w in wids:
                    rings = self._rings.get(w)
                    if rings is not None:
                        rings.discard(ring)
                        if not rings:
                            del self._rings[w]
        return unwatch

    def ring(self, wid: int) -> int:
        """Wake every stream watching worker ``wid``; how many were."""
        with self._lock:
            rings = list(self._rings.get(wid, ()))
        for r in rings:
            try:
                r()
            except RuntimeError:   # its loop closed: that stream is gone
                pass
        return len(rings)

    def watched(self) -> int:
        with self._lock:
            return sum(len(r) for r in self._rings.values())


class DiedBeforeServing(Exception):
    """A worker of the route was found dead before anything reached the client."""

    def __init__(self, worker: WorkerRef):
        super().__init__(f"{worker.role} worker {worker.name} died before serving")
        self.worker = worker


class Stalled(Exception):
    """A worker of the route stopped making progress (the supervisor's deadline) while this
    request waited on it: ``what`` is decode, prefill or transfer (its prefill's write)."""

    def __init__(self, what: str, worker: WorkerRef):
        super().__init__(f"{what} on {worker.role} worker {worker.name} stopped making progress")
        self.what, self.worker = what, worker


class Died(Exception):
    """The decode worker a request waited on was found dead (the supervisor's push) before its
    stream call failed; handled as that call's RayActorError."""

    def __init__(self, worker: WorkerRef):
        super().__init__(f"decode worker {worker.name} died: {worker.error}")
        self.worker = worker


def _check(rid: str, d: WorkerRef, p: WorkerRef | None, limit: float) -> None:
    if not d.alive:
        raise Died(d)
    if d.suspect_since is not None:
        raise Stalled("decode", d)
    if p is not None and p.alive and p.suspect_since is not None:
        raise Stalled("prefill", p)
    if p is not None and p.alive and p.writing.get(rid, 0.0) > limit:
        raise Stalled("transfer", p)


async def next_or_alarm(nxt: Awaitable[StreamChunk | None], alarms: Alarms, rid: str, d: WorkerRef,
                        p: WorkerRef | None, limit: float, safety_s: float | None = None) -> StreamChunk | None:
    """``nxt`` (decode worker ``d``'s next chunk, None at its end), or, as soon as ``d``'s or ``p``'s
    alarm rings: :class:`Died` (``d`` dead), :class:`Stalled` (``d`` suspect; while the first token
    is due (``p`` given), ``p`` suspect or holding ``rid``'s KV write past ``limit`` seconds).
    ``nxt`` is cancelled when the wait ends without it."""
    loop = asyncio.get_running_loop()
    woke: list[asyncio.Future[Any]] = [loop.create_future()]   # the current wait's; a ring sets it

    def wake() -> None:
        if not woke[0].done():
            woke[0].set_result(None)

    unwatch = alarms.watch([d.wid] + ([p.wid] if p is not None else []), lambda: loop.call_soon_threadsafe(wake))
    task = asyncio.ensure_future(nxt)
    try:
        while True:
            if woke[0].done():
                woke[0] = loop.create_future()
            _check(rid, d, p, limit)   # after watching: a ring before it is seen here
            await asyncio.wait((task, woke[0]), timeout=SAFETY_S if safety_s is None else safety_s,
                               return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
    finally:
        unwatch()
        if not task.done():
            task.cancel()
