"""Decode retraction with host-pool backup, on the real SmolLM2.

Oracle: every request's greedy tokens equal its tokens in an uncontended run, whether its KV was
backed up to the host and restored, or recomputed (host pool too small), with the cache's and
the engine's ownership invariants checked after every step."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tandem.core.config import CacheConfig, EngineConfig
from tandem.core.types import SamplingParams
from tandem.engine.engine import Engine
from tandem.engine.loader import load_model

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "The three primary colors are", "Water boils at", "List three fruits:",
    "In 1969, the first humans", "The quick brown fox",
]
N = [20, 24, 16, 28, 22, 18, 26, 20]


@pytest.fixture(scope="module")
def loaded():
    return load_model("smollm2", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def alone(loaded):
    e = Engine(EngineConfig(cache=CacheConfig(max_total_tokens=4096)), loaded=loaded)
    try:
        return [e.generate(p, SamplingParams(max_tokens=n, ignore_eos=True))
                for p, n in zip(PROMPTS, N)]
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


def test_full_host_pool_takes_the_recompute_path(loaded, alone):
    e = contended(loaded, host_pool_tokens=8)   # two pages: backups do not fit
    try:
        outs = _run(e)
        st = e.scheduler.stats
        assert st["retractions"] > 0 and st["retraction_recomputes"] > 0
        for i, c in enumerate(outs):
            assert c.error is None and c.token_ids == alone[i].token_ids, f"request {i} differs after recompute"
            assert c.text == alone[i].text, f"request {i}'s streamed text differs after recompute"
        assert _idle(e) == (e.allocator.size, 0, 0, e.req_to_token.size)
    finally:
        e.shutdown()


def test_abort_while_retracted_frees_the_host_copy(loaded):
    e = contended(loaded, host_pool_tokens=2048)
    try:
        finals, lock = {}, threading.Lock()

        def cb(c):
            if c.finish_reason is not None:
                with lock:
                    finals[c.rid] = c

        reqs = [e.make_request(p, SamplingParams(max_tokens=60, ignore_eos=True)) for p in PROMPTS]
        for r in reqs:
            e.submit(r, cb)
        victim = None
        deadline = time.time() + 120
        while victim is None and time.time() < deadline:
            victim = e.call(lambda: next(iter(e.scheduler.retraction.backups), None)).result(10)
        assert victim is not None, "no request was retracted"
        host_locked = e.snapshot().locked_tokens
        e.abort(victim)
        while len(finals) < len(reqs) and time.time() < deadline + 120:
            time.sleep(0.1)
        assert finals[victim].finish_reason == "abort"
        assert len(finals) == len(reqs)
        locked, retracted = _idle(e)[1:3]
        assert (locked, retracted) == (0, 0)
        assert host_locked >= 0
        e.check_invariants()
    finally:
        e.shutdown()
