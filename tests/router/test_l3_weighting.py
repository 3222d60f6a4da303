"""With a shared L3 store (``PolicyConfig.l3_block_credit``), a prefix any worker reported in its
KV events is an L3 hit for every worker, weighed below the worker's own (device) hit."""

from __future__ import annotations

from tandem.router.policies import L3_BLOCK_CREDIT, PolicyConfig, PrefillEstimator, RouterState, choose
from tandem.router.prefix_index import HOST, GlobalBlockIndex, KVEvent, block_hashes
from tandem.router.view import DECODE, PREFILL, ClusterView, RouteRequest, WorkerView

HS = block_hashes(list(range(160)), 16)        # 10 blocks of 16 tokens
LINEAR = PrefillEstimator(overhead_s=0.0, per_token_s=1e-3, per_pair_s=0.0)   # 1 ms per new token


def view(*prefill):
    return ClusterView.of(list(prefill) + [WorkerView(10, DECODE)], 0.0)


def req():
    return RouteRequest("r", list(range(160)), 160, 1)


def test_known_prefix_is_the_leading_run_any_worker_holds_on_any_tier():
    ix = GlobalBlockIndex()
    assert ix.known_prefix(HS) == 0
    ix.apply(KVEvent(0, "stored", tuple(HS[:2]), 32))
    ix.apply(KVEvent(1, "stored", tuple(HS[:5]), 80, HOST))
    ix.apply(KVEvent(2, "stored", tuple(HS[6:8]), 32))           # after a gap: not a prefix
    assert ix.known_prefix(HS) == 5
    ix.remove_worker(1)
    assert ix.known_prefix(HS) == 2


def _state(credit: float, **cfg) -> RouterState:
    s = RouterState(PolicyConfig(kv_block_size=16, l3_block_credit=credit, **cfg))
    s.kv.apply(KVEvent(0, "stored", tuple(HS[:8]), 128))          # worker 0: 8 device blocks
    return s


def test_kv_events_counts_an_l3_hit_on_every_worker_at_a_discount():
    # worker 0: 2 blocks to prefill + 9 active = 11; worker 1: 10 + 2 active = 12 without L3,
    # 10 - 8 * 0.25 + 2 = 10 with it
    v = view(WorkerView(0, PREFILL, running_tokens=144), WorkerView(1, PREFILL, running_tokens=32))
    assert choose(v, req(), _state(0.0), "kv_events").prefill_worker == 0
    d = choose(v, req(), _state(L3_BLOCK_CREDIT), "kv_events")
    assert (d.prefill_worker, d.matched_tokens) == (1, 0)          # matched: device hits only


def test_kv_events_weighs_an_l3_hit_below_a_device_hit():
    v = view(WorkerView(0, PREFILL), WorkerView(1, PREFILL))       # equal load: the holder wins
    d = choose(v, req(), _state(L3_BLOCK_CREDIT), "kv_events")
    assert (d.prefill_worker, d.matched_tokens) == (0, 128)
    assert 0 < L3_BLOCK_CREDIT < PolicyConfig().host_block_credit < 1


def test_session_predicts_a_shorter_prefill_from_l3():
    # worker 0: 0.1 s queued + 32 new tokens = 0.132 s; worker 1 (idle): 160 new = 0.160 s, or
    # 160 - 128 * 0.25 = 128 with L3 = 0.128 s
    v = view(WorkerView(0, PREFILL, pending_s=0.1), WorkerView(1, PREFILL))
    for credit, want in [(0.0, 0), (L3_BLOCK_CREDIT, 1)]:
        s = _state(credit, estimator=LINEAR, duplicate_penalty=0.0)
        assert choose(v, req(), s, "session").prefill_worker == want, credit
