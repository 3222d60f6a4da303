"""Speculative decoding on the real model (SmolLM2, float32): greedy tokens, texts, finish reasons
and logprobs equal to decoding without drafts, on a batch that copies (so drafts are accepted: the
test asserts it) mixed with prompt chunks and a chat row."""

from __future__ import annotations

import json
import threading

import pytest

from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.core.types import Constraint, SamplingParams
from tandem.engine.engine import Engine

from test_spec import collector

DOC = json.dumps({"name": "Ada Lovelace", "born": 1815, "city": "London",
                  "known_for": ["Analytical Engine notes", "first published algorithm"]}, indent=2)
COPY = f"Here is a JSON document:\n{DOC}\nReturn the same JSON document with the city changed to Paris."
SCHEMA = json.dumps({"type": "object", "required": ["name", "born", "city", "known_for"],
                     "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                                    "city": {"type": "string"},
                                    "known_for": {"type": "array", "items": {"type": "string"}}}})
CODE = "def area(width, height):\n    return width * height\n\n\nprint(area(3, 4))\nprint(area(5, 6))"
RENAME = f"Rename the function area to surface in this code and output the whole code:\n\n{CODE}"


def _run(loaded, spec: str):
    cfg = EngineConfig(device="cpu", dtype="float32", num_threads=1, speculative_algorithm=spec,
                       scheduler=SchedulerConfig(chunked_prefill_size=48),
                       cache=CacheConfig(max_total_tokens=4096, page_size=4, debug_invariants=True))
    e = Engine(cfg, loaded=loaded)
    try:
        reqs = [e.make_request(COPY, SamplingParams(max_tokens=64), chat=True, rid="copy"),
                e.make_request(RENAME, SamplingParams(max_tokens=40, stop=("surface(5",)), chat=True, rid="rename"),
                e.make_request("What is the capital of France?", SamplingParams(
                    max_tokens=16, logprobs=True, top_logprobs=2), chat=True, rid="chat"),
                e.make_request(COPY, SamplingParams(max_tokens=48, logprobs=True, top_logprobs=3),
                               chat=True, rid="copy-lp")]
        out = _collect(e, reqs)
        e.check_invariants()
        stats = e.stats()
    finally:
        e.shutdown()
    return out, stats


def _collect(e, reqs) -> dict:
    """Submit ``reqs`` to ``e``; per rid (tokens, text, finish reason, logprobs) once all end."""
    out, collect = collector(reqs)
    done = threading.Event()

    def cb(c):
        collect(c)
        if all(v[2] is not None for v in out.values()):
            done.set()
    for g in reqs:
        e.submit(g, cb)
    assert done.wait(600)
    return {k: (tuple(v[0]), v[1], v[2], tuple(v[3])) for k, v in out.items()}


def test_greedy_and_logprobs_equal_decoding_without_drafts(smollm2):
    off, _ = _run(smollm2, "off")
    on, stats = _run(smollm2, "ngram")
    assert stats["spec_accepted_tokens"] >= 20, stats        # drafts were accepted: else this proves nothing
    assert stats["steps"] < sum(len(v[0]) for v in on.values())
    assert on == off
    assert len(on["copy-lp"][3]) == len(on["copy-lp"][0]) and len(on["chat"][3][0].top) == 2
    assert off["rename"][2] == "stop" or "surface(5" not in off["rename"][1]


def _run_constrained(loaded, spec: str):
    """The JSON copy under its JSON schema: (tokens, text, finish) and the engine's stats."""
    cfg = EngineConfig(device="cpu", dtype="float32", num_threads=1, speculative_algorithm=spec,
                       cache=CacheConfig(max_total_tokens=4096, page_size=4, debug_invariants=True))
    e = Engine(cfg, loaded=loaded)
    try:
        params = SamplingParams(max_tokens=80, constraint=Constraint("json_schema", SCHEMA), logprobs=True)
        out = _collect(e, [e.make_request(COPY, params, chat=True, rid="json")])["json"]
        e.check_invariants()
        return out, e.stats()
    finally:
        e.shutdown()


def test_grammar_drafts_equal_decoding_without_drafts(smollm2):
    """A constrained request drafts too: a draft token the grammar refuses ends the draft, each
    draft position is sampled under the grammar's mask after the draft before it, and the output
    (tokens, text, finish, logprobs) is the one without drafts; the text parses as JSON (the
    schema's forced keys draft too: 43 steps -> 13)."""
    off, _ = _run_constrained(smollm2, "off")
    on, stats = _run_constrained(smollm2, "ngram")
    assert stats["spec_accepted_tokens"] >= 10, stats
    assert on[:3] == off[:3]
    assert [lp.logprob for lp in on[3]] == pytest.approx([lp.logprob for lp in off[3]], abs=1e-4)
    if off[2] == "stop":
        json.loads(off[1])


_CALL = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False}}, "required": ["name", "arguments"], "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
TOOL_CALL = Constraint("lark", 'start: "<tool_call>\\n" body "\\n</tool_call>"\n'
                       f"body: %json {json.dumps(_CALL)}\n")     # router/tools/formats.py's Hermes call


def test_a_pool_draft_past_the_grammars_end_into_an_eos_is_cut_before_it(smollm2):
    """The refused tool call of a fresh-clone run (test_serve_agent, 1P+1D): the decode worker's
    tenant pool held the same call followed by an EOS (an earlier unconstrained reply), the draft
    ran past the grammar's end into it, and llguidance's rollback undid one token too many. Here
    the pool is seeded the same way; the constrained request drafts from it, and its output equals
    decoding without drafts (test_grammar.py pins the llguidance half)."""
    def run(spec: str, seed_pool=None):
        cfg = EngineConfig(device="cpu", dtype="float32", num_threads=1, speculative_algorithm=spec,
                           cache=CacheConfig(max_total_tokens=4096, page_size=4, debug_invariants=True))
        e = Engine(cfg, loaded=smollm2)
        try:
            req = e.make_request("What is the weather in Paris? Answer with a tool call.",
                                 SamplingParams(max_tokens=60, constraint=TOOL_CALL), chat=True, rid="call")
            if seed_pool is not None:
                e.scheduler.spec.pool.add((req.cache_salt, req.tenant),
                                          list(req.prompt_ids) + list(seed_pool) + sorted(smollm2.tokenizer.eos_token_ids)[:1])
            out = _collect(e, [req])["call"]
            e.check_invariants()
            return out, e.stats()
        finally:
            e.shutdown()

    off, _ = run("off")
    assert off[2] == "stop" and off[1].endswith("</tool_call>"), off[1]
    on, stats = run("ngram", seed_pool=off[0])
    assert stats["spec_accepted_tokens"] >= len(off[0]) // 2, stats     # the pool's copy was drafted
    assert on[:3] == off[:3]
