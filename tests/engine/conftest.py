"""Models more than one engine module loads, loaded once for those modules (from the first module
that asks to the last that uses it: support/lifetimes.py)."""

from __future__ import annotations

import pytest

from support.lifetimes import used_later

_LOADED: dict = {}      # fixture name -> its LoadedModel, while modules that use it remain


@pytest.fixture(scope="module")
def gemma3_bf16(request, hf_gguf_load):
    """Gemma 3 270M from its GGUF in bfloat16 on the file's own blocks (``dtype="bfloat16"``,
    weights "auto": the default numerics of a CPU with native bf16). Shared: a module that changes
    its layers restores them before it ends."""
    if "gemma3_bf16" not in _LOADED:
        from record_gemma3_gguf_greedy import gguf_path
        from tandem.engine.loader import load_model

        with hf_gguf_load():
            _LOADED["gemma3_bf16"] = load_model(gguf_path(), device="cpu", dtype="bfloat16")
    yield _LOADED["gemma3_bf16"]
    if not used_later(request, "gemma3_bf16"):
        del _LOADED["gemma3_bf16"]
