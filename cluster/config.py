"""Loads ServeConfig from ``--config FILE`` (YAML) and lets command-line flags override it, and
picks the bare ``tandem serve``'s mode for the machine (:func:`choose_mode`).

This is the one place configuration is read; everything downstream receives validated models.
The flags themselves, and how a given one lands on its field, are cluster/flags.py's.
"""

from __future__ import annotations

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


def serve_config_from_args(args) -> ServeConfig:
    """``--config`` YAML (or the defaults), then every serve and engine flag that was given."""
    return override(load_serve_config(args.config), serve_overrides(args))


AUTO_COLOCATED_MAX_CORES = 4    # the bare command serves colocated on this many usable cores or fewer


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask; the machine's count elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def choose_mode(cfg: ServeConfig, args, cores: int | None = None,
                cuda: bool | None = None) -> tuple[ServeConfig, str | None]:
    """The mode of a bare ``tandem serve`` (``make serve``): with no ``--config``, ``--mode``,
    ``--prefill``, ``--decode`` or ``--device cuda``, the real engine, no CUDA GPU and at most
    :data:`AUTO_COLOCATED_MAX_CORES` usable cores, one colocated worker (on a few cores the two
    workers of a split cluster and the router contend for them: docs/PERFORMANCE.md, "Serving on
    the CPU"); anything the user wrote is taken as written. Returns the config and the startup
    line's reason when the mode was chosen here (None otherwise). ``cores`` / ``cuda``: the
    machine's, unless a test says."""
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
