"""The dispatcher both serving backends route through: exact charges, admission (queue and
predicted wait, with the real cluster's estimate), snapshots, re-routing and dead workers."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from tandem.core.messages import GenerateRequest
from tandem.core.types import Overloaded, SamplingParams
from tandem.router.dispatch import Dispatcher
from tandem.router.policies import AdmissionLimits, PolicyConfig, PrefillEstimator
from tandem.router.view import WorkerSnapshot

# 1 ms per uncached token before anything is measured, no fixed or attention term
EST = PrefillEstimator(overhead_s=0.0, per_token_s=1e-3, per_pair_s=0.0)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def req(rid, n=100, sid=None):
    return GenerateRequest(rid, tuple(range(1, n + 1)), SamplingParams(max_tokens=8), session_id=sid)


def make(policy="least_load", limits=AdmissionLimits(), prefill=2, decode=2, names="t"):
    clock = Clock()
    d = Dispatcher(policy, PolicyConfig(estimator=EST), limits, clock=clock)
    for i in range(prefill):
        d.add_worker(i, "prefill", f"{names}-prefill-{i}", 1000)
    for j in range(decode):
        d.add_worker(10 + j, "decode", f"{names}-decode-{j}", 5000)
    return d, clock


def loads(d):
    v = d.view()
    return {w.worker_id: (w.in_flight, w.running_tokens) for w in v.prefill + v.decode}


def gauge(name, role):
    return REGISTRY.get_sample_value("tandem_worker_load", {"worker": name, "role": role})


def test_route_charges_and_release_gives_everything_back():
    d, clock = make(policy="round_robin", names="charge")
    r = d.route(req("a", 100))
    assert (r.prefill, r.decode, r.rid) == (0, 10, "a")
    assert loads(d) == {0: (1, 100), 1: (0, 0), 10: (1, 100), 11: (0, 0)}
    assert gauge("charge-prefill-0", "prefill") == 1 and gauge("charge-decode-0", "decode") == 1
    r2 = d.route(req("b", 30))                      # the next prefill and decode worker in turn
    assert (r2.prefill, r2.decode) == (1, 11)
    d.prefill_done(r)
    d.grow(r, 3)
    d.grow(r, 1)
    assert loads(d)[0] == (0, 0) and loads(d)[10] == (1, 104)
    d.release(r)
    d.release(r)                                    # idempotent
    d.grow(r, 5)                                    # after release: nothing
    assert loads(d) == {0: (0, 0), 1: (1, 30), 10: (0, 0), 11: (1, 30)}
    d.release(r2)                                   # before its first token: prefill released too
    assert all(v == (0, 0) for v in loads(d).values())
    assert gauge("charge-prefill-1", "prefill") == 0


def test_admission_by_queue_is_overloaded_with_retry_after():
    d, _ = make(limits=AdmissionLimits(max_queue=1, max_pending_s=1e9), names="queue")
    before = REGISTRY.get_sample_value("tandem_routing_decision_seconds_count") or 0
    a, b = d.route(req("a")), d.route(req("b"))
    with pytest.raises(Overloaded) as e:
        d.route(req("c"))
    assert "all 2 prefill workers are at their admission limits (queue 1" in str(e.value)
    assert e.value.retry_after_s >= 1
    assert REGISTRY.get_sample_value("tandem_routing_decision_seconds_count") - before == 3
    d.prefill_done(a)                               # one is back under its limit
    assert d.route(req("c")).prefill == a.prefill
    del b


def test_pending_s_is_queued_new_tokens_over_the_measured_rate():
    d, clock = make(prefill=1, decode=1, names="rate")
    a = d.route(req("a", 1000))
    b = d.route(req("b", 500))
    # before any measurement: the estimator's 1 ms per token
    assert d.pending_s(0) == pytest.approx(1.0 + 0.5)
    clock.t += 0.4                                   # the head has been in service 0.4 s
    assert d.pending_s(0) == pytest.approx(0.6 + 0.5)
    clock.t += 1.6                                   # a took 2 s: 500 tokens/s measured
    d.prefill_done(a)
    assert d.pending_s(0) == pytest.approx(500 / 500)
    clock.t += 0.5                                   # b: 500 tokens in 0.5 s (from a's end)
    d.prefill_done(b)
    assert d.pending_s(0) == 0.0
    d.route(req("c", 250))
    rate = 0.75 * 500 + 0.25 * 1000                  # the EWMA of the two samples
    assert d.pending_s(0) == pytest.approx(250 / rate)


def test_admission_by_predicted_wait_acts_without_a_reported_pending_s():
    """The real cluster's workers report no pending_s: max_pending_s acts on the estimate."""
    d, clock = make(prefill=1, decode=1, limits=AdmissionLimits(max_queue=100, max_pending_s=2.0),
                    names="wait")
    d.update_snapshot(0, WorkerSnapshot.from_stats({"waiting": 1, "running": 1, "total_tokens": 800}, clock()))
    d.route(req("a", 1500))                          # 1.5 s predicted
    d.route(req("b", 600))                           # 2.1 s: past the limit for the next one
    with pytest.raises(Overloaded, match=r"2s predicted wait\); retry in 1s") as e:
        d.route(req("c", 10))
    assert e.value.retry_after_s == 1
    clock.t += 1.0                                   # the head is half done: 1.1 s left
    assert d.route(req("c", 10)).prefill == 0
    assert d.view().prefill[0].capacity_tokens == 800   # the reported pool, not the configured one


def test_reported_waiting_tokens_count_traffic_the_records_never_saw():
    """Another router replica's requests show only in the worker's report: the estimate takes the
    larger of the records and the report plus what was routed since."""
    d, clock = make(prefill=1, decode=1, names="replica")
    d.update_snapshot(0, WorkerSnapshot.from_stats({"waiting_prompt_tokens": 3000}, clock()))
    assert d.pending_s(0) == pytest.approx(3.0)       # nothing routed here yet: the report's
    clock.t += 0.1
    d.route(req("a", 500))
    assert d.pending_s(0) == pytest.approx(3.5)       # the report, plus a (routed after it)
    d.update_snapshot(0, WorkerSnapshot.from_stats({"waiting_prompt_tokens": 0}, clock()))
    assert d.pending_s(0) == pytest.approx(0.5)       # a is computing: the records' count wins


def test_a_reported_pending_s_wins_over_the_estimate():
    d, clock = make(prefill=2, decode=1, policy="session", names="report")
    d.update_snapshot(0, WorkerSnapshot(clock(), pending_s=9.0))
    d.update_snapshot(1, WorkerSnapshot(clock(), pending_s=0.5))
    assert [w.pending_s for w in d.view().prefill] == [9.0, 0.5]
    r = d.route(req("a", 100))
    assert r.prefill == 1 and r.decision.predicted_ttft_s == pytest.approx(0.5 + 0.1)


def test_reroute_avoids_the_dead_decode_worker_and_moves_the_charges():
    d, _ = make(policy="session", names="reroute")
    r = d.route(req("a", 50, sid="s1"))
    dead, other = r.decode, 21 - r.decode             # decode workers 10 and 11
    assert d.mark_dead(dead) and not d.mark_dead(dead)
    r2 = d.reroute(r, dead)
    assert r2.decode == other and r2.prefill in (0, 1)
    assert loads(d)[dead] == (0, 0) and loads(d)[other] == (1, 50)
    assert d.route(req("b", 5, sid="s1")).decode == other   # the session moved with it


def test_excluded_decode_worker_is_never_chosen():
    d, _ = make(policy="round_robin", names="exclude")
    assert {d.route(req(f"r{i}"), exclude={10}).decode for i in range(4)} == {11}


def test_no_live_prefill_worker_means_decode_alone_and_no_admission():
    d, _ = make(limits=AdmissionLimits(max_queue=0), names="local")
    d.mark_dead(0)
    d.mark_dead(1)
    r = d.route(req("a", 40))
    assert (r.prefill, r.decode, r.prefill_open) == (-1, 10, False)
    d.mark_dead(10)
    d.mark_dead(11)
    r = d.route(req("b", 40))
    assert (r.prefill, r.decode) == (-1, -1)
    d.release(r)                                     # nothing was charged
    assert all(v == (0, 0) for k, v in loads(d).items() if k != 10)


def test_remove_worker_drops_its_gauge_and_ids_are_unique():
    d, _ = make(names="remove")
    assert gauge("remove-prefill-1", "prefill") == 0
    d.remove_worker(1)
    assert gauge("remove-prefill-1", "prefill") is None
    assert [w.worker_id for w in d.view().prefill] == [0]
    with pytest.raises(ValueError, match="already known"):
        d.add_worker(0, "prefill", "again")
    with pytest.raises(ValueError, match="role must be"):
        d.add_worker(99, "router", "x")


def test_snapshot_from_a_workers_stats():
    stats = {"worker": "prefill-0", "role": "prefill", "available_tokens": 4000, "evictable_tokens": 12,
             "total_tokens": 4096, "held": 0, "running": 2, "waiting": 3, "rows_free": 6,
             "live_transfers": 1, "ok": 5, "failed": 0, "aborted": 0, "bytes": 10, "pages": 3}
    s = WorkerSnapshot.from_stats(stats, 7.0)
    assert (s.at, s.waiting, s.running, s.total_tokens, s.available_tokens, s.pending_s) == \
        (7.0, 3, 2, 4096, 4000, None)
    assert s.waiting_prompt_tokens is None
    assert WorkerSnapshot.from_stats({**stats, "waiting_prompt_tokens": 77}, 0.0).waiting_prompt_tokens == 77
    assert WorkerSnapshot.from_stats({"pending_s": 1}, 0.0).pending_s == 1.0
    with pytest.raises(ValueError, match="waiting"):
        WorkerSnapshot.from_stats({"waiting": "3"}, 0.0)


def test_a_sample_group_is_pinned_admitted_once_and_charges_its_prompt_once():
    from dataclasses import replace

    from tandem.core.messages import SampleGroup

    d, clock = make(policy="round_robin", limits=AdmissionLimits(max_queue=1), prefill=2, names="grp")
    members = [replace(req(f"g-{i}", 100), group=SampleGroup("g", i, 4)) for i in range(4)]
    routes = [d.route(m) for m in members]           # round robin would spread them: pinned
    assert {(r.prefill, r.decode) for r in routes} == {(routes[0].prefill, routes[0].decode)}
    p = routes[0].prefill
    # the queue limit (1) would refuse the 2nd member: the group was admitted as a whole
    assert d.view().prefill[p].in_flight == 4
    assert d.pending_s(p) == pytest.approx((100 + 3 * 1) * 1e-3)   # the prompt once, +1 each
    assert loads(d)[routes[0].decode] == (4, 400)   # each member's own KV on decode
    for r in routes:
        d.release(r)
    assert all(v == (0, 0) for v in loads(d).values())
    # a dead pinned worker: that member is routed afresh
    members = [replace(req(f"h-{i}", 50), group=SampleGroup("h", i, 2)) for i in range(2)]
    first = d.route(members[0])
    d.mark_dead(first.decode)
    second = d.route(members[1])
    assert second.decode != first.decode and second.decode >= 0
