"""Decode retraction with host-pool backup, on the real SmolLM2 (engine level).

Oracle: every request's greedy tokens and streamed text equal an uncontended run's after its KV
was backed up to the host and restored, with the cache's and the engine's ownership invariants
checked after every step. The recompute path, aborts while retracted, victims and the forced
lever are pinned without a model in test_scheduler_fake.py; both paths run through a real 1P+1D
cluster in tests/cluster/test_retraction_cluster.py."""

from __future__ import annotations


import pytest

from tandem.core.config import CacheConfig, EngineConfig
from tandem.core.types import SamplingParams
from tandem.engine.engine import Engine

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "The three primary colors are", "Water boils at", "List three fruits:",
    "In 1969, the first humans", "The quick brown fox",
]
N = [20, 24, 16, 28, 22, 18, 26, 20]


@pytest.fixture(scope="module")
def loaded(smollm2_default):
    return smollm2_default   # the default numerics (bf16 + native weights here)


@pytest.fixture(scope="module")
def alone(loaded):
    e = Engine(EngineConfig(cache=CacheConfig(max_total_tokens=4096)), loaded=loaded)
    try:
        return _run(e)        # all at once: the pool holds them (no retraction)
    finally:
        e.shutdown()


def contended(loaded, host_pool_tokens: int) -> Engine:
    return Engine(EngineConfig(cache=CacheConfig(max_total_tokens=96, page_size=4,
                                                 host_pool_tokens=host_pool_tokens,
                                                 debug_invariants=True)), loaded=loaded)


def _run(e: Engine):
    reqs = [e.make_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(PROMPTS, N)]
    return e.generate_many(reqs, timeout=300)


def _idle(e: Engine):
    snap = e.snapshot()
    return (snap.available_tokens + snap.evictable_tokens, snap.locked_tokens, snap.retracted,
            snap.rows_free)


def test_host_backup_restores_without_recompute(loaded, alone):
    e = contended(loaded, host_pool_tokens=2048)
    try:
        outs = _run(e)
        st = e.scheduler.stats
        assert st["retractions"] > 0 and st["retraction_restores"] > 0
        assert st["retraction_recomputes"] == 0 and st["retraction_aborts"] == 0
        assert st["backup_tokens"] > 0 and st["restore_tokens"] > 0
        for i, c in enumerate(outs):
            assert c.error is None and c.token_ids == alone[i].token_ids, f"request {i} differs after restore"
            # the streamed text too: a resumed request must not stream its output again
            assert c.text == alone[i].text, f"request {i}'s streamed text differs after restore"
        assert _idle(e) == (e.allocator.size, 0, 0, e.req_to_token.size)
    finally:
        e.shutdown()


def test_seeded_sampling_after_recompute_equals_uncontended(loaded):
    """A seeded draw is keyed by (seed, position) (engine/sampler.py): a retracted request that
    is recomputed from its prompt and outputs samples on as if it had never been retracted."""
    def run(e):
        reqs = [e.make_request(p, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8, seed=100 + i))
                for i, (p, n) in enumerate(zip(PROMPTS, N))]
        return e.generate_many(reqs, timeout=300)

    ref_engine = Engine(EngineConfig(cache=CacheConfig(max_total_tokens=4096)), loaded=loaded)
    try:
        ref = run(ref_engine)
    finally:
        ref_engine.shutdown()
    e = contended(loaded, host_pool_tokens=0)
    try:
        outs = run(e)
        assert e.scheduler.stats["retraction_recomputes"] > 0
        assert [c.token_ids for c in outs] == [c.token_ids for c in ref]
        assert len({tuple(c.token_ids) for c in outs}) == len(outs)
    finally:
        e.shutdown()
