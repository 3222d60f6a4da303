"""What the CPU computes natively, for ``dtype="auto"``."""

from __future__ import annotations

import functools
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


def native_bf16() -> str | None:
    """The CPU flag that makes bf16 GEMMs native here (e.g. ``"avx512_bf16"``), or None."""
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return None
    flags = cpu_flags()
    return next((f for f in BF16_FLAGS if f in flags), None)
