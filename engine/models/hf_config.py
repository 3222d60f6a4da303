"""Small readers of ``config.json`` fields shared by the family modules (gemma3, granite_hybrid)."""

from __future__ import annotations

from typing import Any

from tandem.engine.model_config import ModelLoadError


def need(cfg: dict[str, Any], *keys: str) -> None:
    """Raise unless every key is present (and not null)."""
    for k in keys:
        if cfg.get(k) is None:
            raise ModelLoadError(f"config.json lacks {k!r}")


def hf_float(v: Any) -> float:
    """A float as config.json writes it: a number, ``Infinity`` (Python's json), or transformers 5's
    ``{"__float__": "Infinity"}``."""
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    return float(v)


def special_ids(cfg: dict[str, Any]) -> tuple[int | None, tuple[int, ...]]:
    """``(bos_token_id or None, eos_token_ids)``: eos may be an int or a list."""
    bos = cfg.get("bos_token_id")
    eos = cfg.get("eos_token_id")
    eos_ids = (eos,) if isinstance(eos, int) else tuple(e for e in (eos or []) if isinstance(e, int))
    return (bos if isinstance(bos, int) else None), eos_ids


def rope_theta(cfg: dict[str, Any], rope: dict[str, Any] | None, default: float) -> float:
    """``rope_theta`` from the top level (transformers < 5) or a ``rope_parameters`` dict."""
    return float(cfg.get("rope_theta") or (rope or {}).get("rope_theta") or default)
