"""Live migration between two decode workers in one process (no Ray): real engines, real NIXL,
the real model. A request decodes on worker A, is frozen there (its stream ends "migrated", its
KV held), and continues on worker B, which receives over NIXL only the pages its own radix cache
lacks (or recomputes them). Oracle: the tokens and text of A's leg then B's leg equal the same
request run without migration; every pool is back at its baseline afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path

import pytest

from serve_support import LocalClient, at_baseline, collect

from tandem.core.config import CacheConfig, EngineConfig
from tandem.core.messages import GenerateRequest, Resume
from tandem.core.types import SamplingParams

PAGE = 4
CFG = EngineConfig(device="cpu", num_threads=1, cache=CacheConfig(page_size=PAGE, max_total_tokens=768,
                                                                  max_running_requests=6))
PROMPT = "Name three rivers in Europe and say where each one flows."
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))   # hf_hybrid_support


@pytest.fixture(scope="module", params=["gemma3", "granite"])
def hybrid_family(request, tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_hybrid_support import tiny_gemma3_dir, tiny_granite_dir
    from tandem.engine.loader import load_model

    path = tmp_path_factory.mktemp(request.param)
    (tiny_gemma3_dir(path, window=8) if request.param == "gemma3" else tiny_granite_dir(path))
    return request.param, load_model(str(path), device="cpu", dtype="float32")


class SourceClient:
    """Decode worker A as B's PrefillClient: its "prefill" is :meth:`DecodeWorker.migrate_out`."""

    def __init__(self, worker):
        self.w, self.name = worker, worker.name

    async def prefill(self, req_wire, xfer, dst_prefix_len):
        return await self.w.migrate_out(req_wire, xfer, dst_prefix_len)

    async def abort(self, rid, reason):
        await self.w.abort(rid, reason)


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def cluster(smollm2_default, loop):
    from tandem.decode.worker import DecodeWorker
    from tandem.engine.engine import Engine
    from tandem.prefill.worker import PrefillWorker

    async def make():
        p = PrefillWorker("m-prefill", CFG, loaded=smollm2_default, transfer_timeout_s=20)
        a = DecodeWorker("m-decode-a", CFG, loaded=smollm2_default, transfer_timeout_s=20)
        b = DecodeWorker("m-decode-b", CFG, loaded=smollm2_default, transfer_timeout_s=20, kv_digest=True)
        for x, y in ((p, a), (p, b), (a, b)):
            x.add_peer(y.handshake())
            y.add_peer(x.handshake())
        return p, a, b

    p, a, b = loop.run_until_complete(make())
    colocated = Engine(CFG, loaded=smollm2_default)
    yield p, a, b, colocated
    for w in (p, a, b):
        w.close()
    colocated.shutdown()


def run(loop, coro):
    return loop.run_until_complete(asyncio.wait_for(coro, 120))


async def _first_leg(a, greq: GenerateRequest, prefill, after: int) -> list:
    """A's stream of ``greq``, frozen once ``after`` chunks arrived: ends with "migrated"."""
    chunks = []
    async for c in a.generate(greq, prefill):
        chunks.append(c)
        if len(chunks) == after:
            await a.freeze(greq.rid)
    return chunks


def _resume(chunks) -> Resume:
    assert chunks[-1].finish_reason == "migrated", chunks[-1]
    return Resume(tuple(t for c in chunks for t in c.token_ids), sum(len(c.text) for c in chunks),
                  chunks[-1].cached_tokens)


@pytest.mark.parametrize("how", ["nixl", "nixl-warm", "recompute", "colocated"])
def test_a_migrated_request_streams_on_without_a_gap_or_a_repeat(cluster, loop, how):
    p, a, b, col = cluster
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = f"{PROMPT} ({how})"      # each case its own prompt: B's cache keeps what earlier ones moved
    ref = col.generate(prompt, params, chat=True)
    greq = col.make_request(prompt, params, chat=True, rid=f"mig-{how}")
    if how == "nixl-warm":   # B already holds the prompt (another request of the session ran there)
        run(loop, collect(b.generate(col.make_request(prompt, SamplingParams(max_tokens=1), chat=True,
                                                      rid="warm"), LocalClient(p))))
    received = b.counts["kv_bytes_received"]
    # colocated: A prefilled the prompt itself (no prefill worker), then its KV moves over NIXL
    first = run(loop, _first_leg(a, greq, None if how == "colocated" else LocalClient(p), after=6))
    resume = _resume(first)
    assert 6 <= len(resume.output_ids) < 24
    if how == "recompute":   # nothing will be copied from A: its frozen KV goes to its cache
        a.release_frozen(greq.rid)
    second = run(loop, collect(b.generate(dataclasses.replace(greq, resume=resume),
                                          None if how == "recompute" else SourceClient(a))))
    chunks = first[:-1] + second
    assert second[-1].error is None, second[-1]
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert "".join(c.text for c in chunks) == ref.text
    last = second[-1]
    assert last.finish_reason == "length" and last.error is None and last.completion_tokens == 24
    moved = b.counts["kv_bytes_received"] - received
    if how == "recompute":
        assert moved == 0
    else:
        assert moved > 0 and a.counts["migrated_out"] >= 1
    run(loop, at_baseline(p, a, b))


def test_freeze_refuses_a_request_that_is_not_decoding(cluster, loop):
    p, a, b, col = cluster
    with pytest.raises(ValueError, match="not decoding here"):
        run(loop, a.freeze("nobody"))
    run(loop, at_baseline(p, a, b))


def test_a_hybrid_request_migrates_with_its_window_and_state(hybrid_family, loop):
    """Gemma 3 (FULL + SWA) and Granite-4.0-H (FULL + MAMBA): the SWA rows of the kept window
    and the recurrent state row move with the full pages, there and back again (A -> B -> A);
    the result is the colocated output."""
    from hf_hybrid_support import hybrid_engine_config
    from tandem.decode.worker import DecodeWorker
    from tandem.prefill.worker import PrefillWorker

    name, loaded = hybrid_family
    cfg = hybrid_engine_config(page_size=PAGE)
    ids = list(b"[7] tell me about hybrid models and their windows, please: ")
    # one token a step: the tiny random model's repetitive text is drafted and accepted many tokens
    # a step, and the request could end before the migration reached it ("not decoding here")
    params = SamplingParams(max_tokens=14, ignore_eos=True, speculative=False)

    async def go():
        p = PrefillWorker(f"hm-{name}-p", cfg, loaded=loaded, transfer_timeout_s=20)
        a = DecodeWorker(f"hm-{name}-a", cfg, loaded=loaded, transfer_timeout_s=20)
        b = DecodeWorker(f"hm-{name}-b", cfg, loaded=loaded, transfer_timeout_s=20, kv_digest=True)
        for x, y in ((p, a), (p, b), (a, b)):
            x.add_peer(y.handshake())
            y.add_peer(x.handshake())
        try:
            greq = GenerateRequest(f"hm-{name}", tuple(ids), params)
            first = await _first_leg(a, greq, LocalClient(p), after=4)            # A, then B, then A again
            second = await _first_leg(b, dataclasses.replace(greq, resume=_resume(first)), SourceClient(a), after=3)
            both = first[:-1] + second
            third = await collect(a.generate(dataclasses.replace(greq, resume=_resume(both)), SourceClient(b)))
            assert third[-1].error is None, third[-1]
            second = second[:-1] + third
            await at_baseline(p, a, b)
            for w in (p, a, b):
                await w.handle.check_invariants()
            return [t for c in first[:-1] + second for t in c.token_ids], b.counts["kv_bytes_received"]
        finally:
            for w in (p, a, b):
                w.close()

    from tandem.engine.engine import Engine
    e = Engine(cfg, loaded=loaded)
    try:
        ref = e.generate(ids, params).token_ids
    finally:
        e.shutdown()
    toks, moved = run(loop, go())
    assert toks == ref and moved > 0


def test_a_request_id_still_ending_here_is_waited_for_not_refused(cluster, loop):
    """A router's re-route can reach a decode worker before the first attempt's cleanup there: the
    second attempt waits for the id to free instead of failing with "already running"."""
    p, a, b, col = cluster
    greq = col.make_request(f"{PROMPT} (again)", SamplingParams(max_tokens=4, ignore_eos=True),
                            chat=True, rid="again")

    async def go():
        first = asyncio.ensure_future(collect(a.generate(greq, LocalClient(p))))
        await asyncio.sleep(0.05)                     # the first attempt is running
        second = await collect(a.generate(greq, LocalClient(p)))
        return await first, second

    first, second = run(loop, go())
    assert first[-1].error is None and second[-1].error is None
    assert [t for c in first for t in c.token_ids] == [t for c in second for t in c.token_ids]
    run(loop, at_baseline(p, a, b))


SAMPLED = {   # what a request's running state carries across a migration
    "seeded": SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, top_p=0.95, seed=11),
    "grammar": SamplingParams(max_tokens=24, constraint=__import__("tandem.core.types", fromlist=["Constraint"])
                              .Constraint("regex", r"[a-z]+( [a-z]+){2,8}\."), temperature=0.7, seed=3),
    "logprobs": SamplingParams(max_tokens=24, ignore_eos=True, logprobs=True, top_logprobs=2),
    "stop": SamplingParams(max_tokens=40, stop=("ocean",), temperature=0.0),
}


@pytest.mark.parametrize("kind", sorted(SAMPLED))
def test_sampler_grammar_logprobs_and_stop_state_survive_a_migration(cluster, loop, kind):
    """The seeded draw (its position), the grammar's state, logprobs and the stop-string tail move
    with the request: A's leg then B's equal the unmigrated run, token for token."""
    p, a, b, col = cluster
    params = SAMPLED[kind]
    prompt = f"{PROMPT} [{kind}]"
    ref = col.generate(prompt, params, chat=True)
    greq = col.make_request(prompt, params, chat=True, rid=f"mig-s-{kind}")
    first = run(loop, _first_leg(a, greq, LocalClient(p), after=4))
    if first[-1].finish_reason != "migrated":   # ended (grammar complete, stop) before the freeze
        pytest.fail(f"{kind}: the request ended before 4 chunks: {first[-1]}")
    second = run(loop, collect(b.generate(dataclasses.replace(greq, resume=_resume(first)), SourceClient(a))))
    chunks = first[:-1] + second
    assert second[-1].error is None, second[-1]
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert "".join(c.text for c in chunks) == ref.text
    assert second[-1].finish_reason == ref.finish_reason
    if kind == "logprobs":   # against the same request unmigrated on A (the same path's numerics)
        plain = run(loop, collect(a.generate(dataclasses.replace(greq, rid="mig-s-plain"), LocalClient(p))))

        def lps(cs):
            return [(lp.token_id, round(lp.logprob, 3), len(lp.top or ())) for c in cs for lp in (c.logprobs or ())]
        assert len(lps(chunks)) == 24 and lps(chunks) == lps(plain)
    run(loop, at_baseline(p, a, b))


@pytest.mark.parametrize("kind", sorted(SAMPLED))
def test_a_failover_resume_recomputes_and_keeps_the_seeded_draw_grammar_logprobs_and_stop(cluster, loop, kind):
    """A failover (issue 48): the worker that decoded the first leg is gone, so B resumes from the
    tokens the client has with no source to copy from and recomputes the KV itself. The seeded
    draw (a function of seed and position), the grammar's state (re-derived from the output so
    far), logprobs and the stop tail continue: the two legs equal the run with no fault."""
    p, a, b, col = cluster
    params = SAMPLED[kind]
    prompt = f"{PROMPT} <{kind}>"
    ref = col.generate(prompt, params, chat=True)
    greq = col.make_request(prompt, params, chat=True, rid=f"fo-{kind}")
    first = run(loop, _first_leg(a, greq, LocalClient(p), after=4))
    if first[-1].finish_reason != "migrated":
        pytest.fail(f"{kind}: the request ended before 4 chunks: {first[-1]}")
    a.release_frozen(greq.rid)          # A is "dead": nothing is copied from it
    second = run(loop, collect(b.generate(dataclasses.replace(greq, resume=_resume(first)), None)))
    chunks = first[:-1] + second
    assert second[-1].error is None, second[-1]
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert "".join(c.text for c in chunks) == ref.text
    assert second[-1].finish_reason == ref.finish_reason
    if kind == "logprobs":
        assert sum(len(c.logprobs or ()) for c in chunks) == 24
    run(loop, at_baseline(p, a, b))


def test_a_pre_copied_prompt_is_not_copied_again_at_the_stop(cluster, loop):
    """Pre-copy: B took the prompt's KV from the prefill worker while A decoded; at the stop only
    the generated pages come from A (B's cache reuse is counted), and the text is unchanged."""
    p, a, b, col = cluster
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompt = f"{PROMPT} Then name two lakes and two mountains near them, with their heights."
    ref = col.generate(prompt, params, chat=True)
    greq = col.make_request(prompt, params, chat=True, rid="mig-precopy")

    async def both():
        first = []
        async for c in a.generate(greq, LocalClient(p)):
            first.append(c)
            if len(first) == 3:   # the pre-copy runs while A decodes on
                warm = col.make_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), chat=True,
                                        rid="mig-precopy~precopy")
                await collect(b.generate(warm, LocalClient(p)))
                await a.freeze(greq.rid)
        return first

    reused, moved = b.counts["migration_reused_tokens"], b.counts["migration_bytes"]
    first = run(loop, both())
    second = run(loop, collect(b.generate(dataclasses.replace(greq, resume=_resume(first)), SourceClient(a))))
    chunks = first[:-1] + second
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids and second[-1].error is None
    n = len(greq.prompt_ids)
    assert b.counts["migration_reused_tokens"] - reused >= n - n % PAGE - PAGE   # the prompt, page-aligned
    assert b.counts["migration_bytes"] > moved                                   # the generated tail came
    run(loop, at_baseline(p, a, b))


@pytest.mark.parametrize("via", ["prefill", "local"])
def test_pre_copied_generated_pages_are_not_copied_at_the_stop(cluster, loop, via):
    """The pre-copy of a request that generated 48+ tokens takes the prompt and the generated
    tokens, cut to whole pages, into B's cache: through the prefill worker (which holds the prompt
    and computes only the generated part), or computed on B (no prefill worker). At the stop B
    reuses all of it (only the tail generated since crosses NIXL); the tokens are unchanged."""
    p, a, b, col = cluster
    # A decodes on while the pre-copy runs (its chunks queue meanwhile): room for ~150 tokens of
    # that, so A is still decoding at the freeze however slow the pre-copy is on a shared box.
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    prompt = f"{PROMPT} Answer at length ({via})."
    ref = col.generate(prompt, params, chat=True)
    greq = col.make_request(prompt, params, chat=True, rid=f"mig-pregen-{via}")
    n = len(greq.prompt_ids)
    warm_len = 0

    async def both():
        nonlocal warm_len
        first, out, frozen = [], [], False
        async for c in a.generate(greq, LocalClient(p)):
            first.append(c)
            out += c.token_ids
            if warm_len and not frozen and n + len(out) > warm_len + PAGE:   # a tail past the warm pages
                await a.freeze(greq.rid)
                frozen = True
            if len(out) >= 48 and not warm_len:   # the pre-copy runs while A decodes on
                warm_len = (n + len(out)) // PAGE * PAGE
                warm = GenerateRequest(f"{greq.rid}~precopy", greq.prompt_ids + tuple(out[:warm_len - n]),
                                       SamplingParams(max_tokens=1, ignore_eos=True))
                got = await collect(b.generate(warm, LocalClient(p) if via == "prefill" else None))
                assert got[-1].error is None, got[-1]
                if via == "prefill":   # it held the prompt: it computed the generated part only
                    assert got[-1].cached_tokens >= n - n % PAGE - PAGE, (got[-1].cached_tokens, n)
        assert frozen, "the source finished before a tail past the warm pages"
        return first

    reused, moved = b.counts["migration_reused_tokens"], b.counts["migration_bytes"]
    first = run(loop, both())
    resume = _resume(first)
    second = run(loop, collect(b.generate(dataclasses.replace(greq, resume=resume), SourceClient(a))))
    chunks = first[:-1] + second
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids and second[-1].error is None
    assert warm_len >= n + 48 - PAGE
    assert b.counts["migration_reused_tokens"] - reused >= warm_len       # prompt + generated pages
    assert b.counts["migration_bytes"] > moved                             # the tail generated since came
    run(loop, at_baseline(p, a, b))


class _DyingSource(SourceClient):
    """A source that died before writing (its process is gone): PrefillUnavailable."""

    async def prefill(self, req_wire, xfer, dst_prefix_len):
        from tandem.decode.worker import PrefillUnavailable

        raise PrefillUnavailable("ActorDiedError: the source is gone")


def test_the_source_dying_mid_copy_fails_closed_and_leaks_nothing(cluster, loop):
    """B's copy from A fails (A died): B's leg ends with an error and no token, its reserved pages
    are freed (the router then has B recompute); A's held KV goes back to its cache."""
    p, a, b, col = cluster
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    greq = col.make_request(f"{PROMPT} (dying source)", params, chat=True, rid="mig-dying")
    first = run(loop, _first_leg(a, greq, LocalClient(p), after=3))
    resumed = dataclasses.replace(greq, resume=_resume(first))
    second = run(loop, collect(b.generate(resumed, _DyingSource(a))))
    assert second[-1].finish_reason == "abort" and second[-1].error and not second[-1].token_ids
    a.release_frozen(greq.rid)          # what the source's expiry (or the router) does
    third = run(loop, collect(b.generate(resumed, None)))   # the router's recompute on B
    ref = col.generate(f"{PROMPT} (dying source)", params, chat=True)
    assert [t for c in first[:-1] + third for t in c.token_ids] == ref.token_ids
    run(loop, at_baseline(p, a, b))
