"""oneDNN's instruction-set cap: what keeps the CPU linear kernels batch-invariant on AMX CPUs
(in core/ because every process, the router too, imports it first: tandem/__init__.py).

oneDNN chooses a GEMM kernel per shape. Up to AVX512-BF16 a row's reduction over K is the same
whatever the row count; with AMX (Sapphire Rapids and later Xeons) a large batch runs on AMX tiles
and a small one on AVX512, which round differently, so a request's logits would depend on what it
is batched with (issue 50: ``PackedLinear`` at 70 rows, 6 failures in 8). :func:`pin_onednn_isa`
caps oneDNN at :data:`CAP` through ``ONEDNN_MAX_CPU_ISA``.

Contract: oneDNN reads the variable once, at the process's first oneDNN primitive or query (a
``torch.ops.mkldnn`` call, a float32 matmul, ``_is_mkldnn_bf16_supported``); ``tandem/__init__.py``
calls :func:`pin_onednn_isa` on the first import of anything of Tandem's, before any of those.
A value the user set at or below the cap is kept (a lower ISA is batch-invariant too); one above
it (``DEFAULT``, ``ALL``, the AMX and FP16 levels) is replaced, and :func:`describe` says so.
Imports nothing but ``os``: the router, which has no torch, runs it too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

VAR = "ONEDNN_MAX_CPU_ISA"
CAP = "AVX512_CORE_BF16"
# oneDNN's levels at or below CAP (its ONEDNN_MAX_CPU_ISA names), lowest first.
AT_OR_BELOW_CAP = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                   "AVX512_CORE_VNNI", "AVX512_CORE_BF16")
# The levels the row-independence test masks to, each with the /proc/cpuinfo flags it needs.
TESTED_LEVELS = {"AVX2": ("avx2", "fma"),
                 "AVX512_CORE": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
                 "AVX512_CORE_BF16": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
                 "AVX512_CORE_AMX": ("amx_tile", "amx_bf16", "avx512_bf16")}

_replaced: list[str] = []


def pin_onednn_isa(environ: MutableMapping[str, str] = os.environ) -> str:
    """Cap oneDNN at :data:`CAP` in ``environ`` unless it holds a level at or below it; the level in force."""
    asked = environ.get(VAR, "").strip().upper()
    if asked in AT_OR_BELOW_CAP:
        environ[VAR] = asked
        return asked
    if asked and not _replaced:
        _replaced.append(asked)
    environ[VAR] = CAP
    return CAP


def describe(environ: Mapping[str, str] = os.environ) -> str:
    """One line for logs: the cap in force, and a user's value it replaced."""
    level = environ.get(VAR, "(unset)")
    note = f"; {_replaced[0]} replaced: above it a row's bits depend on its batch" if _replaced else ""
    return f"oneDNN ISA capped at {level} (batch-invariant kernels){note}"
