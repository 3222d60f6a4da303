"""Loads ServeConfig from ``--config FILE`` (YAML) and lets command-line flags override it.

This is the one place configuration is read; everything downstream receives validated models.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from tandem.core.config import ServeConfig
from tandem.core.types import TandemError


def load_serve_config(path: str | None) -> ServeConfig:
    if path is None:
        return ServeConfig()
    p = Path(path)
    if not p.is_file():
        raise TandemError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise TandemError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise TandemError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    try:
        return ServeConfig.model_validate(data)
    except ValueError as e:
        raise TandemError(f"config file {path} is invalid: {e}") from None


def serve_config_from_args(args) -> ServeConfig:
    from tandem.cluster.cli import engine_config_from_args

    base = load_serve_config(args.config)
    d = base.model_dump()
    flags = {"mode": args.mode, "engine": args.engine, "prefill": args.prefill, "decode": args.decode,
             "host": args.host, "port": args.port, "api_key": args.api_key,
             "ray_address": args.ray_address, "policy": args.policy,
             "transfer_timeout_s": args.transfer_timeout,
             "local_prefill_threshold": args.local_prefill_threshold,
             "decode_max_total_tokens": args.decode_max_total_tokens,
             "tool_parser": getattr(args, "tool_parser", None),
             "sim_profile": getattr(args, "sim_profile", None),
             "sim_speedup": getattr(args, "sim_speedup", None)}
    d.update({k: v for k, v in flags.items() if v is not None})
    d["engine_config"] = engine_config_from_args(args, base.engine_config).model_dump()
    return ServeConfig.model_validate(d)
