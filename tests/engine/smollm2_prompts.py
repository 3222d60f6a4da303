"""The prompts the SmolLM2-vs-HF tests share (fp32 in test_model_smollm2.py, bf16 and native
weights in test_model_smollm2_bf16.py): bench/gpu/models.py's five, which the GPU check runs too
(bench/ never imports tests/, so they live there)."""

from __future__ import annotations

from tandem.bench.gpu.models import PROMPTS

__all__ = ["PROMPTS", "encode"]


def encode(tok) -> list[list[int]]:
    """Token ids of every prompt: chat ones through the chat template."""
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]) if kind == "chat" else p)
            for kind, p in PROMPTS]
