"""Model families with their own config parsing and model class, by HF architecture name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tandem.engine.model_config import HF_FAMILY_ARCHS


@dataclass(frozen=True)
class Family:
    name: str
    parse: Callable[[dict[str, Any]], tuple]
    build: Callable[..., Any]


def _gemma3() -> Family:
    from tandem.engine.models.gemma3 import Gemma3ForCausalLM, gemma3_arch

    return Family("gemma3", gemma3_arch, Gemma3ForCausalLM)


def _granite_hybrid() -> Family:
    from tandem.engine.models.granite_hybrid import GraniteHybridForCausalLM, granite_hybrid_arch

    return Family("granitemoehybrid", granite_hybrid_arch, GraniteHybridForCausalLM)


def _gemma3_text() -> Family:
    from tandem.engine.models.gemma3 import Gemma3ForCausalLM, gemma3_arch, gemma3_text_config, text_weights

    return Family("gemma3", lambda cfg: gemma3_arch(gemma3_text_config(cfg)),
                  lambda arch, extras, get, dev, dt: Gemma3ForCausalLM(arch, extras, text_weights(get), dev, dt))


_FAMILIES: dict[str, Callable[[], Family]] = {"gemma3": _gemma3, "gemma3_text": _gemma3_text,
                                              "granitemoehybrid": _granite_hybrid}


def hf_family(cfg: dict[str, Any]) -> Family | None:
    """The family of a parsed config.json, or None (the Llama family, or unsupported: then
    ``ModelArchConfig.from_hf_config`` says which architectures are)."""
    for a in cfg.get("architectures") or []:
        if a in HF_FAMILY_ARCHS:
            return _FAMILIES[HF_FAMILY_ARCHS[a]]()
    return None
