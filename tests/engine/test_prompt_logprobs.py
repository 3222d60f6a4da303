"""Prompt logprobs (SamplingParams.prompt_logprobs) on the real SmolLM2 in float32: each prompt
token's logprob, rank and alternatives equal transformers' log_softmax over the same prompt;
chunked prefill and a prompt already in the prefix cache give the same figures; greedy output
does not change when a request asks for them; the cache's invariants hold after every step."""

from __future__ import annotations

import pytest
import torch

from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.core.types import InvalidRequest, SamplingParams
from tandem.engine.engine import Engine

PROMPT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
          "single step, and every step after it is easier than the one before.")


@pytest.fixture(scope="module")
def engine(smollm2):
    cfg = EngineConfig(cache=CacheConfig(page_size=4, max_total_tokens=2048, debug_invariants=True),
                       scheduler=SchedulerConfig(chunked_prefill_size=16))
    e = Engine(cfg, loaded=smollm2)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def hf_logprobs(hf_smollm2, engine):
    ids = engine.tokenizer.encode(PROMPT)
    with torch.no_grad():
        logits = hf_smollm2(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1)        # [P, V]: row p scores token p + 1


def _first_chunk_prompt_lps(engine, ids, k, max_tokens=4):
    chunks = []
    greq = engine.make_request(ids, SamplingParams(max_tokens=max_tokens, prompt_logprobs=k))
    import threading

    done = threading.Event()

    def on_chunk(c):
        chunks.append(c)
        if c.finish_reason is not None:
            done.set()

    engine.submit(greq, on_chunk)
    assert done.wait(300)
    assert chunks[-1].error is None, chunks[-1].error
    with_plps = [c for c in chunks if c.prompt_logprobs]
    assert len(with_plps) == 1 and with_plps[0] is chunks[0]   # only the first token's chunk
    return chunks[0].prompt_logprobs, [t for c in chunks for t in c.token_ids], chunks[0].cached_tokens


def test_prompt_logprobs_equal_transformers_chunked_and_cached(engine, hf_logprobs):
    ids, ref = hf_logprobs
    assert len(ids) > 2 * 16     # several prefill chunks
    k = 3
    first, out1, _ = _first_chunk_prompt_lps(engine, ids, k)
    assert [lp.token_id for lp in first] == ids[1:]
    for p, lp in enumerate(first):
        row = ref[p]
        assert abs(lp.logprob - row[ids[p + 1]].item()) < 1e-3, p
        assert lp.rank == int((row > row[ids[p + 1]]).sum()) + 1
        top = torch.topk(row, k)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert max(abs(v - w) for (_, v), w in zip(lp.top, top.values.tolist())) < 1e-3
    # the same prompt again: its pages are in the cache, its logprobs are recomputed all the same
    again, out2, cached = _first_chunk_prompt_lps(engine, ids, k)
    assert cached == 0
    assert [(a.token_id, a.rank) for a in again] == [(b.token_id, b.rank) for b in first]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(again, first)) < 1e-5
    # greedy output is what a request without prompt logprobs gets (which does hit the cache)
    plain = engine.generate(ids, SamplingParams(max_tokens=4))
    assert plain.cached_tokens > 0
    assert plain.token_ids == out1 == out2


def test_prompt_logprobs_zero_alternatives_and_one_token_request(engine, hf_logprobs):
    ids, ref = hf_logprobs
    lps, out, _ = _first_chunk_prompt_lps(engine, ids[:9], 0, max_tokens=1)
    assert len(out) == 1 and len(lps) == 8 and all(lp.top == () for lp in lps)
    assert abs(lps[-1].logprob - ref[7][ids[8]].item()) < 1e-3


def test_prompt_logprobs_validated(engine):
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate()
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=True).validate()
    engine.check_invariants()
