"""Paged attention backends: torch (CPU) and triton (GPU; CPU under TRITON_INTERPRET=1)."""
