"""What Tandem's oneDNN ISA cap (core/onednn.py) costs: SmolLM2 with the cap against the same
process kind with oneDNN uncapped, a ~1k-token prefill and batch-1 decode, in each numerics this
CPU runs (the default; bf16 with dense weights where the CPU has native bf16).

Each (cap, numerics) pair runs in a child process (oneDNN fixes its ISA at its first primitive);
the uncapped child sets ``ONEDNN_MAX_CPU_ISA=DEFAULT`` after Tandem's import pinned it and before
any oneDNN call. The child also reports the kernels oneDNN ran (``ONEDNN_VERBOSE``), so a table
from an AMX CPU shows where AMX was given up. Rounds alternate capped/uncapped; medians are reported.

    python -m tandem.bench.onednn_cap [--repeats 3] [--threads 2] [--prompt-tokens 1024]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Any

from tandem.bench.common import bench_parser, write_report

CHILD = r"""
import json, os, sys, time
import tandem, torch
if sys.argv[1] == "uncapped":
    os.environ["ONEDNN_MAX_CPU_ISA"] = "DEFAULT"
from tandem.engine.loader import load_model
from tandem.engine.model_runner import ModelRunner
numerics, threads, n_prompt, steps = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
kw = {} if numerics == "default" else {"dtype": "bfloat16", "weights": "dequant"}
m = load_model("smollm2", device="cpu", **kw)
r = ModelRunner.create(m, max_total_tokens=4096, max_reqs=2, max_context=2048)
ids = [(7 * i) % 40000 + 100 for i in range(n_prompt)]
r.release(r.prefill(ids[:64])[0])                    # warm-up
t = time.perf_counter(); s, logits = r.prefill(ids); prefill_s = time.perf_counter() - t
tok = int(logits.argmax())
t = time.perf_counter()
for _ in range(steps):
    tok = int(r.decode([s], [tok])[0].argmax())
decode_s = time.perf_counter() - t
r.release(s)
print("RESULT " + json.dumps({"prefill_s": prefill_s, "decode_tok_s": steps / decode_s,
                              "dtype": str(m.dtype), "isa": os.environ["ONEDNN_MAX_CPU_ISA"]}))
"""


def run_child(mode: str, numerics: str, threads: int, n_prompt: int, steps: int, verbose: bool = False) -> dict:
    """One child's timings; ``verbose``: a short run under ONEDNN_VERBOSE for the ISA and the GEMM
    kernels oneDNN ran (its log slows every primitive, so timed runs go without it)."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1" if verbose else "0"}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    p = subprocess.run([sys.executable, "-c", CHILD, mode, numerics, str(threads), str(n_prompt), str(steps)],
                       env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"{mode} {numerics} child failed:\n{p.stderr[-2000:]}")
    lines = p.stdout.splitlines()
    out = json.loads(next(ln for ln in lines if ln.startswith("RESULT "))[len("RESULT "):])
    if verbose:
        out["onednn_isa"] = next((ln.split("isa:", 1)[1] for ln in lines if ",info,cpu,isa:" in ln), "?")
        out["kernels"] = sorted({ln.split(",")[6] for ln in lines if ln.startswith("onednn_verbose")
                                 and ",exec," in ln and ("matmul" in ln or "inner_product" in ln)})
    return out


def main() -> None:
    ap = bench_parser(__doc__, "onednn_cap", repeats=3, threads=2)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=32)
    args = ap.parse_args()
    from tandem.engine.quant.cpu import describe_cpu, native_bf16

    numerics = ["default"] + (["bf16-dense"] if native_bf16() else [])
    rows = []
    for num in numerics:
        runs: dict[str, list[dict[str, Any]]] = {"capped": [], "uncapped": []}
        for _ in range(args.repeats):
            for mode in runs:
                runs[mode].append(run_child(mode, num, args.threads, args.prompt_tokens, args.decode_steps))
        probe = {mode: run_child(mode, num, args.threads, 64, 2, verbose=True) for mode in runs}
        med = {mode: {"prefill_s": statistics.median(r["prefill_s"] for r in rs),
                      "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
                      "onednn_isa": probe[mode]["onednn_isa"], "kernels": probe[mode]["kernels"],
                      "dtype": rs[-1]["dtype"]}
               for mode, rs in runs.items()}
        rows.append({"numerics": num, **med,
                     "prefill_ratio": med["capped"]["prefill_s"] / med["uncapped"]["prefill_s"],
                     "decode_ratio": med["capped"]["decode_tok_s"] / med["uncapped"]["decode_tok_s"]})
    print(f"{describe_cpu()}; {args.prompt_tokens}-token prefill, batch-1 decode, {args.threads} threads, "
          f"medians of {args.repeats}")
    print(f"{'numerics':<11} {'mode':<9} {'oneDNN isa':<34} {'prefill s':>9} {'decode tok/s':>12}")
    for row in rows:
        for mode in ("capped", "uncapped"):
            m = row[mode]
            print(f"{row['numerics']:<11} {mode:<9} {m['onednn_isa'][:34]:<34} {m['prefill_s']:>9.3f} "
                  f"{m['decode_tok_s']:>12.1f}")
        print(f"{'':<11} capped/uncapped: prefill time x{row['prefill_ratio']:.3f}, decode tok/s "
              f"x{row['decode_ratio']:.3f}; kernels capped {row['capped']['kernels']}, uncapped "
              f"{row['uncapped']['kernels']}")
    write_report(args.out, {"cpu": describe_cpu(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
