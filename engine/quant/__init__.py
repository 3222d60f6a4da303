"""Weights as the file stores them, and the linear kernels that compute on them.

- ``blocks.py``: :class:`QuantWeight`, a GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 or K-quant (Q4_K,
  Q5_K, Q6_K) tensor's codes and per-group scales, unpacked but not dequantized (row reorder and stacking for fused projections).
- ``linear.py``: the linear kernels (oneDNN-packed fp32/bf16, torch's int4 weight-only GEMM on the
  file's blocks, plain) and :func:`make_linear`, which picks one per weight.
- ``avx512.py`` + ``avx512_kernels.c``: ``Avx512Linear``, the file's Q4_0/Q4_1 blocks times bf16
  activations (AVX512-BF16), likewise Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K and Q8_0 layer weights, and
  the vocab head's Q8_0 blocks times int8 activation blocks (AVX512-VNNI), with a
  fused pre-op; the default native kernel on CPUs with AVX512 BF16 + VNNI. The same C file holds the rotary kernel (``rope_``),
  the paged attention engine/attention/cpu_backend.py calls and the whole-layer call
  engine/models/llama_cpu.py makes. ``native_ops.cpp`` registers them as typed torch ops
  (``torch.ops.tandem.*``, shapes and dtypes checked at the boundary; the C signatures declared once
  in ``avx512_kernels.h``); ``native_lib.py`` builds both with gcc/g++ once per source hash
  (``~/.cache/tandem/kernels``) and says why not where it cannot.
- ``preop.py``: ``PreOp``, the RMSNorm / silu-mul a projection applies to its input first (fused
  by Avx512Linear, applied in torch by the others).
- ``cpu.py``: whether this CPU has native bf16 (what ``dtype="auto"`` asks).
"""
