"""The engine on the real SmolLM2: batching invariance, chunked prefill, retraction, sampling,
stop conditions, abort accounting and bad input. Oracles: a request's greedy tokens alone equal
its tokens when batched, chunked, or retracted and recomputed."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.core.types import InvalidRequest, SamplingParams
from tandem.engine.engine import Engine

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at",
    "List three fruits:",
    "In 1969, the first humans",
    "The quick brown fox",
    "Q: What is 12 times 12?\nA:",
    "import numpy as np\n",
]


@pytest.fixture(scope="module")
def loaded(smollm2_default):
    return smollm2_default   # the default numerics (bf16 + native weights here)


def make_engine(loaded, **cache_kw) -> Engine:
    sched = cache_kw.pop("scheduler", SchedulerConfig())
    cfg = EngineConfig(cache=CacheConfig(**{"max_total_tokens": 8192, **cache_kw}), scheduler=sched)
    return Engine(cfg, loaded=loaded)


@pytest.fixture(scope="module")
def engine(loaded):
    e = make_engine(loaded, debug_invariants=True)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def alone(engine):
    """Greedy tokens of each prompt run alone (the oracle)."""
    out = []
    for i, p in enumerate(PROMPTS):
        n = 8 + (i * 5) % 20
        c = engine.generate(p, SamplingParams(max_tokens=n, ignore_eos=True))
        assert c.finish_reason == "length" and len(c.token_ids) == n
        out.append(c.token_ids)
    return out


def _idle_accounting(e: Engine) -> tuple[int, int]:
    snap = e.snapshot()
    return snap.available_tokens + snap.evictable_tokens, snap.rows_free


def test_batched_requests_arriving_at_different_times_match_alone(engine, alone):
    results, lock = {}, threading.Lock()
    done = threading.Event()

    def cb(c):
        with lock:
            results.setdefault(c.rid, []).extend(c.token_ids)
            if c.finish_reason is not None:
                results[c.rid + ":done"] = c.finish_reason
                if sum(k.endswith(":done") for k in results) == len(PROMPTS):
                    done.set()

    for i, p in enumerate(PROMPTS):
        n = 8 + (i * 5) % 20
        engine.submit(engine.make_request(p, SamplingParams(max_tokens=n, ignore_eos=True), rid=f"b{i}"), cb)
        time.sleep(0.02 * (i % 4))  # staggered arrivals join a running batch
    assert done.wait(240)
    for i in range(len(PROMPTS)):
        assert results[f"b{i}"] == alone[i], f"prompt {i} differs when batched"


def test_chunked_prefill_matches_unchunked(loaded, engine):
    long_prompt = " ".join(f"item{i}" for i in range(150))  # ~450 tokens
    ref = engine.generate(long_prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    e = make_engine(loaded, scheduler=SchedulerConfig(chunked_prefill_size=64), debug_invariants=True)
    try:
        got = e.generate(long_prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    finally:
        e.shutdown()
    assert got.prompt_tokens > 64 * 3
    assert got.token_ids == ref.token_ids


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    p = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = engine.generate("Tell me a story about a dragon.", p)
    others = [engine.make_request("Unrelated prompt number %d" % i, SamplingParams(
        max_tokens=20, temperature=1.0, seed=i)) for i in range(3)]
    batch = engine.generate_many([engine.make_request("Tell me a story about a dragon.", p)] + others)
    assert batch[0].token_ids == a.token_ids
    c = engine.generate("Tell me a story about a dragon.",
                        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=99,
                                       ignore_eos=True))
    assert c.token_ids != a.token_ids


def test_stop_string_and_stop_token(engine, alone):
    full = engine.generate(PROMPTS[0], SamplingParams(max_tokens=16, ignore_eos=True))
    text = full.text
    stop = text[4:7]
    assert stop.strip()
    c = engine.generate(PROMPTS[0], SamplingParams(max_tokens=16, ignore_eos=True, stop=(stop,)))
    assert c.finish_reason == "stop" and c.text == text[: text.index(stop)]
    tok = full.token_ids[3]
    c = engine.generate(PROMPTS[0], SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=(tok,)))
    assert c.finish_reason == "stop" and c.token_ids == full.token_ids[: full.token_ids.index(tok) + 1]


def test_eos_min_tokens_and_ignore_eos(engine):
    q = "What is 2+2?"
    c = engine.generate(q, SamplingParams(max_tokens=64), chat=True)
    assert c.finish_reason == "stop" and len(c.token_ids) < 64
    n = len(c.token_ids)
    c2 = engine.generate(q, SamplingParams(max_tokens=64, min_tokens=n + 3), chat=True)
    assert len(c2.token_ids) >= n + 3
    c3 = engine.generate(q, SamplingParams(max_tokens=n + 5, ignore_eos=True), chat=True)
    assert c3.finish_reason == "length" and len(c3.token_ids) == n + 5


def test_abort_mid_stream_frees_everything(engine):
    base = _idle_accounting(engine)
    seen = threading.Event()
    final = []

    def cb(c):
        if c.token_ids:
            seen.set()
        if c.finish_reason is not None:
            final.append(c)

    req = engine.make_request("Count from one to one hundred:", SamplingParams(max_tokens=500, ignore_eos=True))
    engine.submit(req, cb)
    assert seen.wait(60)
    engine.abort(req.rid)
    deadline = time.time() + 30
    while not final and time.time() < deadline:
        time.sleep(0.05)
    assert final and final[0].finish_reason == "abort"
    assert _idle_accounting(engine) == base


def test_a_second_request_with_a_live_id_is_refused_and_the_first_is_untouched(engine, alone):
    """Two requests with one id at once (a request's warm-up sent again while its first is held,
    say): the second ends at once with an error naming the id, the first streams on to its greedy
    tokens, and nothing leaks. Before the guard the second took over the first's row, callback
    and hold, and the first's pages belonged to no one."""
    base = _idle_accounting(engine)
    first, second, toks = [], [], []
    done1, done2 = threading.Event(), threading.Event()

    def cb1(c):
        toks.extend(c.token_ids)
        if c.finish_reason is not None:
            first.append(c)
            done1.set()

    def cb2(c):
        second.append(c)
        done2.set()

    n = 8 + (2 * 5) % 20
    req = engine.make_request(PROMPTS[2], SamplingParams(max_tokens=n, ignore_eos=True), rid="twice")
    with engine.paused_for_tests():
        engine.submit(req, cb1)
        again = engine.make_request(PROMPTS[3], SamplingParams(max_tokens=4), rid="twice")
        engine.submit(again, cb2)
    assert done2.wait(60) and done1.wait(60)
    assert second and second[0].finish_reason == "abort" and "twice" in second[0].error and "live" in second[0].error
    assert first and first[0].finish_reason == "length" and toks == list(alone[2])
    assert _idle_accounting(engine) == base


def test_bad_input_is_rejected_clearly(engine):
    with pytest.raises(InvalidRequest, match="max_tokens"):
        engine.generate("hi", SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequest, match="context"):
        engine.generate(list(range(1, engine.max_context + 5)), SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequest, match="empty"):
        engine.generate([], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequest, match="vocabulary"):
        engine.generate([10**9], SamplingParams(max_tokens=4))
    # and the engine keeps serving
    assert engine.generate("Hello", SamplingParams(max_tokens=2)).finish_reason in ("length", "stop")


def test_startup_line_names_the_attention_backend(engine):
    from tandem.engine.attention.cpu_backend import cpu_kernel_unavailable

    want = "cpu_kernel" if cpu_kernel_unavailable() is None else "torch"
    assert f"; attention {want})" in engine.startup_line and engine.runner.backend.name == want
