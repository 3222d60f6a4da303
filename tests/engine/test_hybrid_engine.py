"""Hybrid models through the engine and the unified radix cache: FULL+SWA, FULL+MAMBA and
FULL+SWA+MAMBA tiny random models, and SmolLM2 with every layer sliding-window.

Oracles: greedy output with prefix reuse equals output with the cache disabled, and (tiny models)
a dense, pool-free recompute; across interleaved multi-turn sessions under eviction pressure
(small full, SWA and state pools), with ``debug_invariants`` (the cache's sanity check after every
operation, and the scheduler's exact ownership check over every pool after every step).
"""

from __future__ import annotations

import pytest
import torch

from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.core.types import Req, SamplingParams
from tandem.engine.engine import Engine
from tandem.engine.hybrid import HybridConfig
from tandem.engine.models.hybrid import tiny_hybrid

from hybrid_support import check_index_map, dense_greedy, run_sessions

LAYOUTS = ["full+swa", "full+mamba", "full+swa+mamba"]
WINDOW = 8


@pytest.fixture(scope="module")
def tiny():
    return {k: tiny_hybrid(k, sliding_window=WINDOW) for k in LAYOUTS}


def make_engine(loaded, *, page_size=1, max_total_tokens=320, disable=False, chunk=32,
                swa_pool_tokens=96, state_slots=8, max_running_requests=4, spec="ngram") -> Engine:
    cfg = EngineConfig(
        num_threads=1, speculative_algorithm=spec,
        cache=CacheConfig(page_size=page_size, max_total_tokens=max_total_tokens,
                          max_running_requests=max_running_requests, debug_invariants=True,
                          disable_prefix_cache=disable),
        scheduler=SchedulerConfig(chunked_prefill_size=chunk))
    return Engine(cfg, loaded=loaded,
                  hybrid=HybridConfig(swa_pool_tokens=swa_pool_tokens, state_slots=state_slots))


def idle_scheduler(loaded, **kw):
    """An engine whose thread is stopped: the test drives ``engine.step()`` itself."""
    e = make_engine(loaded, **kw)
    e.shutdown()
    return e, e.scheduler


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefix_reuse_equals_no_cache_and_dense(tiny, layout, page_size):
    loaded = tiny[layout]
    cached = make_engine(loaded, page_size=page_size)
    plain = make_engine(loaded, page_size=page_size, disable=True)
    try:
        a = run_sessions(cached)
        b = run_sessions(plain)
        stats, hstats = dict(cached.scheduler.stats), dict(cached.hybrid.stats)
        if "swa" in layout:
            with cached.paused_for_tests():
                assert check_index_map(cached) > 0
    finally:
        cached.shutdown()
        plain.shutdown()
    for s, (ta, tb) in enumerate(zip(a, b)):
        assert [o for _, o, _ in ta] == [o for _, o, _ in tb], f"session {s} differs with the prefix cache"
        assert all(c == 0 for _, _, c in tb)
    for prompt, out, _ in a[0]:                       # the pool-free oracle, on one session
        assert out == dense_greedy(loaded, prompt, len(out))
    later = [c for sess in a for _, _, c in sess[1:]]
    assert sum(later) > 0, f"later turns never hit the cache: {later}"
    assert stats["evicted_tokens"] > 0, "the small full pool should have forced eviction"
    if "swa" in layout:
        assert hstats["swa_released"] > 0
    if "mamba" in layout:
        assert hstats["checkpoints"] > 0


@pytest.fixture(scope="module")
def smollm2_swa(smollm2_swa16):
    return smollm2_swa16          # tests/conftest.py: one load per session


def test_smollm2_sliding_window_prefix_reuse_equals_no_cache(smollm2_swa):
    """SmolLM2 with sliding_window=16: every layer SWA, so the full pool holds no layers (slot ids
    only) and all KV lives in the SWA pool, reached through index_map."""
    tok = smollm2_swa.tokenizer

    def sessions(engine):
        hist = [[{"role": "system", "content": f"You are a concise assistant (session {s})."}]
                for s in range(2)]
        outs = [[], []]
        for turn in ("Name a color.", "Name an animal.", "Name a country."):
            reqs = []
            for s in range(2):
                hist[s].append({"role": "user", "content": turn})
                ids = tok.encode(tok.apply_chat_template(hist[s]))
                reqs.append(engine.make_request(ids, SamplingParams(max_tokens=6), session_id=f"s{s}"))
            for s, c in enumerate(engine.generate_many(reqs, timeout=300)):
                assert c.error is None, c.error
                outs[s].append((c.token_ids, c.cached_tokens))
                hist[s].append({"role": "assistant", "content": c.text})
        return outs

    kw = dict(page_size=4, max_total_tokens=128, swa_pool_tokens=128, chunk=64)
    cached = make_engine(smollm2_swa, **kw)
    plain = make_engine(smollm2_swa, disable=True, **kw)
    try:
        assert cached.kv_pool.full.kv_data.numel() == 0            # no full-attention layers
        a, b = sessions(cached), sessions(plain)
        stats, hstats = dict(cached.scheduler.stats), dict(cached.hybrid.stats)
    finally:
        cached.shutdown()
        plain.shutdown()
    assert [[t for t, _ in s] for s in a] == [[t for t, _ in s] for s in b]
    assert all(c > 0 for s in a for _, c in s[1:]), a
    assert stats["evicted_tokens"] > 0 and hstats["swa_released"] > 0


def test_window_release_frees_swa_rows(tiny):
    """A request whose window moved on owns at most window + 2 pages of SWA rows while its full
    slots grow with its length; the released positions become tombstones when it is cached."""
    ps, w = 4, WINDOW
    e, sched = idle_scheduler(tiny["full+swa"], page_size=ps, max_total_tokens=512,
                              swa_pool_tokens=128, chunk=16, spec="off")    # pins one token a step
    h = e.hybrid
    req = Req(list(range(30, 90)), SamplingParams(max_tokens=20, ignore_eos=True))  # 4 chunks
    sched.add(req)
    trace = []
    while sched.has_work():
        e.step()                                    # (debug_invariants: exact ownership, each step)
        if req.rid in sched.running:
            st = sched.running[req.rid]
            own = len(h.owned([(req, st.locked_len)])["swa"])
            trace.append((req.computed_len, own, h.swa_alloc.size - h.swa_alloc.available_size()))
    assert req.finish_reason == "length" and req.computed_len == 79
    # Chunks end at 16, 32, 48 and the prompt at 60; each is cached as it completes (the tree
    # keeps the window before each boundary; the request's older rows are released). Decoding
    # from 60, the request owns the rows of [max(60, floor4(floor4(len) - 8)), len): 1..11 rows
    # while its window fills, then 8..11, while the pool's total stays at 32 + what it owns.
    assert trace[:4] == [(16, 0, 8), (32, 0, 16), (48, 0, 24), (60, 0, 32)]
    assert [o for _, o, _ in trace[4:]] == list(range(1, 12)) + [8, 9, 10, 11] + [8, 9, 10]
    assert all(used == 32 + o for _, o, used in trace[4:])
    assert h.stats["swa_released"] == 8 + 8 + 8 + 4 + 8
    # Cached with tombstones: SWA rows only for the window before each cached boundary.
    m = sched.kv.cache.match(req.all_ids[:76])
    held = torch.nonzero(m.components["swa"] >= 0).flatten().tolist()
    assert len(m.device_indices) == 76
    assert held == [*range(8, 16), *range(24, 32), *range(40, 48), *range(52, 60), *range(68, 76)]
    assert h.swa_alloc.size - h.swa_alloc.available_size() == 40 == sched.kv.cache.stats().components["swa"][0]
    sched.check_invariants()

    # Without the cache the request alone holds rows and gives every one back at the end.
    e2, sched2 = idle_scheduler(tiny["full+swa"], page_size=ps, max_total_tokens=512,
                                swa_pool_tokens=128, chunk=16, disable=True)
    req2 = Req(list(req.prompt_ids), SamplingParams(max_tokens=20, ignore_eos=True))
    sched2.add(req2)
    peak = 0
    while sched2.has_work():
        e2.step()
        peak = max(peak, e2.hybrid.swa_alloc.size - e2.hybrid.swa_alloc.available_size())
    assert req2.output_ids == req.output_ids
    assert peak == w + ps - 1            # between steps: the window + a partial page, never more
    assert e2.hybrid.swa_alloc.available_size() == 128 and e2.allocator.available_size() == 512


def test_mamba_match_lands_only_on_checkpoints(tiny):
    """A prefix that diverges inside a cached edge is reused only up to the last checkpoint
    (a chunk boundary) before the divergence; FULL alone would reuse up to the divergence."""
    loaded = tiny["full+mamba"]
    e = make_engine(loaded, chunk=16, max_total_tokens=512, state_slots=16)
    plain = make_engine(loaded, chunk=16, max_total_tokens=512, disable=True)
    try:
        p = list(range(40, 90))                      # 50 tokens: chunks end at 16, 32, 48, prompt at 50
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        a = e.generate(p, params)
        with e.paused_for_tests():
            ends = _checkpoint_ends(e.kv.cache)
        assert ends == {16, 32, 48, 50, 50 + 6 - 1}             # chunk ends, prompt end, finish
        b_ids = p[:40] + [7, 7, 7, 7]                              # diverges at 40 (mid-edge 32..48)
        b = e.generate(b_ids, params)
        assert b.cached_tokens == 32 and b.cached_tokens in ends
        assert b.token_ids == plain.generate(b_ids, params).token_ids
        c_ids = p + a.token_ids + [1, 2, 3]                       # the next turn: the finish checkpoint
        c = e.generate(c_ids, params)
        assert c.cached_tokens == 55 and c.token_ids == plain.generate(c_ids, params).token_ids
        with e.paused_for_tests():
            ends = _checkpoint_ends(e.kv.cache)
        assert {16, 32, 48, 55} <= ends and 40 not in ends       # the split at 40 has no state
    finally:
        e.shutdown()
        plain.shutdown()


def test_mamba_checkpoint_at_page_boundary_via_track_row(tiny):
    """page_size 4: a request finishing at an unaligned length (55) still leaves a checkpoint at
    floor4(55) = 52 (the track row's copy of the state there), so the next turn reuses 52."""
    loaded = tiny["full+mamba"]
    e = make_engine(loaded, page_size=4, chunk=16, max_total_tokens=512, state_slots=16)
    plain = make_engine(loaded, page_size=4, chunk=16, max_total_tokens=512, disable=True)
    try:
        p = list(range(40, 90))
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        a = e.generate(p, params)                                  # computed: 50 + 5 = 55
        with e.paused_for_tests():
            assert _checkpoint_ends(e.kv.cache) == {16, 32, 48, 52}
        c_ids = p + a.token_ids + [1, 2, 3]
        c = e.generate(c_ids, params)
        assert c.cached_tokens == 52 and c.token_ids == plain.generate(c_ids, params).token_ids
    finally:
        e.shutdown()
        plain.shutdown()


def _checkpoint_ends(radix) -> set[int]:
    """Depths of the tree's nodes holding a recurrent-state checkpoint."""
    i = radix._aux_index["mamba"]
    out, stack = set(), [radix._tree.root]
    while stack:
        nd = stack.pop()
        stack.extend(nd.children.values())
        if nd.aux is not None and nd.aux[i] is not None:
            out.add(nd.end)
    return out
