"""The one place configuration is read: ServeConfig from ``--config`` YAML with the given flags on top."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import yaml

from tandem.cluster.flags import override, serve_overrides
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


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """``--config`` YAML (or the defaults), then every serve and engine flag that was given."""
    return override(load_serve_config(args.config), serve_overrides(args))


AUTO_COLOCATED_MAX_CORES = 4


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask; the machine's count elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def choose_mode(cfg: ServeConfig, args: argparse.Namespace, cores: int | None = None,
                cuda: bool | None = None) -> tuple[ServeConfig, str | None]:
    """The mode of a bare ``tandem serve``: colocated on the real engine with no CUDA GPU and at most
    :data:`AUTO_COLOCATED_MAX_CORES` cores, when the user chose nothing; else as written. Returns the
    config and the reason when chosen here (else None)."""
    given = (getattr(args, "config", None), getattr(args, "mode", None), getattr(args, "prefill", None),
             getattr(args, "decode", None))
    if any(v is not None for v in given) or cfg.engine != "real" or cfg.engine_config.device == "cuda":
        return cfg, None
    cores = usable_cores() if cores is None else cores
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if cuda or cores > AUTO_COLOCATED_MAX_CORES:
        return cfg, None
    return cfg.model_copy(update={"mode": "colocated"}), (
        f"mode colocated (chosen for this machine: {cores} CPU core(s), no GPU; one worker does prefill "
        f"and decode, which serves faster than a split cluster on {AUTO_COLOCATED_MAX_CORES} cores or "
        f"fewer; --mode disaggregated splits them)")
