"""Loads ServeConfig from ``--config FILE`` (YAML) and lets command-line flags override it.

This is the one place configuration is read; everything downstream receives validated models.
The flags themselves, and how a given one lands on its field, are cluster/flags.py's.
"""

from __future__ import annotations

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
