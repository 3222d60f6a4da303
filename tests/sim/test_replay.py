"""The simulated cluster: determinism, agreement with a direct replay through one cache, the
trace-to-page mapping and the cost profile."""

from __future__ import annotations

import pytest

from tandem.router.policies import POLICIES
from tandem.sim.cost_model import LLAMA3_8B_H100, PROFILES, get_profile
from tandem.sim.replay.simulate import DEFAULT_TRACE, TraceRecord, load_trace, simulate, trace_key


@pytest.fixture(scope="module")
def slice200():
    return load_trace(DEFAULT_TRACE, limit=200)


def _strip(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in ("wall_s", "decision_us")}


@pytest.mark.parametrize("policy", ["session", "kv_events", "random"])
def test_deterministic(slice200, policy):
    kw = dict(prefill=3, decode=2, policy=policy, capacity_tokens=1_000_000, speedup=4.0)
    a, b = simulate(slice200, **kw), simulate(slice200, **kw)
    assert _strip(a) == _strip(b)
    assert a["completed"] == a["requests"] == 200


def test_one_prefill_worker_equals_direct_replay(slice200):
    """With one prefill worker (FCFS), hits are exactly those of replaying the slice in order
    through one simulated cache with the same capacity, as the engine uses it."""
    from tandem.cache.unified import UnifiedRadixCache

    cap = 400_000                                      # binds: the slice inserts ~3M tokens
    cache = UnifiedRadixCache.simulated(page_size=1, capacity_tokens=cap // 512)
    hit = total = 0
    for r in slice200:
        key = trace_key(r, 512)
        m = cache.match(key)
        cache.lock(m.last_device_node)
        hit += min(len(m.device_indices) * 512, r.input_length - 1)
        total += r.input_length
        cache.insert(key)
        cache.unlock(m.last_device_node)
        cache.check()
    assert cache.stats().device <= cap // 512
    for policy in ("round_robin", "session"):
        s = simulate(slice200, prefill=1, decode=1, policy=policy, capacity_tokens=cap)
        assert s["hit_rate"] == hit / total
        assert s["prefill_workers"][0]["hit_tokens"] == hit
    g = simulate(slice200, prefill=1, decode=1, policy="least_load", capacity_tokens=cap,
                 global_cache=True)
    assert g["hit_rate"] == hit / total


def test_global_cache_is_shared(slice200):
    per = simulate(slice200, prefill=4, decode=1, policy="round_robin", capacity_tokens=None)
    glob = simulate(slice200, prefill=4, decode=1, policy="round_robin", capacity_tokens=None,
                    global_cache=True)
    assert glob["hit_rate"] > per["hit_rate"]
    assert glob["global_cache_tokens_end"] > 0
    assert all(w["cached_tokens_end"] is None for w in glob["prefill_workers"])


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_completes(slice200, policy):
    s = simulate(slice200[:80], prefill=2, decode=2, policy=policy, capacity_tokens=500_000)
    assert s["completed"] == 80
    assert sum(w["requests"] for w in s["prefill_workers"]) == 80
    assert sum(w["requests"] for w in s["decode_workers"]) == 80
    assert 0.0 <= s["hit_rate"] < 1.0
    t = s["ttft_s"]
    assert 0 < t["p50"] <= t["p90"] <= t["p99"] <= t["max"]


def test_prefix_aware_beats_round_robin_on_hits(slice200):
    kw = dict(prefill=4, decode=2, capacity_tokens=3_000_000)
    rr = simulate(slice200, policy="round_robin", **kw)
    for policy in ("cache_aware", "kv_events", "session"):
        assert simulate(slice200, policy=policy, **kw)["hit_rate"] > rr["hit_rate"]


def test_trace_key_mapping():
    r = TraceRecord(0.0, 1100, 5, (7, 8, 9))            # 1100 tokens: 2 full blocks + 76
    assert trace_key(r, 512) == [7, 8, 9]
    assert trace_key(r, 256) == [14, 15, 16, 17, 18]    # ceil(1100 / 256) = 5 pages
    assert trace_key(r, 1024) == [8, 9]                 # a page named by its last block
    with pytest.raises(ValueError):
        trace_key(r, 300)


def test_bad_arguments(slice200):
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(slice200[:5], policy="fastest")
    with pytest.raises(ValueError):
        simulate(slice200[:5], prefill=0)
    with pytest.raises(ValueError, match="unknown profile"):
        simulate(slice200[:5], profile="h100-9000")


def test_cost_profile():
    p = get_profile("llama3-8b-h100")
    assert p is LLAMA3_8B_H100 and set(PROFILES) >= {"llama3-8b-h100", "llama3-70b-h100x8"}
    assert p.kv_bytes_per_token == 131072                  # 2 * 32 layers * 8 heads * 128 * 2 B
    assert p.prefill_s(15000) == pytest.approx(0.529, abs=0.005)
    assert p.prefill_s(5000, 10000) < p.prefill_s(15000)   # cached tokens are not recomputed
    assert p.prefill_s(2000, 20000) > p.prefill_s(2000)    # but new tokens attend to them
    assert p.estimator().seconds(1000, 500) == p.prefill_s(1000, 500)
    assert p.decode_step_s(1, 15000) == pytest.approx(0.0099, abs=0.0005)
    assert p.decode_step_s(32, 480000) > p.decode_step_s(1, 15000)
    assert p.kv_transfer_s(15000) == pytest.approx(0.001 + 15000 * 131072 / 40e9)
