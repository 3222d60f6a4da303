"""The grammar module's own costs on SmolLM2's tokenizer (engine/grammar.py, no model forward):

  * compile time of JSON schemas of growing size, cold (first compile) and cached (a cache hit
    plus the per-request matcher copy)
  * one bitmask fill per step (``Matcher.fill_bitmask``), mid-way through a JSON object
  * ``apply_bitmask`` on [B, 49152] float32 logits for B = 1 and 32, every row constrained

Decode tok/s with vs without a constraint needs the engine's sampler hook (phase 2); these are
the per-step costs that hook adds.

Usage: python bench/grammar.py [--threads 1] [--repeats 200] [--out bench/out/grammar.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def schema(n_props: int) -> dict:
    props = {f"field_{i}": ({"type": "string", "maxLength": 32} if i % 3 == 0 else
                            {"type": "array", "items": {"type": "integer"}} if i % 3 == 1 else
                            {"enum": [f"value_{j}" for j in range(20)]}) for i in range(n_props)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--out", default="bench/out/grammar.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from tandem.core.tokenizer import Tokenizer
    from tandem.core.types import Constraint
    from tandem.engine.grammar import GrammarCompiler, apply_bitmask
    from tandem.engine.loader import smollm2_path

    tok = Tokenizer.from_gguf(smollm2_path())
    t0 = time.perf_counter()
    comp = GrammarCompiler(tok)
    out: dict = {"tokenizer_setup_s": time.perf_counter() - t0, "vocab": comp.vocab_size, "compile": []}
    for n in (2, 8, 32, 128):
        c = Constraint("json_schema", json.dumps(schema(n)))
        t0 = time.perf_counter()
        comp.compile_now(c)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            comp.compile_now(c).matcher()
        cached = (time.perf_counter() - t0) / args.repeats
        out["compile"].append({"properties": n, "cold_ms": cold * 1e3, "cached_ms": cached * 1e3})

    m = comp.matcher(Constraint("json_schema", json.dumps(schema(8))))
    for t in tok.encode('{"field_0": "abc", "field_1": [1, 2'):
        assert m.accept(t)
    bitmask = comp.allocate_bitmask(32)
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        m.fill_bitmask(bitmask, 0)
    out["fill_bitmask_us"] = (time.perf_counter() - t0) / args.repeats * 1e6
    for b in (1, 32):
        logits = torch.randn(b, comp.vocab_size)
        rows = list(range(b))
        apply_bitmask(logits, bitmask[:b].contiguous(), rows)
        t0 = time.perf_counter()
        for _ in range(max(args.repeats // 10, 5)):
            apply_bitmask(logits, bitmask[:b].contiguous(), rows)
        out[f"apply_bitmask_b{b}_ms"] = (time.perf_counter() - t0) / max(args.repeats // 10, 5) * 1e3
    comp.shutdown()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
