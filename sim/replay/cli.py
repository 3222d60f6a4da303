"""``tandem simulate``: replay a Mooncake-format trace through a simulated cluster."""

from __future__ import annotations

import argparse
import json
import os
import sys


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``simulate`` sub-command to an ``add_subparsers()`` object; its handler is
    ``args.func(args) -> exit status``."""
    from tandem.sim.cost_model import DEFAULT_PROFILE, PROFILES
    from tandem.router.policies import DEFAULT_POLICY, POLICIES

    p = subparsers.add_parser(
        "simulate", help="replay a trace through a simulated prefill/decode cluster (JSON summary)",
        description="Discrete-event simulation of trace arrivals -> router policy -> prefill worker "
                    "(real radix cache, simulated) -> KV transfer -> decode worker.")
    p.add_argument("--trace", default=None,
                   help="Mooncake-format JSONL (timestamp ms, input_length, output_length, hash_ids "
                        "per 512-token block); default: the vendored workloads/mooncake_synthetic_trace.jsonl")
    p.add_argument("--prefill", type=int, default=8, help="prefill workers (default 8)")
    p.add_argument("--decode", type=int, default=8, help="decode workers (default 8)")
    p.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY,
                   help=f"routing policy (default {DEFAULT_POLICY})")
    p.add_argument("--block-size", type=int, default=512,
                   help="tokens per cache page; must divide 512 or be a multiple of it (default 512)")
    p.add_argument("--capacity-tokens", type=int, default=3_000_000,
                   help="prefix-cache tokens per prefill worker; 0 = unbounded (default 3,000,000, "
                        "Mooncake's per-node figure)")
    p.add_argument("--global-cache", action="store_true",
                   help="one cache of the summed capacity shared by all prefill workers (global pool)")
    p.add_argument("--speedup", type=float, default=1.0, help="arrival-rate multiplier (default 1)")
    p.add_argument("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE,
                   help=f"GPU + model cost profile (default {DEFAULT_PROFILE})")
    p.add_argument("--decode-capacity-tokens", type=int, default=None,
                   help="KV tokens per decode worker (default: the profile's)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first K requests")
    p.add_argument("--seed", type=int, default=0, help="seed of the random policy (default 0)")
    p.add_argument("--routers", type=int, default=1,
                   help="independent routers, request i through router i mod N (default 1)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-events", dest="kv_events", action="store_true", default=None,
                    help="every cache's KV events reach every router's exact index (default: with "
                         "--policy kv_events or several routers)")
    kv.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                    help="routers see only their own traffic (approximate index)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from tandem.sim.replay.simulate import DEFAULT_TRACE, load_trace, simulate

    path = args.trace or str(DEFAULT_TRACE)
    if not os.path.isfile(path):
        raise ValueError(f"trace file {path!r} not found")
    if args.capacity_tokens < 0:
        raise ValueError(f"--capacity-tokens={args.capacity_tokens} must be >= 0 (0 = unbounded)")
    if args.routers < 1:
        raise ValueError(f"--routers={args.routers} must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit={args.limit} must be >= 1")
    try:
        trace = load_trace(path, args.limit)
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a Mooncake-format trace ({type(e).__name__}: {e})") from None
    if not trace:
        raise ValueError(f"{path}: no requests")
    summary = simulate(trace, prefill=args.prefill, decode=args.decode, policy=args.policy,
                       block_size=args.block_size, capacity_tokens=args.capacity_tokens or None,
                       speedup=args.speedup, profile=args.profile, global_cache=args.global_cache,
                       decode_capacity_tokens=args.decode_capacity_tokens, seed=args.seed,
                       routers=args.routers, kv_events=args.kv_events)
    summary["config"]["trace"] = path
    json.dump(summary, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m tandem.sim.replay.cli``); ``tandem simulate`` is tandem/cli.py's."""
    parser = argparse.ArgumentParser(prog="tandem")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"tandem {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
