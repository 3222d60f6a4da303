"""Constrained decoding and n on SmolLM2: what a grammar and n > 1 cost (issue 13).

Three parts, one run:

  * the grammar module's own costs (engine/grammar.py, no model forward): llguidance's tokenizer
    setup; compile time of JSON schemas of growing size, cold (first compile, no cache) and cached
    (a cache hit plus the per-request matcher copy); one bitmask fill; ``apply_bitmask`` on
    [B, 49152] float32 logits for B = 1 and 32
  * decode tok/s in the engine at batch 1 and 32 with a ``json_schema`` constraint vs
    unconstrained, on the same prompts and the same number of tokens (``--tokens`` per request:
    the schema needs more than that, unconstrained ignores EOS, so both decode exactly that
    many); the constrained and unconstrained runs alternate ``--repeats`` times, best of each
  * n = 4 vs n = 1 on one prompt (``--prompt-tokens`` long): prompt tokens the engine computed
    (its ``prompt_tokens_computed`` counter), with the prefix cache on and off

Usage: python bench/grammar.py [--threads 1] [--repeats 3] [--tokens 64] [--batches 1,32]
       [--prompt-tokens 512] [--skip-engine] [--out bench/out/grammar.json]
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import torch

from tandem.bench.common import bench_parser, write_report


def schema(n_props: int) -> dict:
    props = {f"field_{i}": ({"type": "string", "maxLength": 32} if i % 3 == 0 else
                            {"type": "array", "items": {"type": "integer"}} if i % 3 == 1 else
                            {"enum": [f"value_{j}" for j in range(20)]}) for i in range(n_props)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


# A schema no output can satisfy in fewer than a few hundred tokens: every decode step is masked.
LONG = {"type": "object", "properties": {
    "cities": {"type": "array", "minItems": 64, "maxItems": 64, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                         "population": {"type": "integer", "minimum": 0}},
        "required": ["name", "population"], "additionalProperties": False}}},
    "required": ["cities"], "additionalProperties": False}


def module_costs(tok, repeats: int) -> dict:
    from tandem.core.types import Constraint
    from tandem.engine.grammar import GrammarCompiler, apply_bitmask

    comp = GrammarCompiler(tok)
    t0 = time.perf_counter()
    comp.compile_now(Constraint("json_object"))
    out: dict = {"tokenizer_setup_s": comp.tokenizer_setup_s, "first_compile_s": time.perf_counter() - t0,
                 "vocab": comp.vocab_size, "compile": []}
    for n in (2, 8, 32, 128):
        c = Constraint("json_schema", json.dumps(schema(n)))
        t0 = time.perf_counter()
        comp.compile_now(c)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(repeats):
            comp.compile_now(c).matcher()
        cached = (time.perf_counter() - t0) / repeats
        out["compile"].append({"properties": n, "cold_ms": cold * 1e3, "cached_ms": cached * 1e3})

    m = comp.matcher(Constraint("json_schema", json.dumps(schema(8))))
    for t in tok.encode('{"field_0": "abc", "field_1": [1, 2'):
        assert m.accept(t)
    bitmask = comp.allocate_bitmask(32)
    t0 = time.perf_counter()
    for _ in range(repeats):
        m.fill_bitmask(bitmask, 0)
    out["fill_bitmask_us"] = (time.perf_counter() - t0) / repeats * 1e6
    for b in (1, 32):
        logits = torch.randn(b, comp.vocab_size)
        rows = list(range(b))
        apply_bitmask(logits, bitmask[:b].contiguous(), rows)
        k = max(repeats // 10, 5)
        t0 = time.perf_counter()
        for _ in range(k):
            apply_bitmask(logits, bitmask[:b].contiguous(), rows)
        out[f"apply_bitmask_b{b}_ms"] = (time.perf_counter() - t0) / k * 1e3
    comp.shutdown()
    return out


def _decode_rate(engine, greqs) -> tuple[float, int]:
    """Decode tok/s of ``greqs`` run together: tokens after the last request's first token over
    the time from then to the last finish (prefill excluded)."""
    times: dict[str, list[float]] = {g.rid: [] for g in greqs}
    done, lock, left = threading.Event(), threading.Lock(), [len(greqs)]

    def on_chunk(c):
        with lock:
            if c.token_ids:
                times[c.rid].extend([time.perf_counter()] * len(c.token_ids))
            if c.finish_reason is not None:
                assert c.error is None, c.error
                left[0] -= 1
                if not left[0]:
                    done.set()

    for g in greqs:
        engine.submit(g, on_chunk)
    assert done.wait(1800)
    start = max(ts[0] for ts in times.values())
    end = max(ts[-1] for ts in times.values())
    n = sum(1 for ts in times.values() for t in ts if t > start)
    return n / (end - start), sum(len(ts) for ts in times.values())


def engine_overhead(loaded, batches: list[int], tokens: int, repeats: int, threads: int) -> list[dict]:
    from tandem.core.config import CacheConfig, EngineConfig
    from tandem.core.types import Constraint, SamplingParams
    from tandem.engine.engine import Engine

    b_max = max(batches)
    e = Engine(EngineConfig(device="cpu", num_threads=threads, cache=CacheConfig(
        max_total_tokens=max(4096, b_max * (64 + tokens) * 2), max_running_requests=max(64, b_max))), loaded=loaded)
    c = Constraint("json_schema", json.dumps(LONG))
    rows = []
    try:
        e.generate("warm up", SamplingParams(max_tokens=2, constraint=c), chat=True)   # compiler + schema
        for b in batches:
            prompts = [f"List {i + 3} large cities with their populations." for i in range(b)]
            modes = {"unconstrained": SamplingParams(max_tokens=tokens, ignore_eos=True),
                     "json_schema": SamplingParams(max_tokens=tokens, constraint=c)}
            best = {k: 0.0 for k in modes}
            for _ in range(repeats):
                for k, p in modes.items():
                    greqs = [e.make_request(t, p, chat=True) for t in prompts]
                    rate, n = _decode_rate(e, greqs)
                    assert n == b * tokens, (k, n)
                    best[k] = max(best[k], rate)
            rows.append({"batch": b, "tokens": tokens, "unconstrained_tok_s": best["unconstrained"],
                         "json_schema_tok_s": best["json_schema"],
                         "ratio": best["json_schema"] / best["unconstrained"]})
            print(rows[-1], flush=True)
    finally:
        e.shutdown()
    return rows


def n_prefill(loaded, prompt_tokens: int, threads: int) -> list[dict]:
    from tandem.core.config import CacheConfig, EngineConfig
    from tandem.core.messages import GenerateRequest, SampleGroup
    from tandem.core.types import SamplingParams
    from tandem.engine.engine import Engine

    rows = []
    for cache_off in (False, True):
        e = Engine(EngineConfig(device="cpu", num_threads=threads, cache=CacheConfig(
            max_total_tokens=8 * (prompt_tokens + 64), disable_prefix_cache=cache_off)), loaded=loaded)
        try:
            words = " ".join(f"w{i}" for i in range(prompt_tokens))
            for n in (1, 4):
                ids = e.tokenizer.encode(f"{uuid.uuid4().hex} {words}")[:prompt_tokens]
                gid = uuid.uuid4().hex[:8]
                p = SamplingParams(max_tokens=8, temperature=0.8, seed=1)
                greqs = [GenerateRequest(f"{gid}-{i}", tuple(ids), p, None, SampleGroup(gid, i, n) if n > 1 else None)
                         for i in range(n)]
                before = dict(e.scheduler.stats)
                t0 = time.perf_counter()
                outs = e.generate_many(greqs, timeout=1800)
                wall = time.perf_counter() - t0
                assert all(o.error is None for o in outs)
                st = e.scheduler.stats
                rows.append({"prefix_cache": not cache_off, "n": n, "prompt_tokens": len(ids),
                             "prompt_tokens_computed": st["prompt_tokens_computed"] - before["prompt_tokens_computed"],
                             "wall_s": wall})
                print(rows[-1], flush=True)
        finally:
            e.shutdown()
    return rows


def main(argv=None) -> dict:
    p = bench_parser(__doc__, "grammar", threads=1)
    p.add_argument("--repeats", type=int, default=3, help="engine runs per mode (module costs: x100)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--skip-engine", action="store_true", help="only the grammar module's own costs")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from tandem.core.tokenizer import Tokenizer
    from tandem.engine.loader import load_model, smollm2_path

    tok = Tokenizer.from_gguf(smollm2_path())
    out: dict = {"module": module_costs(tok, args.repeats * 100)}
    print(json.dumps(out["module"], indent=2), flush=True)
    if not args.skip_engine:
        loaded = load_model("smollm2", device="cpu", dtype="float32")
        out["decode"] = engine_overhead(loaded, [int(b) for b in args.batches.split(",")], args.tokens,
                                        args.repeats, args.threads)
        out["n"] = n_prefill(loaded, args.prompt_tokens, args.threads)
    write_report(args.out, out, indent=2)
    return out


if __name__ == "__main__":
    main()
