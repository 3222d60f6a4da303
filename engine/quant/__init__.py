"""Weights as the file stores them, and the linear kernels that compute on them.

- ``blocks.py``: :class:`QuantWeight`, a GGUF Q4_0 / Q4_1 / Q8_0 tensor's codes and per-block
  scales, unpacked but not dequantized (row reorder and stacking for fused projections).
- ``linear.py``: the linear kernels (oneDNN-packed fp32/bf16, torch's int4 weight-only GEMM on the
  file's blocks, plain) and :func:`make_linear`, which picks one per weight.
- ``cpu.py``: whether this CPU has native bf16 (what ``dtype="auto"`` asks).
"""
