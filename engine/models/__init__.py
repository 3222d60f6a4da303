"""Model definitions. Each takes HF-named tensors and exposes ``forward(fb, backend, return_all_logits)``."""
