"""Disaggregated hybrid models: PrefillWorker + DecodeWorker in one process (no Ray), real NIXL,
tiny HF directories of Gemma 3 (FULL + SWA, window 8) and Granite-4.0-H (FULL + MAMBA).

Oracles: greedy tokens equal the colocated engine's (prefix cache on and off, page sizes 1 and
4, retraction on the decode worker with host backup); what moves per request is exactly the full
layers' pages of the uncached part, the SWA rows of the kept window (at most window + 2 pages)
and one state row, checked byte for byte against the transfer's own count and, with
``--kv-digest``, by content; a multi-turn session reuses its prefix on the decode worker (the
vote accepts the decode tree's hit, prefill sends the rest and the state at the prompt's end);
every pool of both workers (full, SWA, state, host) is owned exactly once after each request
and back to idle at the end.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from tandem.core.messages import GenerateRequest  # noqa: E402
from tandem.core.types import SamplingParams  # noqa: E402
from tandem.engine.engine import Engine  # noqa: E402
from tandem.worker.kv_regions import transfer_bytes  # noqa: E402
from tandem.engine.loader import load_model  # noqa: E402

from hf_hybrid_support import hybrid_engine_config, tiny_gemma3_dir, tiny_granite_dir  # noqa: E402
from serve_support import at_baseline, collect  # noqa: E402
from test_workers import LocalClient, run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 8
MAX_TOKENS = 10


def prompt(i: int, n: int = 60) -> list[int]:
    return list(f"[{i}] tell me about hybrid models and their windows, please: ".encode())[:n]


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module", params=["gemma3", "granite"])
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3":
        tiny_gemma3_dir(path, window=WINDOW)
    else:
        tiny_granite_dir(path)
    return request.param, load_model(str(path), device="cpu", dtype="float32")


def _workers(loop, loaded, tag, *, page_size, disable=False, decode_kw=None, digest=False):
    from tandem.decode.worker import DecodeWorker
    from tandem.prefill.worker import PrefillWorker

    pc = hybrid_engine_config(page_size=page_size, disable=disable)
    dc = hybrid_engine_config(page_size=page_size, disable=disable, **(decode_kw or {}))

    async def make():
        p = PrefillWorker(f"{tag}-prefill", pc, loaded=loaded, transfer_timeout_s=20)
        d = DecodeWorker(f"{tag}-decode", dc, loaded=loaded, transfer_timeout_s=20, kv_digest=digest)
        p.add_peer(d.handshake())
        d.add_peer(p.handshake())
        return p, d

    return loop.run_until_complete(make())


def _colocated(loaded, ids_list, page_size, disable=False):
    e = Engine(hybrid_engine_config(page_size=page_size, disable=disable), loaded=loaded)
    try:
        return [e.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)).token_ids
                for ids in ids_list]
    finally:
        e.shutdown()


async def _generate(d, p, rid, ids):
    greq = GenerateRequest(rid, tuple(ids), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    chunks = await collect(d.generate(greq, LocalClient(p)))
    assert chunks[-1].error is None, chunks[-1].error
    return [t for c in chunks for t in c.token_ids], dict(d.last_timings)


async def _idle(*ws):
    await at_baseline(*ws)
    for w in ws:
        await w.handle.check_invariants()   # every pool, exact ownership


def _expected_bytes(name, engine, n, prefix, page_size):
    pages = {"kv": -(-(n - prefix) // page_size)}
    if name == "gemma3":
        h = engine.hybrid
        pages["swa"] = n - max(prefix, h.keep_from(n))
        assert pages["swa"] <= WINDOW + 2 * page_size
    else:
        pages["state"] = 1
    return transfer_bytes(engine, pages)


@pytest.mark.parametrize("disable", [False, True], ids=["cache", "nocache"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_1p1d_equals_colocated_and_moves_only_what_decode_needs(family, loop, page_size, disable):
    name, loaded = family
    prompts = [prompt(0), prompt(1, 45)]
    ref = _colocated(loaded, prompts, page_size, disable)
    p, d = _workers(loop, loaded, f"{name}{page_size}{disable}", page_size=page_size, disable=disable,
                    digest=True)
    try:
        for i, ids in enumerate(prompts):
            toks, t = run(loop, _generate(d, p, f"r{i}", ids))
            assert toks == ref[i], f"{name} request {i}"
            assert t["prefix_len"] == 0
            assert t["bytes"] == _expected_bytes(name, d.engine, len(ids), 0, page_size)
            run(loop, _idle(p, d))
        assert d.counts["digest_failures"] == 0
    finally:
        p.close()
        d.close()


def test_multi_turn_session_reuses_its_prefix_on_decode(family, loop):
    """Turn 2 extends turn 1's prompt + output: the decode tree's hit (every component voting)
    shrinks what moves; tokens still equal the colocated engine's."""
    name, loaded = family
    page_size = 4
    turn1 = prompt(3)
    p, d = _workers(loop, loaded, f"{name}mt", page_size=page_size, digest=True)
    col = Engine(hybrid_engine_config(page_size=page_size), loaded=loaded)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        ref1 = col.generate(turn1, params).token_ids
        toks1, _ = run(loop, _generate(d, p, "t1", turn1))
        assert toks1 == ref1
        turn2 = turn1 + toks1 + list(b" and what about the state?")
        ref2 = col.generate(turn2, params).token_ids
        toks2, t = run(loop, _generate(d, p, "t2", turn2))
        assert toks2 == ref2
        n = len(turn2)
        assert t["prefix_len"] > len(turn1) - page_size, t   # the decode tree served turn 1 + output
        assert t["bytes"] == _expected_bytes(name, d.engine, n, t["prefix_len"], page_size)
        run(loop, _idle(p, d))
    finally:
        col.shutdown()
        p.close()
        d.close()


def test_retraction_on_the_decode_worker_with_host_backup(family, loop):
    """Decode retracts a victim every 3 steps and backs it up (FULL, SWA window, checkpoint) to
    its host tier; restored requests produce the colocated tokens."""
    name, loaded = family
    prompts = [prompt(i, 40 + 5 * i) for i in range(3)]
    ref = _colocated(loaded, prompts, 1)
    p, d = _workers(loop, loaded, f"{name}rt", page_size=1,
                    decode_kw={"retract_every": 3, "host_pool_tokens": 1024})

    async def go():
        return await asyncio.gather(*[_generate(d, p, f"q{i}", ids) for i, ids in enumerate(prompts)])

    try:
        outs = run(loop, go())
        assert [o[0] for o in outs] == ref
        st = d.engine.scheduler.stats
        assert st["retractions"] > 0 and st["retraction_restores"] > 0
        run(loop, _idle(p, d))
    finally:
        p.close()
        d.close()


def test_corrupt_received_state_or_window_is_caught_by_the_digest(family, loop):
    from tandem.decode.worker import DecodeWorker

    name, loaded = family
    p, d0 = _workers(loop, loaded, f"{name}dg", page_size=1, digest=True)
    d0.close()

    async def make():
        d = DecodeWorker(f"{name}dg-bad", hybrid_engine_config(), loaded=loaded, transfer_timeout_s=20,
                         kv_digest=True, debug_corrupt_kv=True)
        p.add_peer(d.handshake())
        d.add_peer(p.handshake())
        return d

    d = loop.run_until_complete(make())
    try:
        greq = GenerateRequest("bad", tuple(prompt(5)), SamplingParams(max_tokens=4))
        chunks = run(loop, collect(d.generate(greq, LocalClient(p))))
        assert chunks[-1].finish_reason == "abort" and "digest mismatch" in chunks[-1].error
        run(loop, _idle(p, d))
    finally:
        p.close()
        d.close()


def test_every_layer_sliding_window_moves_no_full_pages(smollm2_swa16, loop):
    """SmolLM2 with sliding_window=16: the full pool has no layers, so no "kv" region is
    registered and a transfer moves only the SWA rows of the kept window."""
    loaded = smollm2_swa16
    ids = loaded.tokenizer.encode("Sliding windows all the way down: every layer is local here, ok?")
    ref = _colocated(loaded, [ids], 4)[0]
    p, d = _workers(loop, loaded, "swa-only", page_size=4, digest=True)
    try:
        assert sorted(p.regions) == ["swa"]
        toks, t = run(loop, _generate(d, p, "w1", ids))
        assert toks == ref
        n = len(ids)
        assert t["bytes"] == transfer_bytes(d.engine, {"swa": n - d.engine.hybrid.keep_from(n)})
        d.debug_corrupt_kv = True                   # the digest covers the SWA rows too
        greq = GenerateRequest("w2", tuple(ids), SamplingParams(max_tokens=2))
        chunks = run(loop, collect(d.generate(greq, LocalClient(p))))
        assert "digest mismatch" in chunks[-1].error
        run(loop, _idle(p, d))
    finally:
        p.close()
        d.close()
