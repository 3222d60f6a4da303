"""Paged attention backends: cpu_kernel (CPU, one C call per layer; the CPU default where the
AVX512 kernels build), torch (CPU fallback), triton (GPU; CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch

BACKENDS = ("auto", "cpu_kernel", "torch", "triton")


def make_attention_backend(name: str, device: torch.device):
    """The backend called ``name`` (``BACKENDS``); 'auto': triton on CUDA, else cpu_kernel where the
    AVX512 kernels run here, else torch."""
    if name == "auto":
        if torch.device(device).type == "cuda":
            name = "triton"
        else:
            from tandem.engine.attention.cpu_backend import cpu_kernel_unavailable
            name = "cpu_kernel" if cpu_kernel_unavailable() is None else "torch"
    if name == "triton":
        from tandem.engine.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    if name == "cpu_kernel":
        from tandem.engine.attention.cpu_backend import CpuKernelAttentionBackend
        return CpuKernelAttentionBackend()
    if name != "torch":
        raise ValueError(f"attention backend {name!r} is not one of {', '.join(BACKENDS)}")
    from tandem.engine.attention.torch_backend import TorchAttentionBackend
    return TorchAttentionBackend()
