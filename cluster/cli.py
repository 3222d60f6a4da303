"""The ``tandem`` command line.

    tandem generate --prompt TEXT [--chat] [--max-tokens N] [--temperature T] [--seed S] [--model M] [--json]
    tandem serve [--config FILE] [flags]          (OpenAI-compatible HTTP server)
    tandem bench --url URL --workload agent|vllm-multiturn|trace:FILE [--out DIR]   (load test)
    tandem simulate --trace FILE --prefill N --decode M --policy P   (cluster-scale simulation)

Errors a user can cause (bad flags, a missing model file, a prompt that does not fit) print one
line to stderr and exit with status 2; nothing prints a traceback for them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from tandem.core.types import TandemError


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None,
                   help="'smollm2' (the embedded SmolLM2-135M-Instruct GGUF, default), a .gguf file, "
                        "or a Hugging Face directory (config.json, *.safetensors, tokenizer.json)")
    g.add_argument("--page-size", type=int, default=None, help="tokens per KV page (default 1)")
    g.add_argument("--max-total-tokens", type=int, default=None,
                   help="device KV slots (tokens) per worker (default 32768)")
    g.add_argument("--max-running-requests", type=int, default=None,
                   help="concurrent requests per worker (default 64)")
    g.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="prompt tokens computed per step (default 512)")
    g.add_argument("--context-length", type=int, default=None, help="override the model's context length")
    g.add_argument("--sliding-window", type=int, default=None,
                   help="override: make every attention layer sliding-window with this window")
    g.add_argument("--disable-prefix-cache", action="store_true", default=None,
                   help="every prefix match is a miss (to measure what caching buys)")
    g.add_argument("--eviction-policy", choices=["lru", "lfu", "fifo", "priority", "slru", "session"],
                   default=None, help="radix cache eviction policy (default lru)")
    g.add_argument("--schedule-policy", choices=["fcfs", "lpm"], default=None,
                   help="waiting-queue order: arrival (fcfs, default) or longest cached prefix (lpm)")
    g.add_argument("--retraction-policy", choices=["default", "session"], default=None,
                   help="which request a full decode pool retracts first: fewest generated tokens "
                        "(default) or the least recently active session's (session)")
    g.add_argument("--host-pool-tokens", type=int, default=None,
                   help="host-memory (L2) KV tokens per worker; 0 disables the host tier (default 0)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None)
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None)
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default=None)
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    g.add_argument("--debug-cache-invariants", action="store_true", default=None,
                   help="run the cache's invariant check() after every operation (slow)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description="Tandem: disaggregated LLM serving.")
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate a completion for one prompt, in-process")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true",
                   help="apply the model's chat template to the prompt as one user message")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object: text, token_ids, prompt_tokens, finish_reason, ...")
    _add_engine_flags(g)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    from tandem.cluster.serve import add_serve_flags
    add_serve_flags(s)
    _add_engine_flags(s)

    from tandem.bench.loadgen.cli import register as register_bench
    from tandem.bench.sim.cli import register as register_simulate
    register_bench(sub)
    register_simulate(sub)
    return p


def engine_config_from_args(args, base=None):
    """EngineConfig from flags over ``base`` (flags that were not given leave base's value)."""
    from tandem.core.config import EngineConfig

    base = base or EngineConfig()
    d = base.model_dump()
    top = {"model": args.model, "device": args.device, "dtype": args.dtype,
           "attention_backend": args.attention_backend, "context_length": args.context_length,
           "sliding_window": args.sliding_window, "num_threads": args.threads}
    cache = {"page_size": args.page_size, "max_total_tokens": args.max_total_tokens,
             "max_running_requests": args.max_running_requests,
             "disable_prefix_cache": args.disable_prefix_cache, "eviction_policy": args.eviction_policy,
             "host_pool_tokens": args.host_pool_tokens, "debug_invariants": args.debug_cache_invariants}
    sched = {"chunked_prefill_size": args.chunked_prefill_size, "schedule_policy": args.schedule_policy,
             "retraction_policy": args.retraction_policy}
    d.update({k: v for k, v in top.items() if v is not None})
    d["cache"].update({k: v for k, v in cache.items() if v is not None})
    d["scheduler"].update({k: v for k, v in sched.items() if v is not None})
    return EngineConfig.model_validate(d)


def _cmd_generate(args) -> int:
    from tandem.core.types import SamplingParams
    from tandem.engine.engine import Engine

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop)).validate()
    engine = Engine(engine_config_from_args(args))
    try:
        c = engine.generate(args.prompt, params, chat=args.chat)
    finally:
        engine.shutdown()
    if c.error:
        raise TandemError(c.error)
    if args.json:
        print(json.dumps({"text": c.text, "token_ids": c.token_ids, "prompt_tokens": c.prompt_tokens,
                          "completion_tokens": len(c.token_ids), "cached_tokens": c.cached_tokens,
                          "finish_reason": c.finish_reason, "model": engine.model_name}))
    else:
        print(c.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return _cmd_generate(args)
        if args.command == "serve":
            from tandem.cluster.serve import run_serve
            return run_serve(args)
        if args.command in ("bench", "simulate"):
            return args.func(args)
    except (TandemError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        print(f"tandem {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
