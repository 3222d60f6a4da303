"""What the CPU computes natively, for ``dtype="auto"``."""

from __future__ import annotations

import functools
import os
import sys

import torch

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    return _cpu_flags()


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    if not sys.platform.startswith("linux"):
        return frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def describe_cpu() -> str:
    """One line for logs and the test session header: the CPU's model, cores and the ISA flags
    that pick Tandem's kernels (tests/README.md quotes it with every timing)."""
    model = "unknown CPU"
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
        except OSError:
            pass
    flags = cpu_flags()
    have = [f for f in ISA_FLAGS if f in flags]
    return f"{model}, {os.cpu_count()} cores: {' '.join(have) or 'none of ' + ' '.join(ISA_FLAGS)}"


def native_bf16() -> str | None:
    """The CPU flag that makes bf16 GEMMs native here (e.g. ``"avx512_bf16"``), or None."""
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return None
    flags = cpu_flags()
    return next((f for f in BF16_FLAGS if f in flags), None)
