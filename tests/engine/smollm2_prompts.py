"""The prompts the SmolLM2-vs-HF tests share (fp32 in test_model_smollm2.py, bf16 and native
weights in test_model_smollm2_bf16.py; bench/gpu/models.py runs the same five on a GPU)."""

from __future__ import annotations

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
