"""Routing policies on small hand-built views: exact choices, reasons and predictions."""

from __future__ import annotations

import pytest

from tandem.router.policies import (POLICIES, AdmissionLimits, PolicyConfig, PrefillEstimator,
                                    RouterState, admit, choose, retry_after_s)
from tandem.router.prefix_index import HOST, KVEvent, block_hashes
from tandem.router.view import DECODE, PREFILL, ClusterView, RouteRequest, WorkerView


def P(i, **kw):
    return WorkerView(i, PREFILL, **kw)


def D(i, **kw):
    return WorkerView(i, DECODE, **kw)


def view(ps, ds=(), now=0.0):
    return ClusterView.of(list(ps) + list(ds), now)


def req(key, prompt=None, sid=None, fp=None, unit=1):
    return RouteRequest("r", list(key), len(key) * unit if prompt is None else prompt, unit,
                        session_id=sid, fingerprint=fp)


def pick(v, r, state, policy):
    d = choose(v, r, state, policy)
    return d.prefill_worker, d.decode_worker


# -- prefix-oblivious ----------------------------------------------------------------------------
def test_round_robin_turns_and_skips_dead():
    s = RouterState()
    v = view([P(0), P(1), P(2)], [D(10), D(11)])
    assert [pick(v, req([1]), s, "round_robin") for _ in range(4)] == [(0, 10), (1, 11), (2, 10), (0, 11)]
    s = RouterState()
    v = view([P(0), P(1, alive=False), P(2)], [D(10)])
    assert [pick(v, req([1]), s, "round_robin") for _ in range(3)] == [(0, 10), (2, 10), (0, 10)]


def test_random_is_seeded_and_alive_only():
    v = view([P(0), P(1, alive=False), P(2), P(3)], [D(10), D(11)])
    a = [pick(v, req([1]), RouterState(PolicyConfig(seed=7)), "random") for _ in range(1)]
    s1, s2 = RouterState(PolicyConfig(seed=7)), RouterState(PolicyConfig(seed=7))
    seq1 = [pick(v, req([1]), s1, "random") for _ in range(30)]
    seq2 = [pick(v, req([1]), s2, "random") for _ in range(30)]
    assert seq1 == seq2 and seq1[0] == a[0]
    assert {p for p, _ in seq1} == {0, 2, 3} and {d for _, d in seq1} == {10, 11}
    s3 = RouterState(PolicyConfig(seed=8))
    assert [pick(v, req([1]), s3, "random") for _ in range(30)] != seq1


def test_least_load_prefill_and_decode():
    s = RouterState()
    v = view([P(0, in_flight=3), P(1, in_flight=1, running_tokens=9), P(2, in_flight=1, running_tokens=5)],
             [D(10, running_tokens=100), D(11, running_tokens=50, in_flight=9)])
    d = choose(v, req([1]), s, "least_load")
    assert (d.prefill_worker, d.decode_worker, d.reason) == (2, 11, "load")


def test_least_load_ties_go_in_turn():
    s = RouterState()
    v = view([P(0), P(1), P(2, in_flight=1)], [D(10), D(11)])
    assert [pick(v, req([1]), s, "least_load") for _ in range(3)] == [(1, 11), (0, 10), (1, 11)]


# -- cache_aware (SGLang) ------------------------------------------------------------------------
def test_cache_aware_best_prefix_over_threshold():
    s = RouterState()
    s.approx.insert(1, range(10))
    v = view([P(0), P(1), P(2)], [D(10)])
    d = choose(v, req(range(12)), s, "cache_aware")
    assert (d.prefill_worker, d.reason, d.matched_tokens) == (1, "prefix", 10)
    assert s.approx.match(list(range(12))) == {1: 12}        # routed prefix recorded


def test_cache_aware_smallest_tree_under_threshold():
    s = RouterState()
    s.approx.insert(0, [1, 2])
    s.approx.insert(1, range(50, 60))
    v = view([P(0), P(1), P(2)], [D(10)])
    d = choose(v, req([1, 2] + list(range(100, 118))), s, "cache_aware")   # 2/20 <= 0.3
    assert (d.prefill_worker, d.reason) == (2, "smallest_tree")


@pytest.mark.parametrize("loads,want,reason", [
    ((100, 10), 1, "imbalance"),     # 90 > 64 and 100 > 1.5 * 10: shortest queue
    ((300, 230), 0, "prefix"),       # 70 > 64 but 300 <= 345: balanced enough
    ((60, 0), 0, "prefix"),          # 60 <= 64
])
def test_cache_aware_imbalance_gate(loads, want, reason):
    s = RouterState()
    s.approx.insert(0, range(10))
    v = view([P(0, in_flight=loads[0]), P(1, in_flight=loads[1])], [D(10)])
    d = choose(v, req(range(10)), s, "cache_aware")
    assert (d.prefill_worker, d.reason) == (want, reason)


# -- kv_events (Dynamo) --------------------------------------------------------------------------
def _kv_state(**cfg):
    s = RouterState(PolicyConfig(kv_block_size=16, **cfg))
    hs = block_hashes(list(range(160)), 16)                    # 10 blocks
    s.kv.apply(KVEvent(0, "stored", tuple(hs[:2]), 32))
    s.kv.apply(KVEvent(1, "stored", tuple(hs[:5]), 80))
    s.kv.apply(KVEvent(2, "stored", tuple(hs[:8]), 128))
    return s, hs


def test_kv_events_dynamo_worked_example():
    # Dynamo's KV router cost (weight 1): W1 = 8 + 10 = 18, W2 = 5 + 5 = 10 (chosen), W3 = 2 + 9 = 11
    s, _ = _kv_state()
    v = view([P(0, running_tokens=160), P(1, running_tokens=80), P(2, running_tokens=144)],
             [D(10, running_tokens=5), D(11)])
    d = choose(v, req(range(160)), s, "kv_events")
    assert (d.prefill_worker, d.decode_worker, d.reason, d.matched_tokens) == (1, 11, "kv_cost", 80)
    pre = RouteRequest("r", list(range(160)), 160, block_hashes=tuple(block_hashes(list(range(160)), 16)))
    assert choose(v, pre, s, "kv_events").prefill_worker == 1          # precomputed hashes


def test_kv_events_weight_and_host_credit():
    s, hs = _kv_state(overlap_weight=0.0)                      # pure load: fewest active blocks
    v = view([P(0, running_tokens=160), P(1, running_tokens=80), P(2, running_tokens=64)], [D(10)])
    assert choose(v, req(range(160)), s, "kv_events").prefill_worker == 2
    s, hs = _kv_state()
    s.kv.apply(KVEvent(0, "stored", tuple(hs[2:]), 128, HOST))   # W1: 2 device + 8 host blocks
    v = view([P(0, running_tokens=0), P(1, running_tokens=80), P(2, running_tokens=144)], [D(10)])
    d = choose(v, req(range(160)), s, "kv_events")             # W1: 10 - 2 - 8 * 0.5 = 4 + 0
    assert (d.prefill_worker, d.matched_tokens) == (0, 32)


# -- session (default) ---------------------------------------------------------------------------
LINEAR = PrefillEstimator(overhead_s=0.0, per_token_s=1e-3, per_pair_s=0.0)   # 1 ms per new token


def test_session_picks_min_predicted_ttft_with_prefix():
    s = RouterState(PolicyConfig(estimator=LINEAR))
    s.approx.insert(1, range(100))
    v = view([P(0), P(1)], [D(10)])
    d = choose(v, req(range(120)), s, "session")
    assert (d.prefill_worker, d.reason, d.matched_tokens) == (1, "prefix", 100)
    assert d.predicted_ttft_s == pytest.approx(0.020)


def test_session_is_load_aware_and_charges_duplicates():
    v = view([P(0), P(1, pending_s=1.0)], [D(10)])
    s = RouterState(PolicyConfig(estimator=LINEAR))
    s.approx.insert(1, range(100))
    d = choose(v, req(range(120)), s, "session")               # 1.02 s vs 0.12 + 0.10 dup
    assert (d.prefill_worker, d.reason) == (0, "load")
    assert d.predicted_ttft_s == pytest.approx(0.120)
    v = view([P(0), P(1, pending_s=0.15)], [D(10)])
    for penalty, want in [(1.0, 1), (0.0, 0)]:                 # 0.17 vs 0.12 (+ 0.10 duplicated)
        s = RouterState(PolicyConfig(estimator=LINEAR, duplicate_penalty=penalty))
        s.approx.insert(1, range(100))
        assert choose(v, req(range(120)), s, "session").prefill_worker == want


def test_session_charges_evictions_when_capacity_is_known():
    v = view([P(0), P(1, pending_s=0.03)], [D(10)])
    for cap, want in [(100, 1), (None, 0)]:        # w0 full: 0.05 + 0.05 evicted vs 0.08
        s = RouterState(PolicyConfig(estimator=LINEAR, index_capacity=cap))
        s.approx.insert(0, range(1000, 1100))
        assert choose(v, req(range(50)), s, "session").prefill_worker == want


def test_session_sticky_prefill_and_decode():
    s = RouterState(PolicyConfig(estimator=LINEAR))
    s.approx.insert(1, range(100))
    v1 = view([P(0), P(1)], [D(10, running_tokens=500), D(11)], now=1.0)
    assert pick(v1, req(range(120), sid="s"), s, "session") == (1, 11)
    # turn 2: w0 is idle and D10 lighter, but the session stays (not overloaded)
    v2 = view([P(0), P(1, queue_len=3, pending_s=2.0)], [D(10), D(11, running_tokens=1000)], now=2.0)
    d = choose(v2, req(range(140), sid="s"), s, "session")
    assert (d.prefill_worker, d.decode_worker, d.reason) == (1, 11, "sticky")
    assert s.sessions.get("s", 2.0).turns == 2
    # a fingerprint is a session key too
    s.approx.insert(0, range(500, 600))
    assert pick(v1, req(range(500, 620), fp=99), s, "session")[0] == 0
    assert choose(v2, req(range(500, 640), fp=99), s, "session").reason == "sticky"


@pytest.mark.parametrize("sticky", [
    dict(queue_len=16),                  # queue at the spill limit
    dict(pending_s=5.0),                 # predicted queueing at the limit
    dict(alive=False),                   # gone
])
def test_session_spills_when_overloaded_or_dead(sticky):
    s = RouterState(PolicyConfig(estimator=LINEAR))
    s.approx.insert(1, range(100))
    assert choose(view([P(0), P(1)], [D(10)]), req(range(120), sid="s"), s, "session").prefill_worker == 1
    v = view([P(0), P(1, **sticky)], [D(10)], now=1.0)
    d = choose(v, req(range(130), sid="s"), s, "session")
    assert (d.prefill_worker, d.reason) == (0, "spill")
    assert s.sessions.get("s", 1.0).prefill_worker == 0       # the session moved
    d = choose(view([P(0), P(1)], [D(10)], now=2.0), req(range(140), sid="s"), s, "session")
    assert (d.prefill_worker, d.reason) == (0, "sticky")


@pytest.mark.parametrize("other", [
    dict(running_tokens=100_000),                              # > 2 x 0 + 32768
    dict(running_tokens=950, capacity_tokens=1000),            # >= 90% full
    dict(alive=False),
])
def test_session_decode_moves_when_overloaded(other):
    s = RouterState(PolicyConfig(estimator=LINEAR))
    v = view([P(0)], [D(10, running_tokens=10), D(11)])
    assert choose(v, req(range(10), sid="s"), s, "session").decode_worker == 11
    v = view([P(0)], [D(10), D(11, **other)], now=1.0)
    assert choose(v, req(range(20), sid="s"), s, "session").decode_worker == 10


def test_session_ttl_expiry_forgets_stickiness():
    s = RouterState(PolicyConfig(estimator=LINEAR, session_ttl_s=10))
    s.approx.insert(1, range(100))
    assert pick(view([P(0), P(1)], [D(10)]), req(range(120), sid="s"), s, "session")[0] == 1
    s.approx.remove_worker(1)
    v = view([P(0), P(1, pending_s=0.5)], [D(10)], now=11.0)   # expired: cost decides (w0)
    assert choose(v, req(range(120), sid="s"), s, "session").reason == "load"


# -- all policies --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_no_alive_prefill_worker(policy):
    d = choose(view([P(0, alive=False)], [D(10)]), req([1]), RouterState(), policy)
    assert (d.prefill_worker, d.decode_worker, d.reason) == (-1, -1, "no_worker")


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_picks_alive_workers(policy):
    v = view([P(0, alive=False), P(1), P(2)], [D(10, alive=False), D(11)])
    s = RouterState()
    for i in range(5):
        p, d = pick(v, req(range(i, i + 20)), s, policy)
        assert p in (1, 2) and d == 11


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown policy"):
        choose(view([P(0)], [D(1)]), req([1]), RouterState(), "fastest")


# -- admission -----------------------------------------------------------------------------------
def test_admit():
    lim = AdmissionLimits(max_queue=4, max_pending_s=10.0)
    assert admit(view([P(0, queue_len=4), P(1, queue_len=3)]), lim)
    assert not admit(view([P(0, queue_len=4), P(1, pending_s=10.0)]), lim)
    assert not admit(view([P(0, queue_len=9), P(1, alive=False)]), lim)     # the dead do not count
    assert not admit(view([]), lim)


def test_retry_after():
    lim = AdmissionLimits(max_queue=4, max_pending_s=10.0)
    # w0: max(12 - 10, (6 - 4 + 1) * 12 / 6) = 6; w1: max(30 - 10, 1 * 30 / 4) = 20 -> 6
    v = view([P(0, queue_len=6, pending_s=12.0), P(1, queue_len=4, pending_s=30.0)])
    assert retry_after_s(v, lim) == 6
    assert retry_after_s(view([P(0, queue_len=4, pending_s=0.1)]), lim) == 1      # at least 1
    assert retry_after_s(view([P(0, queue_len=4, pending_s=900.0)]), lim) == 60   # at most 60
    assert retry_after_s(view([P(0, alive=False)]), lim) == 5                      # none alive


def test_forget_worker_drops_everything_known_about_it():
    s = RouterState()
    s.approx.insert(1, range(10))
    s.kv.apply(KVEvent(1, "stored", (5, 6), 32))
    s.sessions.bind("s", 1, 10, now=0.0)
    s.forget_worker(1)
    assert s.approx.match(list(range(10))) == {}
    assert s.kv.overlap([5, 6]) == {}
    assert s.sessions.get("s", 0.0) is None
