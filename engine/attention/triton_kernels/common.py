"""Small helpers shared by the triton attention kernels' launchers."""

from __future__ import annotations

import torch
import triton

LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x) == exp2(x * LOG2E)


def check_device(kernel, t: torch.Tensor) -> None:
    """Raise if ``kernel`` cannot run on ``t``'s device.

    Triton's interpret mode is process-wide and fixed when triton is first imported
    (``TRITON_INTERPRET=1``): then kernels run in numpy on any tensors (CUDA ones are copied to
    the host and back); otherwise they compile and need CUDA tensors.
    """
    if t.is_cuda or type(kernel).__name__ == "InterpretedFunction":
        return
    raise ValueError(
        f"triton kernel {kernel.fn.__name__} is compiled for CUDA but got {t.device} tensors; "
        "set TRITON_INTERPRET=1 before triton is first imported to run it on the CPU")


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 dots (no TF32 rounding); bf16/fp16 use the tensor cores as is."""
    return "ieee" if dtype == torch.float32 else "tf32"


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device; (0, 0) for the CPU (interpreter)."""
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


def block_d(head_dim: int) -> int:
    return triton.next_power_of_2(head_dim)

