"""cluster/alarms.py with the real Supervisor (no Ray: its pool holds stand-in handles): suspicion and
death are pushed into a waiting stream, which reacts in milliseconds, not at a poll; with nothing rung,
only the safety net wakes it."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from tandem.cluster.alarms import Alarms, Died, Stalled, next_or_alarm
from tandem.cluster.stream import Failure, Next, RequestStream
from tandem.cluster.supervisor import Supervisor
from tandem.cluster.workers import DECODE, PREFILL, WorkerPool, WorkerRef

PUSH_AFTER_S = 0.05
REACT_S = 0.1   # the old poll was 0.25 s; the safety net is SAFETY_S (5 s)


def _supervisor() -> Supervisor:
    dispatch = SimpleNamespace(mark_dead=lambda wid: True, mark_suspect=lambda wid, s=True: True)
    sup = Supervisor(WorkerPool(), dispatch, SimpleNamespace(detached=False), progress_timeout_s=3.0)
    sup._forget = lambda w: None   # peers forgetting its NIXL agent needs live actors: none here
    return sup


async def _react(sup: Supervisor, push, d: WorkerRef, p: WorkerRef | None = None, safety_s: float | None = None):
    """Wait on a chunk that never comes from ``d`` while ``push`` runs on another thread after
    ``PUSH_AFTER_S``; (what the wait raised, seconds from the push to the reaction)."""
    never = asyncio.get_running_loop().create_future()
    pushed = []
    timer = threading.Timer(PUSH_AFTER_S, lambda: (pushed.append(time.monotonic()), push()))
    timer.start()
    try:
        await next_or_alarm(never, sup.alarms, "r1", d, p, limit=3.0, safety_s=safety_s)
    except (Died, Stalled) as e:
        return e, time.monotonic() - pushed[0]
    finally:
        timer.join()
    raise AssertionError("the wait ended without an alarm")


def test_a_pushed_death_ends_the_wait_at_once_and_the_failure_table_resumes_it():
    sup = _supervisor()
    d = WorkerRef("decode-0", DECODE, 0, None)
    stream = RequestStream("r1", max_failovers=2)
    stream.sent = 4

    async def run():
        e, after = await _react(sup, lambda: sup.mark_dead(d, "killed"), d)
        step = stream.on_failure(Failure.DECODE_DIED, e.worker.name)
        return e, after, step

    e, after, step = asyncio.run(run())
    assert isinstance(e, Died) and e.worker is d and "killed" in str(e)
    assert after < REACT_S, f"reacted {after:.3f}s after the push"
    assert step.next is Next.RESUME and stream.failovers == 1
    assert sup.alarms.watched() == 0   # the wait stopped watching


def test_a_pushed_suspicion_of_the_decode_worker_or_its_prefill_ends_the_wait_as_a_stall():
    sup = _supervisor()
    d, p = WorkerRef("decode-0", DECODE, 0, None), WorkerRef("prefill-0", PREFILL, 0, None)

    def silent(w):
        w.last_answer = time.monotonic() - 10.0   # past progress_timeout_s: _judge finds it suspect
        return lambda: sup._judge([w])

    e, after = asyncio.run(_react(sup, silent(d), d))
    assert isinstance(e, Stalled) and e.what == "decode" and after < REACT_S
    e, after = asyncio.run(_react(sup, silent(p), WorkerRef("decode-1", DECODE, 1, None), p))
    assert isinstance(e, Stalled) and e.what == "prefill" and e.worker is p and after < REACT_S


def test_without_a_ring_only_the_safety_net_wakes_the_wait():
    """The control: the same death, not rung, is seen only at the safety net (0.4 s here), so the
    speed above is the push's."""
    d = WorkerRef("decode-0", DECODE, 0, None)

    def die_quietly():
        d.alive = False

    e, after = asyncio.run(_react(_supervisor(), die_quietly, d, safety_s=0.4))
    assert isinstance(e, Died) and after > 0.3


def test_a_chunk_wins_over_an_alarm_that_did_not_ring_and_a_closed_loop_does_not_break_a_ring():
    a = Alarms()
    d = WorkerRef("decode-0", DECODE, 0, None)

    async def chunk():
        return "chunk"

    assert asyncio.run(next_or_alarm(chunk(), a, "r1", d, None, limit=3.0)) == "chunk"
    assert a.watched() == 0
    loop = asyncio.new_event_loop()
    loop.close()
    unwatch = a.watch([d.wid], lambda: loop.call_soon_threadsafe(print))
    assert a.ring(d.wid) == 1   # the closed loop's RuntimeError is swallowed
    unwatch()
    assert a.ring(d.wid) == 0


def test_a_worker_already_dead_when_the_wait_starts_is_seen_at_once():
    d = WorkerRef("decode-0", DECODE, 0, None, alive=False)   # rung before anyone watched

    async def run():
        never = asyncio.get_running_loop().create_future()
        t0 = time.monotonic()
        with pytest.raises(Died):
            await next_or_alarm(never, Alarms(), "r1", d, None, limit=3.0)
        return time.monotonic() - t0

    assert asyncio.run(run()) < REACT_S
