"""The engine honours constraints, logprobs and n (issue 13, phase 2), on the real SmolLM2.

- 52 seeded random JSON schemas (nested objects, arrays, enums, required fields), greedy and
  seeded sampling, decoded in one batch with an unconstrained request: every output validates
  with ``jsonschema``; the unconstrained row is what it is alone.
- logprobs equal ``log_softmax`` of the logits the model gives for the same tokens (computed here
  with a separate ModelRunner), after the grammar's mask for a constrained request; a greedy
  token is ``top[0]``.
- the grammar wins over ``ignore_eos`` / ``min_tokens``; a constraint that does not compile is an
  InvalidRequest from ``stream`` and an error finish from ``submit``; stop strings are reported.
- n = 3: one prompt prefill (the ``prompt_tokens_computed`` counter; with the prefix cache off
  the members fork the first one's prompt KV), seeded and reproducible, each member the same as
  when run alone.
- prefix cache off and retraction (recompute) give the same tokens and logprobs.

The engines run the default numerics (as every Tandem-vs-Tandem oracle); the logprob checks run a
float32 engine against a float32 forward.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import uuid

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")

from schema_support import object_schema  # noqa: E402

from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from tandem.core.messages import GenerateRequest, SampleGroup  # noqa: E402
from tandem.core.types import Constraint, InvalidRequest, SamplingParams  # noqa: E402
from tandem.engine.grammar import apply_bitmask  # noqa: E402

CACHE = CacheConfig(max_total_tokens=16384, max_running_requests=64)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
TOL = 2e-3   # batched engine vs an unbatched reference forward (fp32)


@pytest.fixture(scope="module")
def engines(smollm2_default, one_torch_thread):
    """The engines the Tandem-vs-Tandem checks compare, in the default numerics (bitwise batch-
    and prefix-invariant: test_batch_invariance.py)."""
    from tandem.engine.engine import Engine

    base = dict(device="cpu", num_threads=1)
    m = smollm2_default
    made = {"cache": Engine(EngineConfig(**base, cache=CACHE), loaded=m),
            "nocache": Engine(EngineConfig(**base, cache=CACHE.model_copy(update={"disable_prefix_cache": True,
                                                                                   "debug_invariants": True})),
                              loaded=m),
            "retract": Engine(EngineConfig(**base, cache=CACHE.model_copy(update={"debug_invariants": True}),
                                           scheduler=SchedulerConfig(debug_retract_every=3)), loaded=m)}
    yield made
    for e in made.values():
        e.shutdown()


@pytest.fixture(scope="module")
def engine(engines):
    return engines["cache"]


@pytest.fixture(scope="module")
def fp32_engine(smollm2, one_torch_thread):
    """A float32 engine for the logprob checks against ``reference`` (a float32 forward, TOL)."""
    from tandem.engine.engine import Engine

    e = Engine(EngineConfig(device="cpu", num_threads=1, cache=CACHE), loaded=smollm2)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def reference(smollm2):
    """``logits(ids) -> [len(ids), V]``: the model's logits at every position, one plain forward."""
    from tandem.engine.model_runner import ModelRunner

    runner = ModelRunner.create(smollm2, max_total_tokens=2048, max_reqs=2)

    def logits(ids: list[int]) -> torch.Tensor:
        s = runner.new_seq()
        try:
            with torch.inference_mode():
                return runner.extend([s], [ids], return_all_logits=True).float()
        finally:
            runner.release(s)

    return logits


def chat(engine, text: str, params: SamplingParams, rid: str | None = None, group=None) -> GenerateRequest:
    g = engine.make_request(text, params, chat=True, rid=rid)
    return GenerateRequest(g.rid, g.prompt_ids, g.params, g.session_id, group)


def run(engine, greqs: list[GenerateRequest]):
    """Every chunk of every request (rid -> chunks), the way a server reads them."""
    outs = {g.rid: [] for g in greqs}
    left, ev, lock = [len(greqs)], threading.Event(), threading.Lock()

    def on_chunk(c):
        with lock:
            outs[c.rid].append(c)
            if c.finish_reason is not None:
                left[0] -= 1
                if not left[0]:
                    ev.set()

    for g in greqs:
        engine.submit(g, on_chunk)
    assert ev.wait(300), "generation timed out"
    return outs


def ids_of(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def lps_of(chunks):
    return [lp for c in chunks for lp in c.logprobs]


# ------------------------------------------------------------------------------ schemas
def test_random_schemas_batched_with_an_unconstrained_request(engine):
    schemas = [object_schema(seed) for seed in range(52)]
    greqs = [chat(engine, "Reply with a JSON object.", SamplingParams(
        max_tokens=160, temperature=0.0 if i % 2 == 0 else 0.8, seed=i,
        constraint=Constraint("json_schema", json.dumps(s)))) for i, s in enumerate(schemas)]
    free = chat(engine, "Name three colours.", SamplingParams(max_tokens=12))
    outs = engine.generate_many(greqs + [free], timeout=300)
    for s, o in zip(schemas, outs):
        assert o.finish_reason == "stop" and o.error is None, (o.finish_reason, o.error, o.text)
        jsonschema.validate(json.loads(o.text), s)
    alone = engine.generate_many([chat(engine, "Name three colours.", SamplingParams(max_tokens=12))])[0]
    assert outs[-1].token_ids == alone.token_ids and outs[-1].text.strip()


def test_grammar_wins_over_ignore_eos_and_min_tokens(engine):
    p = SamplingParams(max_tokens=30, ignore_eos=True, min_tokens=20, constraint=Constraint("regex", "(yes|no)"))
    o = engine.generate("Is the sky blue?", p, chat=True)
    assert (o.finish_reason, o.error) == ("stop", None) and o.text in ("yes", "no") and len(o.token_ids) <= 3


def test_bad_constraint_is_an_invalid_request(engine):
    bad = SamplingParams(max_tokens=4, constraint=Constraint("json_schema", '{"type": "nonsense"}'))

    async def first_chunk():
        async for _ in engine.stream(chat(engine, "x", bad)):
            return

    with pytest.raises(InvalidRequest, match="does not compile"):
        asyncio.run(first_chunk())
    o = engine.generate("x", bad, chat=True)          # submit(): the request finishes as an error
    assert o.finish_reason == "abort" and "does not compile" in o.error
    assert engine.generate("x", SamplingParams(max_tokens=2), chat=True).finish_reason == "length"


def test_stop_string_is_reported(engine):
    free = engine.generate("Count from 1 to 10.", SamplingParams(max_tokens=24), chat=True).text
    stop = free.strip()[2:5]
    chunks = run(engine, [chat(engine, "Count from 1 to 10.", SamplingParams(max_tokens=24, stop=(stop, "zzz")))])
    last = list(chunks.values())[0][-1]
    assert last.finish_reason == "stop" and last.stop_str == stop
    assert stop not in "".join(c.text for c in list(chunks.values())[0])


def test_unconstrained_engine_never_builds_a_grammar(smollm2):
    from tandem.engine.engine import Engine

    e = Engine(EngineConfig(device="cpu", num_threads=1, cache=CacheConfig(max_total_tokens=512)), loaded=smollm2)
    try:
        assert e.generate("hi", SamplingParams(max_tokens=2, logprobs=True), chat=True).finish_reason == "length"
        assert e._grammar is None
    finally:
        e.shutdown()


# ------------------------------------------------------------------------------ logprobs
def _check_logprobs(ref_logits, prompt, out_ids, lps, top_n, greedy, masks=None):
    """Each entry against log_softmax of the reference logits at its position (masked first)."""
    assert [lp.token_id for lp in lps] == out_ids
    logits = ref_logits(list(prompt) + out_ids[:-1])[len(prompt) - 1:]            # [n_out, V]
    for k, lp in enumerate(lps):
        row = logits[k].clone()
        if masks is not None:
            row[~masks[k]] = float("-inf")
        ref = torch.log_softmax(row, -1)
        assert abs(lp.logprob - float(ref[lp.token_id])) < TOL, (k, lp.logprob, float(ref[lp.token_id]))
        vals, idx = torch.topk(ref, min(top_n, int(torch.isfinite(ref).sum())))   # forbidden ones left out
        assert len(lp.top) == len(vals)
        for (tid, v), rv in zip(lp.top, vals.tolist()):
            assert abs(v - rv) < TOL and abs(v - float(ref[tid])) < TOL
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        if greedy:
            assert lp.top[0][0] == lp.token_id


def test_logprobs_are_log_softmax_of_the_models_logits(fp32_engine, reference):
    engine = fp32_engine
    for temp in (0.0, 1.0):
        g = chat(engine, "Write a haiku about the sea.", SamplingParams(max_tokens=10, temperature=temp, seed=3,
                                                                         logprobs=True, top_logprobs=5))
        chunks = run(engine, [g])[g.rid]
        assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
        _check_logprobs(reference, g.prompt_ids, ids_of(chunks), lps_of(chunks), 5, greedy=temp == 0)
    plain = run(engine, [chat(engine, "hi", SamplingParams(max_tokens=3))])
    assert all(c.logprobs == () for cs in plain.values() for c in cs)


def test_constrained_logprobs_are_over_the_allowed_tokens(fp32_engine, reference):
    engine = fp32_engine
    c = Constraint("json_schema", json.dumps(PERSON))
    g = chat(engine, "Invent a person.", SamplingParams(max_tokens=30, logprobs=True, top_logprobs=3, constraint=c))
    chunks = run(engine, [g])[g.rid]
    out = ids_of(chunks)
    jsonschema.validate(json.loads("".join(x.text for x in chunks)), PERSON)
    comp = engine.grammar()
    m = comp.matcher(c)
    masks = []
    for t in out:      # the mask at each step, replayed on a fresh matcher
        bm = comp.allocate_bitmask(1)
        m.fill_bitmask(bm, 0)
        logits = torch.zeros(1, engine.arch.vocab_size)
        apply_bitmask(logits, bm, [0])
        masks.append(torch.isfinite(logits[0]))
        assert m.accept(t)
    _check_logprobs(reference, g.prompt_ids, out, lps_of(chunks), 3, greedy=True, masks=masks)
    assert all(math.isfinite(v) for lp in lps_of(chunks) for _, v in lp.top)


# ------------------------------------------------------------------------------ n
def _group(engine, text, n, seed):
    rid = f"grp-{uuid.uuid4().hex[:8]}"
    return [chat(engine, text, SamplingParams(max_tokens=12, temperature=0.9, seed=seed + i),
                 rid=f"{rid}-{i}", group=SampleGroup(rid, i, n)) for i in range(n)]


@pytest.mark.parametrize("which", ["cache", "nocache"])
def test_n_computes_the_prompt_once_and_is_reproducible(engines, which):
    """With the prefix cache the members hit the first one's cached prompt; without it they fork
    its KV (a copy). Either way the prompt is computed once."""
    engine = engines[which]
    text = f"Tell me a short fact about owls. ({uuid.uuid4().hex})"   # nothing cached for it yet
    st = engine.scheduler.stats
    before = st["prompt_tokens_computed"]
    first = engine.generate_many(_group(engine, text, 3, seed=11))
    computed = st["prompt_tokens_computed"] - before
    prompt, cached = first[0].prompt_tokens, first[0].cached_tokens
    assert computed == (prompt - cached) + 2              # the leader's prompt, then 1 token each
    assert [o.cached_tokens for o in first[1:]] == [prompt - 1] * 2
    again = engine.generate_many(_group(engine, text, 3, seed=11))
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert len({tuple(o.token_ids) for o in first}) > 1             # different seeds, different samples
    alone = [engine.generate(text, SamplingParams(max_tokens=12, temperature=0.9, seed=11 + i), chat=True)
             for i in range(3)]
    assert [o.token_ids for o in alone] == [o.token_ids for o in first]


# ------------------------------------------------------------------------------ cache off, retraction
def test_cache_off_and_retraction_give_the_same_tokens_and_logprobs(engines):
    c = Constraint("json_schema", json.dumps(PERSON))
    params = [SamplingParams(max_tokens=30, constraint=c, logprobs=True, top_logprobs=2),
              SamplingParams(max_tokens=16, logprobs=True, top_logprobs=2)]
    results = {}
    for name, e in engines.items():
        greqs = [chat(e, "Invent a person.", p, rid=f"{name}-{i}") for i, p in enumerate(params)]
        results[name] = run(e, greqs)
    assert engines["retract"].scheduler.stats["retractions"] > 0
    ref = results["cache"]
    for name in ("nocache", "retract"):
        for i in range(len(params)):
            a, b = ref[f"cache-{i}"], results[name][f"{name}-{i}"]
            assert ids_of(a) == ids_of(b), name
            for x, y in zip(lps_of(a), lps_of(b)):
                assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < TOL
                assert [t for t, _ in x.top] == [t for t, _ in y.top]
    jsonschema.validate(json.loads("".join(x.text for x in ref["cache-0"])), PERSON)
