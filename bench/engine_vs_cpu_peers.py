"""Tandem's engine vs the CPU peers a user would try instead: HF transformers and llama.cpp.

The same prompts, the same GGUF file (the embedded SmolLM2-135M-Instruct Q4_1), the same thread
count, in one run:
  * Tandem in each numerics mode: float32 (dequantized, exact), bfloat16 (dequantized),
    bfloat16 + the GGUF's own Q4_1 weights on Tandem's AVX512 kernels ("native", the default on a
    CPU with native bf16: engine/quant/avx512.py, with the cpu_kernel attention backend and each
    layer fused into one C call), and on torch's int4 kernel ("int4", the previous default);
  * HF transformers in the same dtypes (transformers >= 5 keeps GGUF weights quantized and
    computes in float32; in bfloat16 it casts around every matmul);
  * llama.cpp through llama-cpp-python on the same file (``n_threads`` = ``n_threads_batch`` =
    the thread count; 32 concurrent requests as 32 parallel sequences of one context).
Cases: prefill of a 2,048-token prompt (tok/s), one request decoding (16-token prompt, 128 new
tokens; tok/s), 32 concurrent requests (16-token prompts, 128 tokens each, EOS ignored; total
tok/s). Greedy everywhere. Machine limits measured in the same run: the matmul peak on the model's
own shapes (fp32 and bf16, oneDNN packed) and the streaming-read bandwidth -> each mode's decode
limit (read bandwidth / the bytes of weights one step reads).

Timing: every contender runs once per round, rounds repeat (A B C ... A B C ...), so a burst of
load from other processes hits all alike; the table shows medians and the median of per-round
ratios; the JSON keeps every sample.

llama-cpp-python is a benchmark-only tool (not in pyproject.toml, not needed by ``make test``).
Build it once (~10-20 minutes on 2 cores) with AMX off (its AMX path faults on these machines)::

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \\
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \\
      nice -n 19 .venv/bin/pip install llama-cpp-python==0.3.36

Without it the llama.cpp rows are skipped.

Usage: python bench/engine_vs_cpu_peers.py [--threads N] [--repeats R]
       [--modes float32,bfloat16,native,int4] [--cases prefill,decode,batch] [--no-hf] [--no-llama]
       [--out bench/out/engine_vs_cpu_peers.json]
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import numpy as np
import torch

from tandem.bench.common import best_of, bench_parser, timed, write_report

MODES = {"float32": ("float32", "dequant"), "bfloat16": ("bfloat16", "dequant"),
         "native": ("bfloat16", "native"), "int4": ("bfloat16", "int4")}
HF_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "native": torch.bfloat16,
            "int4": torch.bfloat16}


# -- machine limits ---------------------------------------------------------------------------
def matmul_peak(arch, tokens: int, dtype: torch.dtype, repeats: int) -> float:
    """GFLOP/s of oneDNN's packed GEMM on the model's layer shapes at ``tokens`` rows."""
    h, i = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_q_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]
    x = {k: torch.randn(tokens, k).to(dtype) for k, _ in shapes}
    packed = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).to(dtype), 32) for k, n in shapes]

    def run():
        for (k, _), p in zip(shapes, packed):
            torch.ops.mkldnn._linear_pointwise(x[k], p, None, "none", [], "")
    run()
    return sum(2 * tokens * k * n for k, n in shapes) / best_of(run, repeats) / 1e9


def read_gibs(nbytes: int, repeats: int) -> float:
    """Streaming read bandwidth: a sum over ``nbytes`` (reads each byte once)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    src.sum()
    return nbytes / best_of(lambda: src.sum(), repeats) / 2**30


def step_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every projection kernel (and the vocab head)."""
    return sum(k.nbytes for k in model.kernels())


# -- contenders -------------------------------------------------------------------------------
class TandemRunner:
    def __init__(self, mode: str, threads: int, prefill_tokens: int):
        from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig
        from tandem.engine.engine import Engine

        dtype, weights = MODES[mode]
        self.engine = Engine(EngineConfig(
            dtype=dtype, weights=weights, num_threads=threads,
            cache=CacheConfig(max_total_tokens=16384, disable_prefix_cache=True),
            scheduler=SchedulerConfig(chunked_prefill_size=prefill_tokens,
                                      max_batch_tokens=prefill_tokens + 64)))
        self.precision = self.engine.loaded.precision
        self.weight_bytes = step_weight_bytes(self.engine.loaded.model)

    def prefill(self, ids):
        from tandem.core.types import SamplingParams
        self.engine.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True))

    def decode(self, ids, n):
        from tandem.core.types import SamplingParams
        return self.engine.generate(ids, SamplingParams(max_tokens=n, ignore_eos=True)).token_ids

    def batch(self, prompts, n):
        from tandem.core.types import SamplingParams
        p = SamplingParams(max_tokens=n, ignore_eos=True)
        self.engine.generate_many([self.engine.make_request(x, p) for x in prompts])

    def close(self):
        self.engine.shutdown()


class HFRunner:
    def __init__(self, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        from tandem.engine.loader import smollm2_path
        path = Path(smollm2_path())
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()

    @torch.inference_mode()
    def prefill(self, ids):
        self.model(torch.tensor([ids]), use_cache=False, logits_to_keep=1)

    @torch.inference_mode()
    def decode(self, ids, n):
        x = torch.tensor([ids])
        out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=2)
        return out[0, len(ids):].tolist()

    @torch.inference_mode()
    def batch(self, prompts, n):
        x = torch.tensor(prompts)
        self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=2)

    def close(self):
        pass


class LlamaCppRunner:
    """llama.cpp on the same GGUF. One context for single-sequence cases; one with ``n_seq_max``
    parallel sequences for the batch (one llama_decode per step carries every sequence's token)."""

    def __init__(self, threads: int, prefill_tokens: int, batch: int, batch_ctx: int):
        import llama_cpp

        from tandem.engine.loader import smollm2_path
        self.lc = llama_cpp
        self.llm = llama_cpp.Llama(smollm2_path(), n_threads=threads, n_threads_batch=threads,
                                   n_ctx=prefill_tokens + 256, n_batch=prefill_tokens, n_ubatch=512,
                                   verbose=False)
        p = llama_cpp.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = batch * batch_ctx, 512, 512, batch
        p.n_threads = p.n_threads_batch = threads
        p.kv_unified = True
        self.ctx = llama_cpp.llama_init_from_model(self.llm.model, p)
        self.n_vocab = self.llm.n_vocab()
        self.max_seqs = batch
        self.batch_buf = llama_cpp.llama_batch_init(512, 0, batch)
        self.system = llama_cpp.llama_print_system_info().decode()

    def prefill(self, ids):
        self.llm.reset()
        self.llm.eval(ids)

    def decode(self, ids, n):
        self.llm.reset()
        self.llm.eval(ids)
        out = []
        for i in range(n):   # the last eval's logits (Llama.eval keeps none without logits_all)
            t = int(np.argmax(np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))))
            out.append(t)
            if i < n - 1:
                self.llm.eval([t])
        return out

    def _decode_batch(self, items):
        """items: (seq, pos, token, want_logits); -> logits rows of the wanted ones, in order."""
        lc, b = self.lc, self.batch_buf
        b.n_tokens = len(items)
        for j, (s, pos, tok, want) in enumerate(items):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = tok, pos, 1, int(want)
            b.seq_id[j][0] = s
        if lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        rows = []
        for j, (_, _, _, want) in enumerate(items):
            if want:
                ptr = lc.llama_get_logits_ith(self.ctx, j)
                rows.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)))
        return rows

    def batch(self, prompts, n):
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        items = [(s, i, t, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)]
        last: list[np.ndarray] = []
        for a in range(0, len(items), 512):
            last += self._decode_batch(items[a:a + 512])
        toks = [int(np.argmax(r)) for r in last]
        for step in range(1, n):
            rows = self._decode_batch([(s, len(p) + step - 1, toks[s], True) for s, p in enumerate(prompts)])
            toks = [int(np.argmax(r)) for r in rows]

    def close(self):
        self.lc.llama_batch_free(self.batch_buf)
        self.lc.llama_free(self.ctx)


# -- driver -----------------------------------------------------------------------------------
def run_rounds(contenders: dict, fn_name: str, args_, repeats: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(repeats):
        for name, c in contenders.items():
            samples[name].append(timed(lambda: getattr(c, fn_name)(*args_)))
    return samples


def summarize(samples: dict[str, list[float]], work: float) -> dict:
    """tok/s medians, and per-round ratios against llama.cpp and HF of the same dtype."""
    out = {"samples_s": samples, "tok_s": {k: work / statistics.median(v) for k, v in samples.items()}}
    ratios = {}
    for k, v in samples.items():
        if not k.startswith("tandem:"):
            continue
        mode = k.split(":", 1)[1]
        for ref in ("llama.cpp", f"hf:{str(HF_DTYPE[mode]).removeprefix('torch.')}"):
            if ref in samples:
                ratios[f"{k} / {ref}"] = statistics.median(b / a for a, b in zip(v, samples[ref]))
    out["ratios"] = ratios
    return out


def main() -> None:
    ap = bench_parser(__doc__, "engine_vs_cpu_peers", full_doc=True, threads=os.cpu_count(), repeats=5)
    ap.add_argument("--modes", default="float32,bfloat16,native")
    ap.add_argument("--cases", default="prefill,decode,batch")
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-llama", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    modes = [m for m in args.modes.split(",") if m]
    cases = set(args.cases.split(","))

    from tandem.engine.loader import load_model
    arch = load_model("smollm2", device="cpu", dtype="float32", weights="dequant").arch
    contenders: dict = {f"tandem:{m}": TandemRunner(m, args.threads, args.prefill_tokens) for m in modes}
    res: dict = {"threads": args.threads, "repeats": args.repeats, "load_avg_start": os.getloadavg(),
                 "precision": {k: c.precision for k, c in contenders.items()}}
    if not args.no_hf:
        for dt in sorted({str(HF_DTYPE[m]).removeprefix("torch.") for m in modes}):
            contenders[f"hf:{dt}"] = HFRunner(getattr(torch, dt))
    if not args.no_llama:
        try:
            contenders["llama.cpp"] = LlamaCppRunner(args.threads, args.prefill_tokens, args.batch,
                                                     16 + args.decode_tokens + 16)
            res["llama_cpp_system"] = contenders["llama.cpp"].system
        except ImportError:
            print("llama-cpp-python is not installed: llama.cpp rows skipped (see this file's docstring)")

    res["matmul_peak_gflops"] = {str(dt).removeprefix("torch."): matmul_peak(arch, args.prefill_tokens, dt, 3)
                                 for dt in (torch.float32, torch.bfloat16)}
    res["read_gibs"] = read_gibs(512 * 2**20, 5)
    res["decode_limit_steps_s"] = {k: res["read_gibs"] * 2**30 / c.weight_bytes
                                   for k, c in contenders.items() if isinstance(c, TandemRunner)}
    res["step_weight_mb"] = {k: c.weight_bytes / 1e6 for k, c in contenders.items() if isinstance(c, TandemRunner)}

    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(100, arch.vocab_size - 100, (n,), generator=g).tolist()  # noqa: E731
    n = args.decode_tokens
    if "prefill" in cases:
        ids = rand(args.prefill_tokens)
        res["prefill"] = summarize(run_rounds(contenders, "prefill", (ids,), args.repeats), args.prefill_tokens)
    if "decode" in cases:
        short = rand(16)
        res["decode"] = summarize(run_rounds(contenders, "decode", (short, n), args.repeats), n)
        res["decode"]["greedy_16"] = {k: c.decode(short, 16) for k, c in contenders.items()}
    if "batch" in cases:
        prompts = [rand(16) for _ in range(args.batch)]
        res["batch"] = summarize(run_rounds(contenders, "batch", (prompts, n), max(1, args.repeats - 2)),
                                 n * args.batch)
    res["load_avg_end"] = os.getloadavg()
    for c in contenders.values():
        c.close()

    print(f"threads={args.threads}  matmul peak fp32 {res['matmul_peak_gflops']['float32']:.0f} / bf16 "
          f"{res['matmul_peak_gflops']['bfloat16']:.0f} GFLOP/s  read {res['read_gibs']:.1f} GiB/s  "
          f"load {res['load_avg_start'][0]:.1f} -> {res['load_avg_end'][0]:.1f}  [medians of {args.repeats} rounds]")
    for k, v in res["precision"].items():
        print(f"  {k}: {v}; decode limit {res['decode_limit_steps_s'][k]:.0f} steps/s "
              f"({res['step_weight_mb'][k]:.0f} MB/step)")
    for case in ("prefill", "decode", "batch"):
        if case not in res:
            continue
        print(f"{case}: " + "  ".join(f"{k} {v:.1f}" for k, v in res[case]["tok_s"].items()) + "  tok/s")
        for k, v in res[case]["ratios"].items():
            print(f"    {k}: {v:.2f}x")
    write_report(args.out, res, indent=2)


if __name__ == "__main__":
    main()
