"""Serving on the CPU, measured from outside: ``tandem serve`` (colocated, and 1 prefill + 1 decode)
vs llama.cpp's own ``llama-server`` on the same GGUF, with the same streamed multi-turn client
(issue 27, item 4).

Workload (the same seeded text for every server): ``--sessions`` chat sessions sharing one long
system prompt (``--system-tokens`` words), each its own task, ``--turns`` turns, ``--concurrency``
sessions at a time; every turn appends the previous reply and a short user message and asks for
``--max-tokens`` tokens exactly (``ignore_eos`` and ``min_tokens``, both servers take them),
streamed (SSE). Before the measured run, one short unrelated request warms the server up.
Reported per server: output tokens/s (all completion tokens / wall time of the run), TTFT p50 and
p90 over all turns, TTFT p50 of turn 0 and of later turns, the prompt tokens the server says it
had cached, and each Tandem configuration's ratio to llama-server.

llama-server: ``--threads`` threads (``-t`` and ``-tb``), ``-np 4 --cache-reuse 256``, context
``4 x --ctx-per-slot``, built from the vendored llama.cpp of llama-cpp-python 0.3.36 with AMX off
(its AMX path faults on these machines)::

    pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B build -DCMAKE_BUILD_TYPE=Release \\
      -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \\
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF \\
      -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    nice -n 19 cmake --build build --target llama-server -j2

Tandem: ``tandem serve --device cpu --threads N`` (bench/agent_cache.py's Server), the rest its
defaults. Without a llama-server binary (``--llama-server``), its row is skipped and the ratios
are Tandem 1P+1D vs colocated.

Usage: python bench/serve_vs_llamaserver.py [--llama-server PATH] [--model smollm2|FILE.gguf]
       [--configs colocated,disaggregated,llama-server] [--threads 2] [--out bench/out/serve_vs_llamaserver.json]
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.agent_cache import Server
from tandem.bench.common import bench_parser, write_report

TANDEM = {"colocated": ["--mode", "colocated"],
          "disaggregated": ["--mode", "disaggregated", "--prefill", "1", "--decode", "1"]}


class LlamaServer(Server):
    """``llama-server`` as a subprocess, started and stopped as :class:`Server` does."""

    def __init__(self, binary: str, gguf: str, args, log_path: Path):
        super().__init__([], args, log_path)
        self.cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port),
                    "-t", str(args.threads), "-tb", str(args.threads), "-np", "4", "--cache-reuse", "256",
                    "-c", str(4 * args.ctx_per_slot)]


def sessions(args):
    """The seeded multi-turn chat sessions (loadtest's Session / Turn, exact output length)."""
    from tandem.loadtest.loadgen.workloads import Session, Turn, words

    shared = random.Random(f"serve_vs_llamaserver/{args.seed}/system")
    system = "You are a helpful assistant for a software team. " + words(shared, args.system_tokens)
    out = []
    for s in range(args.sessions):
        rng = random.Random(f"serve_vs_llamaserver/{args.seed}/{s}")
        turns = tuple(Turn(user=f"Task {s}.{t}: " + words(rng, args.user_tokens), max_tokens=args.max_tokens,
                           exact_output=True) for t in range(args.turns))
        out.append(Session(f"s{s}", system, turns))
    return out


async def run_client(url: str, args) -> tuple[list, float]:
    from tandem.loadtest.loadgen.client import ClientConfig, StreamClient, make_http, resolve_model, run_sessions

    class Exact(StreamClient):   # ignore_eos too: llama-server's way to ask for exactly max_tokens
        def _body(self, max_tokens: int, exact: bool) -> dict:
            return super()._body(max_tokens, exact) | ({"ignore_eos": True} if exact else {})

    cfg = ClientConfig(url=url, temperature=0.0, timeout_s=args.timeout)
    async with make_http(cfg) as http:
        model = await resolve_model(http)
        warm = await Exact(http, cfg, model, time.perf_counter()).chat(
            [{"role": "user", "content": "Say hello."}], max_tokens=4)
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}: {warm.error_detail}")
        t0 = time.perf_counter()
        records = await run_sessions(Exact(http, cfg, model, t0), sessions(args),
                                     concurrency=args.concurrency, progress=False)
        return records, time.perf_counter() - t0


def _p(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None


def summarize(records, wall_s: float) -> dict:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    return {"requests": len(records), "errors": len(records) - len(ok), "wall_s": wall_s,
            "output_tokens": sum(r.completion_tokens or 0 for r in ok),
            "output_tok_s": sum(r.completion_tokens or 0 for r in ok) / wall_s,
            "ttft_p50_s": _p(ttft, 0.5), "ttft_p90_s": _p(ttft, 0.9),
            "ttft_p50_turn0_s": _p([r.ttft for r in ok if r.turn == 0 and r.ttft is not None], 0.5),
            "ttft_p50_later_s": _p([r.ttft for r in ok if r.turn > 0 and r.ttft is not None], 0.5),
            "itl_p50_s": _p([x for r in ok for x in r.itl], 0.5),
            "cached_token_ratio": sum(r.cached_tokens or 0 for r in ok) / prompt if prompt else None,
            "ttft_s": ttft}


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__, "serve_vs_llamaserver", full_doc=True, threads=2, seed=0)
    ap.add_argument("--llama-server", default="", help="the llama-server binary (none: its row is skipped)")
    ap.add_argument("--model", default="smollm2", help="'smollm2' (the embedded GGUF) or a .gguf file")
    ap.add_argument("--configs", default="colocated,disaggregated,llama-server")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--user-tokens", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--ctx-per-slot", type=int, default=4096)
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--extra", default="", help="extra flags for tandem serve, space-separated")
    args = ap.parse_args(argv)

    from tandem.engine.loader import smollm2_path

    gguf = smollm2_path() if args.model == "smollm2" else args.model
    logdir = Path(tempfile.mkdtemp(prefix="serve_vs_llamaserver-"))
    results: dict[str, dict] = {}
    for name in args.configs.split(","):
        if name == "llama-server":
            if not args.llama_server:
                print("llama-server: skipped (no --llama-server binary)", file=sys.stderr)
                continue
            srv: Server = LlamaServer(args.llama_server, gguf, args, logdir / "llama-server.log")
        else:
            flags = [*TANDEM[name], "--model", gguf, "--threads", str(args.threads), *args.extra.split()]
            srv = Server(flags, args, logdir / f"{name}.log")
        with srv:
            records, wall = asyncio.run(run_client(srv.url, args))
        results[name] = summarize(records, wall) | {"startup_s": srv.startup_s}
        r = results[name]
        print(f"{name:14s} {r['output_tok_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_s']:.3f} s "
              f"p90 {r['ttft_p90_s']:.3f} s  (turn 0 {r['ttft_p50_turn0_s']:.3f}, later "
              f"{r['ttft_p50_later_s']:.3f})  ITL p50 {1e3 * r['itl_p50_s']:.1f} ms  "
              f"cached {r['cached_token_ratio'] or 0:.2f}  errors {r['errors']}", flush=True)
    base = results.get("llama-server") or results.get("colocated")
    if base:
        for name, r in results.items():
            r["vs_base"] = {"output_tok_s": r["output_tok_s"] / base["output_tok_s"],
                            "ttft_p50": r["ttft_p50_s"] / base["ttft_p50_s"]}
            print(f"{name:14s} vs {'llama-server' if 'llama-server' in results else 'colocated'}: "
                  f"{r['vs_base']['output_tok_s']:.2f}x tok/s, TTFT p50 {r['vs_base']['ttft_p50']:.2f}x")
    write_report(args.out, {"args": vars(args), "gguf": gguf, "results": results, "logs": str(logdir)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
