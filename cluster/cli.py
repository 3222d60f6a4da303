"""The cluster's ``tandem`` commands, ``generate`` and ``serve``, and the parser frame. A user's error
(bad flag, missing model file, prompt too long) prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TypeAlias

from tandem.cluster.flags import ENGINE_FLAGS, SERVE_FLAGS, add_flags, engine_config_from_args
from tandem.core.config import EngineConfig, ServeConfig
from tandem.core.types import TandemError

# what ``add_subparsers()`` returns: each command's ``register`` adds its parsers to it
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def register(subparsers: Subparsers) -> None:
    """Add ``generate`` and ``serve`` to an ``add_subparsers()`` object; each sets
    ``args.func(args) -> exit status``."""
    g = subparsers.add_parser("generate", help="generate a completion for one prompt, in-process")
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
    add_flags(g.add_argument_group("model and engine"), ENGINE_FLAGS, EngineConfig)
    g.set_defaults(func=_cmd_generate)

    s = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    c = s.add_argument_group("cluster")
    c.add_argument("--config", default=None,
                   help="YAML file with ServeConfig keys (see k8s/ for an example); flags override it")
    add_flags(c, SERVE_FLAGS, ServeConfig)
    add_flags(s.add_argument_group("model and engine"), ENGINE_FLAGS, EngineConfig)
    s.set_defaults(func=_cmd_serve)


def build_parser(commands: Sequence[Callable[[Subparsers], object]] = ()) -> argparse.ArgumentParser:
    """The ``tandem`` parser: ``generate`` and ``serve``, then each ``register(subparsers)`` in
    ``commands`` (tandem/cli.py passes bench, simulate and chaos)."""
    p = argparse.ArgumentParser(prog="tandem", description="Tandem: disaggregated LLM serving.")
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register(sub)
    for add in commands:
        add(sub)
    return p


def _cmd_generate(args: argparse.Namespace) -> int:
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


def _cmd_serve(args: argparse.Namespace) -> int:
    from tandem.cluster.config import choose_mode, serve_config_from_args
    from tandem.cluster.serve import run_serve

    cfg, why = choose_mode(serve_config_from_args(args), args)
    if why is not None:
        print(f"tandem: {why}", flush=True)
    return run_serve(cfg)


def main(argv: list[str] | None = None, commands: Sequence[Callable[[Subparsers], object]] = ()) -> int:
    """Parse ``argv`` (``commands`` registered as well) and run the command; the exit status."""
    parser = build_parser(commands)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        status: int = args.func(args)
        return status
    except (TandemError, ValueError) as e:
        print(f"tandem {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
