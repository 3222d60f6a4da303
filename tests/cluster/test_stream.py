"""cluster/stream.py: a request's attempt states move along LEGAL only, and the failure table says
what each failure costs (re-route, resume on a peer, or one error event naming why)."""

from __future__ import annotations

import pytest

from tandem.cluster import stream as S
from tandem.cluster.stream import LEGAL, TERMINAL, Attempt, Failure, IllegalAttempt, Next, RequestStream, Step


def _streaming(sent: int = 4, **kw) -> RequestStream:
    s = RequestStream("r", **kw)
    s.began, s.sent = True, sent
    s.to(Attempt.STREAMING)
    return s


def test_every_state_is_reachable_and_the_terminal_ones_have_no_way_out():
    reach, todo = {Attempt.ROUTED}, [Attempt.ROUTED]
    while todo:
        for n in LEGAL.get(todo.pop(), ()):
            if n not in reach:
                reach.add(n)
                todo.append(n)
    assert reach == set(Attempt)
    assert TERMINAL == {Attempt.DONE, Attempt.FAILED}


def test_an_illegal_transition_raises_and_changes_nothing():
    s = _streaming()
    s.to(Attempt.DONE)
    with pytest.raises(IllegalAttempt, match="DONE -> STREAMING"):
        s.to(Attempt.STREAMING)
    assert s.state is Attempt.DONE and s.ended
    r = RequestStream("r2")
    with pytest.raises(IllegalAttempt):
        r.to(Attempt.RESUMING)       # nothing was streamed: nothing to resume
    assert r.state is Attempt.ROUTED


def test_a_decode_death_mid_stream_resumes_until_max_failovers_then_fails_naming_it():
    s = _streaming(max_failovers=2)
    assert s.on_failure(Failure.DECODE_DIED, "decode-0") == Step(Next.RESUME)
    assert s.on_failure(Failure.DECODE_DIED, "decode-1") == Step(Next.RESUME)
    last = s.on_failure(Failure.DECODE_DIED, "decode-0-r1")
    assert last.next is Next.FAIL and s.failovers == 2
    assert "decode worker decode-0-r1 died" in last.why and "--max-failovers 2" in last.why


def test_max_failovers_0_is_the_error_event_of_before():
    step = _streaming(max_failovers=0).on_failure(Failure.DECODE_DIED, "decode-1")
    assert step.next is Next.FAIL and step.why.startswith("decode worker decode-1 died during the request")


def test_a_death_before_anything_was_sent_costs_one_re_route_once():
    s = RequestStream("r", max_attempts=3)
    assert s.on_failure(Failure.PREFILL_DIED, "prefill-0").next is Next.REDISPATCH
    assert s.wire_rid == "r"
    s.rerouted()
    assert s.state is Attempt.ROUTED and s.attempt == 1 and s.wire_rid == "r~1"   # a new worker-side id
    again = s.on_failure(Failure.DECODE_DIED, "decode-0")
    assert again.next is Next.FAIL and "decode worker decode-0 died" in again.why


def test_stalls_before_serving_re_dispatch_while_attempts_last_and_a_stuck_decode_mid_stream_resumes():
    s = RequestStream("r", max_attempts=3)
    for _ in range(2):
        assert s.on_failure(Failure.TRANSFER_STALLED, "prefill-0").next is Next.REDISPATCH
        s.rerouted()
    out = s.on_failure(Failure.PREFILL_STALLED, "prefill-0")
    assert out.next is Next.FAIL and "prefill worker prefill-0 stopped making progress" in out.why
    assert _streaming().on_failure(Failure.DECODE_STALLED, "decode-0") == Step(Next.RESUME)
    assert _streaming().failovers == 0    # a stall is not a failover


def test_a_new_behaviour_is_one_method_and_one_row_of_the_table(monkeypatch):
    """A hedged first token, say: a prefill worker that stalls is given up on at once (FAIL) instead
    of re-dispatched. One method, one row; nothing else changes."""

    class Hedged(RequestStream):
        failures = {**S.FAILURES, Failure.PREFILL_STALLED: "give_up"}

        def give_up(self, kind: Failure, worker: str) -> Step:
            return Step(Next.FAIL, f"{worker} was slow; hedged elsewhere")

    h = Hedged("r")
    assert h.on_failure(Failure.PREFILL_STALLED, "prefill-0") == Step(Next.FAIL, "prefill-0 was slow; hedged elsewhere")
    assert h.on_failure(Failure.TRANSFER_STALLED, "prefill-0").next is Next.REDISPATCH   # the other rows as before


def test_debug_kv_requests_come_from_the_streams_under_their_current_worker_side_id():
    """/debug/kv's ``requests``: each stream opened on a decode worker, by its current attempt's id
    (``rid~n`` after a re-route), with what its client has; one between attempts is not listed."""
    from types import SimpleNamespace

    from tandem.cluster.observe import ClusterObservability

    moved, waiting = RequestStream("a"), RequestStream("b")
    moved.rerouted()
    moved.sent = 5
    moved.legs = SimpleNamespace(worker=SimpleNamespace(name="decode-1"))   # its current leg's worker
    backend = SimpleNamespace(streams={"a": moved, "b": waiting})
    (row,) = ClusterObservability.in_flight(backend)
    assert (row["rid"], row["worker"], row["tokens"]) == ("a~1", "decode-1", 5) and row["silent_s"] >= 0
