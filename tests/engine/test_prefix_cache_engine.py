"""Greedy output with prefix reuse equals output with the cache disabled, on the real SmolLM2,
across multi-turn sessions under eviction pressure, at page sizes 1 and 4; cached tokens are
reported, and the cache's invariants hold after every step."""

from __future__ import annotations

import pytest

from tandem.core.config import CacheConfig, EngineConfig
from tandem.core.types import SamplingParams
from tandem.engine.engine import Engine

SYSTEM = "You are a concise assistant. Answer in one short sentence."
TURNS = ["Name a color.", "Name an animal.", "Name a country."]


@pytest.fixture(scope="module")
def loaded(smollm2_default):
    return smollm2_default   # the default numerics (bf16 + native weights here)


def run_sessions(engine: Engine, n_sessions: int = 3) -> list[list[tuple[list[int], int]]]:
    """Each session's turns as (output ids, cached tokens); sessions interleave turn by turn."""
    tok = engine.tokenizer
    history = {s: [{"role": "system", "content": f"{SYSTEM} (session {s})"}] for s in range(n_sessions)}
    out = {s: [] for s in range(n_sessions)}
    for turn in TURNS:
        reqs = []
        for s in range(n_sessions):
            history[s].append({"role": "user", "content": turn})
            ids = tok.encode(tok.apply_chat_template(history[s]))
            reqs.append(engine.make_request(ids, SamplingParams(max_tokens=12), session_id=f"s{s}"))
        for s, c in enumerate(engine.generate_many(reqs, timeout=300)):
            assert c.error is None
            out[s].append((c.token_ids, c.cached_tokens))
            history[s].append({"role": "assistant", "content": c.text})
    return [out[s] for s in range(n_sessions)]


@pytest.mark.parametrize("page_size,max_total_tokens", [(1, 4096), (4, 200)])
def test_prefix_reuse_equals_no_cache(loaded, page_size, max_total_tokens):
    kw = dict(page_size=page_size, max_total_tokens=max_total_tokens, debug_invariants=True)
    cached = Engine(EngineConfig(cache=CacheConfig(**kw)), loaded=loaded)
    plain = Engine(EngineConfig(cache=CacheConfig(disable_prefix_cache=True, **kw)), loaded=loaded)
    try:
        a = run_sessions(cached)
        b = run_sessions(plain)
        stats = cached.scheduler.stats
    finally:
        cached.shutdown()
        plain.shutdown()
    for s, (ta, tb) in enumerate(zip(a, b)):
        assert [t for t, _ in ta] == [t for t, _ in tb], f"session {s} differs with the prefix cache"
        assert all(c == 0 for _, c in tb)
        assert all(c > 0 for _, c in ta[1:]), f"session {s}: later turns should hit the cache"
    if max_total_tokens < 1000:
        assert stats["evicted_tokens"] > 0, "the small pool should have forced eviction"


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_lpm_lets_the_first_of_a_shared_prefix_compute_it(loaded, policy):
    """Four requests sharing a long uncached prefix arrive together: under lpm the first computes
    the prefix and the others wait one step and hit it; under fcfs all four compute it."""
    from tandem.core.config import SchedulerConfig

    e = Engine(EngineConfig(cache=CacheConfig(max_total_tokens=4096, debug_invariants=True),
                            scheduler=SchedulerConfig(schedule_policy=policy)), loaded=loaded)
    try:
        shared = " ".join(f"word{i}" for i in range(60))
        reqs = [e.make_request(f"{shared} question {i}:", SamplingParams(max_tokens=2)) for i in range(4)]
        e.snapshot()   # the engine thread is up and idle before the four arrive together
        outs = e.generate_many(reqs, timeout=120)
    finally:
        e.shutdown()
    cached = sorted(c.cached_tokens for c in outs)
    if policy == "lpm":
        assert cached[0] == 0 and all(c > 100 for c in cached[1:]), cached
    else:
        assert sum(c > 0 for c in cached) <= 1, cached
