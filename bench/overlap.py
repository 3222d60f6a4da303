"""Overlap scheduling on the CPU: the Engine against its own ModelRunner, overlap on and off.

A stand-in model whose forward sleeps a fixed time (the "device" step: the GIL is released, as a
GPU's kernels leave the host free) and then picks a cheap deterministic next token. The runner
loop (``ModelRunner.generate_greedy``: build, forward, argmax, nothing else) is the ceiling; the
Engine adds its scheduler, batch building, detokenizing and streaming. Without overlap that host
work adds to every step; with it (engine/overlap.py) it hides behind the sleeping forward.
Reported per step time: tokens/s of each (medians of ``--repeats``) and the engine/runner ratio
(the median of each repeat's ratio).

    python -m tandem.bench.overlap                       # bench/out/overlap.json
    python -m tandem.bench.overlap --step-ms 4,10 --batch 32 --tokens 40
    python -m tandem.bench.overlap --model smollm2 --batch 8 --tokens 24   # the real model, CPU

``--model smollm2``: the embedded SmolLM2 in the default CPU numerics instead of the stand-in:
the Engine's tok/s with overlap off and on (why "auto" leaves it off on the CPU: there the
forward's own Python and the host's compete for the same cores and the GIL).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, cast

import torch

from tandem.bench.common import bench_parser, write_report

VOCAB = 258            # the byte tokenizer's


class SleepModel:
    """The stand-in: ``forward`` sleeps ``seconds`` then puts all its mass on
    ``(31 * last input id + 7 * its position + 1) % 94`` (a printable byte, never EOS)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.device = torch.device("cpu")
        self.dtype = torch.float32

    def forward(self, fb, backend, return_all_logits: bool = False) -> torch.Tensor:
        time.sleep(self.seconds)
        last = fb.last_token_indices
        nxt = (fb.input_ids[last] * 31 + fb.positions[last] * 7 + 1) % 94
        logits = torch.zeros(fb.batch_size, VOCAB)
        logits[torch.arange(fb.batch_size), nxt] = 1.0
        return logits


def sleep_loaded(seconds: float):
    """A LoadedModel of :class:`SleepModel` over the byte tokenizer."""
    from tandem.engine.loader import LoadedModel
    from tandem.engine.model_config import ModelArchConfig
    from tandem.engine.models.hybrid import byte_tokenizer

    arch = ModelArchConfig(arch="llama", vocab_size=VOCAB, hidden_size=2, num_layers=1,
                           num_q_heads=1, num_kv_heads=1, head_dim=2, intermediate_size=2,
                           max_position=4096, layer_types=["full"], bos_token_id=256,
                           eos_token_ids=(257,))
    return LoadedModel(cast(Any, SleepModel(seconds)), arch, byte_tokenizer(), "sleep-stand-in")   # a stand-in model


def prompts(batch: int, length: int = 24) -> list[list[int]]:
    return [[(7 * b + 13 * i) % 94 for i in range(length)] for b in range(batch)]


def runner_seconds(loaded, batch: int, tokens: int) -> tuple[float, list[list[int]]]:
    """Wall seconds of ``ModelRunner.generate_greedy`` (one prefill + ``tokens - 1`` decodes)."""
    from tandem.engine.attention import make_attention_backend
    from tandem.engine.model_runner import ModelRunner

    r = ModelRunner.create(loaded, max_total_tokens=batch * 128, max_reqs=batch,
                           backend=make_attention_backend("torch", torch.device("cpu")))
    t = time.perf_counter()
    out = r.generate_greedy(prompts(batch), tokens)
    return time.perf_counter() - t, out


def engine_seconds(loaded, batch: int, tokens: int, overlap: str,
                   backend: str = "torch") -> tuple[float, list[list[int]]]:
    """Wall seconds of the Engine serving the same ``batch`` requests of ``tokens`` tokens."""
    from tandem.core.config import CacheConfig, EngineConfig
    from tandem.core.types import SamplingParams
    from tandem.engine.engine import Engine

    cfg = EngineConfig(device="cpu", dtype="float32", num_threads=1, attention_backend=backend,
                       overlap_schedule=overlap,
                       cache=CacheConfig(max_total_tokens=batch * 128, max_running_requests=batch))
    e = Engine(cfg, loaded=loaded)
    try:
        greqs = [e.make_request(p, SamplingParams(max_tokens=tokens, ignore_eos=True))
                 for p in prompts(batch)]
        t = time.perf_counter()
        done = e.generate_many(greqs, timeout=600)
        return time.perf_counter() - t, [c.token_ids for c in done]
    finally:
        e.shutdown()


def measure(step_s: float, batch: int, tokens: int, repeats: int = 1) -> dict:
    """Tokens/s of the runner and of the engine with overlap off and on (medians of
    ``repeats``), the engine/runner ratios (the median over repeats of each repeat's ratio: the
    three run back to back, so a change in the machine's load hits them alike), each run's
    seconds, and whether all three produced the same tokens."""
    loaded = sleep_loaded(step_s)
    runs: dict[str, list[float]] = {"runner": [], "off": [], "on": []}
    same = True
    for _ in range(repeats):
        sec, want = runner_seconds(loaded, batch, tokens)
        runs["runner"].append(sec)
        for mode in ("off", "on"):
            sec, got = engine_seconds(loaded, batch, tokens, mode)
            runs[mode].append(sec)
            same = same and got == want
    n = batch * tokens
    tps = {k: n / statistics.median(v) for k, v in runs.items()}
    paired = {m: statistics.median(r / x for r, x in zip(runs["runner"], runs[m])) for m in ("off", "on")}
    return {"step_ms": step_s * 1e3, "batch": batch, "tokens": tokens,
            "runner_tok_s": tps["runner"], "engine_off_tok_s": tps["off"], "engine_on_tok_s": tps["on"],
            "ratio_off": paired["off"], "ratio_on": paired["on"], "same_tokens": same,
            "seconds": runs}


def measure_real(batch: int, tokens: int, repeats: int) -> dict:
    """The Engine on the real SmolLM2 (default numerics, default attention): overlap off vs on."""
    from tandem.engine.loader import load_model

    loaded = load_model("smollm2", device="cpu", dtype="auto")
    runs: dict[str, list[float]] = {"off": [], "on": []}
    outs = {}
    for _ in range(repeats):
        for mode in ("off", "on"):
            sec, outs[mode] = engine_seconds(loaded, batch, tokens, mode, backend="auto")
            runs[mode].append(sec)
    n = batch * tokens
    off, on = (n / statistics.median(runs[m]) for m in ("off", "on"))
    return {"model": "smollm2", "batch": batch, "tokens": tokens, "engine_off_tok_s": off,
            "engine_on_tok_s": on, "on_over_off": on / off, "same_tokens": outs["on"] == outs["off"]}


def main(argv=None) -> int:
    ap = bench_parser(__doc__, "overlap", repeats=3)
    ap.add_argument("--model", choices=["stand-in", "smollm2"], default="stand-in")
    ap.add_argument("--step-ms", default="4,10,20", help="the stand-in's forward sleeps (ms), comma-separated")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=40, help="tokens per request")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.model == "smollm2":
        r = measure_real(args.batch, args.tokens, args.repeats)
        print(f"SmolLM2, CPU: engine overlap off {r['engine_off_tok_s']:.1f} tok/s, on "
              f"{r['engine_on_tok_s']:.1f} ({r['on_over_off']:.2f}x); same tokens: {r['same_tokens']}")
        write_report(args.out, {"real": r})
        return 0
    rows = [measure(float(ms) / 1e3, args.batch, args.tokens, args.repeats)
            for ms in args.step_ms.split(",")]
    print(f"{'step ms':>8} {'runner tok/s':>13} {'engine off':>11} {'engine on':>10} "
          f"{'off/runner':>11} {'on/runner':>10} same")
    for r in rows:
        print(f"{r['step_ms']:8.1f} {r['runner_tok_s']:13.0f} {r['engine_off_tok_s']:11.0f} "
              f"{r['engine_on_tok_s']:10.0f} {r['ratio_off']:11.2f} {r['ratio_on']:10.2f} {r['same_tokens']}")
    write_report(args.out, {"rows": rows})
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
