"""The prompts the SmolLM2-vs-HF tests share (fp32 in test_model_smollm2.py, bf16 and native
weights in test_model_smollm2_bf16.py, the k-quant files in test_model_kquant_files.py). The GPU
check runs the same five (bench/gpu/models.py keeps its own copy: tests never import bench/, and
bench/ never imports tests/)."""

from __future__ import annotations

__all__ = ["PROMPTS", "encode"]

PROMPTS = [
    ("chat", "What is the capital of France?"),
    ("raw", "def fibonacci(n):"),
    ("chat", "Write a haiku about the sea."),
    ("raw", "The three primary colors are"),
    ("chat", "Explain gravity in one sentence, then list 3 planets."),
]


def encode(tok) -> list[list[int]]:
    """Token ids of every prompt: chat ones through the chat template."""
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]) if kind == "chat" else p)
            for kind, p in PROMPTS]
