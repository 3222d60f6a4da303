"""Tandem's engine vs Hugging Face transformers on SmolLM2, against the machine's own limits.

Measured in one run, same prompts, same thread count:
  * matmul peak on the model's own shapes (GFLOP/s; the faster of MKL's F.linear and oneDNN's
    packed linear, the two CPU GEMMs torch offers)        -> prefill limit
  * memory bandwidth: memcpy (GiB/s, bytes copied / time) and streaming read (GiB/s)
                                                          -> decode limit: read bandwidth / bytes
    of the model's unique weights (a decode step reads each weight once)
  * prefill of a 2,048-token prompt: Tandem vs HF (tokens/s, GFLOP/s, % of matmul peak)
  * one request decoding (16-token prompt, 128 new tokens): Tandem vs HF (tok/s, % of bandwidth limit)
  * 32 concurrent requests (16-token prompts, 128 tokens each, EOS ignored): Tandem vs HF batched generate

Timing: Tandem and HF runs alternate (A B A B ...) and each side reports its best (minimum)
time, so a burst of load from other processes on a shared machine hits both sides alike and
cannot pick the winner; the JSON keeps every sample.

Usage: python bench/engine_vs_hf.py [--threads N] [--repeats R] [--out bench/out/engine_vs_hf.json]
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tandem.bench.common import best_of, bench_parser, timed, write_report


def paired_times(fa, fb, repeats: int) -> tuple[list[float], list[float]]:
    """Alternate fa and fb ``repeats`` times each; every sample of each."""
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(timed(fa))
        tb.append(timed(fb))
    return ta, tb


def matmul_peak(arch, tokens: int, repeats: int) -> dict[str, float]:
    """GFLOP/s of the model's own linear shapes at ``tokens`` rows (fp32), per CPU GEMM:
    MKL (F.linear) and, where available, oneDNN with the weight packed once (the engine's)."""
    h, i, q = arch.hidden_size, arch.intermediate_size, arch.num_q_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]
    x = {k: torch.randn(tokens, k) for k, _ in shapes}
    ws = [torch.randn(n, k) for k, n in shapes]
    flops = sum(2 * tokens * k * n for k, n in shapes)
    kernels = {"mkl": lambda: [torch.nn.functional.linear(x[k], w) for (k, _), w in zip(shapes, ws)]}
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws]
        kernels["onednn"] = lambda: [torch.ops.mkldnn._linear_pointwise(x[k], p, None, "none", [], "")
                                     for (k, _), p in zip(shapes, packed)]
    out = {}
    for name, run in kernels.items():
        run()
        out[name] = flops / best_of(run, repeats) / 1e9
    return out


def read_gibs(nbytes: int, repeats: int) -> float:
    """Streaming read bandwidth: a sum over ``nbytes`` (reads each byte once)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    src.sum()
    return nbytes / best_of(lambda: src.sum(), repeats) / 2**30


def memcpy_gibs(nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    return nbytes / best_of(lambda: dst.copy_(src), repeats) / 2**30


def model_flops_per_token(arch, ctx: int) -> float:
    h, i = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_q_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    linear = h * (q + 2 * kv) + q * h + 3 * h * i
    attn = 2 * ctx * q  # q.k and p.v, averaged over a causal prompt of length 2*ctx
    return 2 * arch.num_layers * (linear + attn) + 2 * h * arch.vocab_size / max(ctx, 1)


def main() -> None:
    ap = bench_parser(__doc__, "engine_vs_hf", full_doc=True, threads=os.cpu_count(), repeats=3)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig
    from tandem.core.types import SamplingParams
    from tandem.engine.engine import Engine
    from tandem.engine.loader import load_model, smollm2_path

    loaded = load_model("smollm2", device="cpu", dtype=torch.float32)
    arch = loaded.arch
    gguf = Path(smollm2_path())
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    eng = Engine(EngineConfig(num_threads=args.threads,
                              cache=CacheConfig(max_total_tokens=16384, disable_prefix_cache=True),
                              scheduler=SchedulerConfig(chunked_prefill_size=args.prefill_tokens,
                                                        max_batch_tokens=args.prefill_tokens + 64)),
                 loaded=loaded)
    g = torch.Generator().manual_seed(0)
    res: dict = {"threads": args.threads, "repeats": args.repeats}

    # limits
    res["matmul_peak_by_kernel"] = matmul_peak(arch, args.prefill_tokens, args.repeats)
    res["matmul_peak_gflops"] = max(res["matmul_peak_by_kernel"].values())
    # bytes one decode step must read: the model's unique weights (tied embeddings once); the
    # engine's extra copies (e.g. a transposed or packed lm_head) are not read in the same step
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    res["weight_bytes"] = weight_bytes
    res["engine_param_bytes"] = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    res["memcpy_gibs"] = memcpy_gibs(256 * 2**20, args.repeats)
    res["read_gibs"] = read_gibs(512 * 2**20, args.repeats)
    res["decode_limit_steps_s"] = res["read_gibs"] * 2**30 / weight_bytes
    # the previous definition (memcpy bandwidth / the engine's parameter bytes), for comparison
    res["decode_limit_memcpy_steps_s"] = res["memcpy_gibs"] * 2**30 / res["engine_param_bytes"]

    # prefill
    ids = torch.randint(100, arch.vocab_size - 100, (args.prefill_tokens,), generator=g).tolist()
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    x = torch.tensor([ids])
    with torch.inference_mode():
        ts_tandem, ts_hf = paired_times(lambda: eng.generate(ids, one),
                                        lambda: hf(x, use_cache=False, logits_to_keep=1), args.repeats)
    t_tandem, t_hf = min(ts_tandem), min(ts_hf)
    flops = model_flops_per_token(arch, args.prefill_tokens // 2) * args.prefill_tokens
    res["prefill"] = {"tokens": args.prefill_tokens,
                      "tandem_tok_s": args.prefill_tokens / t_tandem, "hf_tok_s": args.prefill_tokens / t_hf,
                      "tandem_gflops": flops / t_tandem / 1e9, "hf_gflops": flops / t_hf / 1e9}
    res["prefill"]["tandem_vs_hf"] = t_hf / t_tandem
    res["prefill"]["tandem_pct_of_peak"] = 100 * res["prefill"]["tandem_gflops"] / res["matmul_peak_gflops"]
    res["prefill"]["samples_s"] = {"tandem": ts_tandem, "hf": ts_hf}

    # single-request decode
    short = torch.randint(100, arch.vocab_size - 100, (16,), generator=g).tolist()
    n = args.decode_tokens
    dec = SamplingParams(max_tokens=n, ignore_eos=True)
    x = torch.tensor([short])
    with torch.inference_mode():
        ts_tandem, ts_hf = paired_times(
            lambda: eng.generate(short, dec),
            lambda: hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2),
            args.repeats)
    t_tandem, t_hf = min(ts_tandem), min(ts_hf)
    res["decode_1"] = {"tandem_tok_s": n / t_tandem, "hf_tok_s": n / t_hf, "tandem_vs_hf": t_hf / t_tandem,
                       "samples_s": {"tandem": ts_tandem, "hf": ts_hf}}
    res["decode_1"]["tandem_pct_of_bw_limit"] = 100 * (n / t_tandem) / res["decode_limit_steps_s"]
    res["decode_1"]["tandem_pct_of_memcpy_limit"] = 100 * (n / t_tandem) / res["decode_limit_memcpy_steps_s"]

    # batched decode
    prompts = [torch.randint(100, arch.vocab_size - 100, (16,), generator=g).tolist() for _ in range(args.batch)]
    reqs = lambda: [eng.make_request(p, dec) for p in prompts]  # noqa: E731
    x = torch.tensor(prompts)
    with torch.inference_mode():
        ts_tandem, ts_hf = paired_times(
            lambda: eng.generate_many(reqs()),
            lambda: hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=2),
            max(1, args.repeats - 1))
    t_tandem, t_hf = min(ts_tandem), min(ts_hf)
    total = n * args.batch
    res["decode_batch"] = {"batch": args.batch, "tandem_tok_s": total / t_tandem, "hf_tok_s": total / t_hf,
                           "tandem_vs_hf": t_hf / t_tandem, "samples_s": {"tandem": ts_tandem, "hf": ts_hf}}
    eng.shutdown()

    print(f"threads={args.threads}  matmul peak {res['matmul_peak_gflops']:.0f} GFLOP/s  "
          f"memcpy {res['memcpy_gibs']:.1f} GiB/s  read {res['read_gibs']:.1f} GiB/s  "
          f"decode limit {res['decode_limit_steps_s']:.1f} steps/s (memcpy-based "
          f"{res['decode_limit_memcpy_steps_s']:.1f})  [best of alternating runs]")
    p, d, b = res["prefill"], res["decode_1"], res["decode_batch"]
    print(f"{'case':<28}{'tandem':>12}{'hf':>12}{'ratio':>8}{'vs limit':>10}")
    print(f"{'prefill 2048 (tok/s)':<28}{p['tandem_tok_s']:>12.0f}{p['hf_tok_s']:>12.0f}"
          f"{p['tandem_vs_hf']:>8.2f}{p['tandem_pct_of_peak']:>9.0f}%")
    print(f"{'decode x1 (tok/s)':<28}{d['tandem_tok_s']:>12.1f}{d['hf_tok_s']:>12.1f}"
          f"{d['tandem_vs_hf']:>8.2f}{d['tandem_pct_of_bw_limit']:>9.0f}%"
          f"   ({d['tandem_pct_of_memcpy_limit']:.0f}% of the memcpy-based limit)")
    print(f"{'decode x%d (tok/s)' % args.batch:<28}{b['tandem_tok_s']:>12.0f}{b['hf_tok_s']:>12.0f}"
          f"{b['tandem_vs_hf']:>8.2f}{'':>10}")
    write_report(args.out, res, indent=2)


if __name__ == "__main__":
    main()
