"""Small helpers shared by the triton attention kernels' launchers, and their tile configs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

LOG2E = 1.4426950408889634


def check_device(kernel, t: torch.Tensor) -> None:
    """Raise if ``kernel`` cannot run on ``t``'s device."""
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



@dataclass(frozen=True)
class Tiles:
    """A kernel's launch tiles."""

    block_n: int
    num_warps: int
    num_stages: int
    block_m: int = 0

    def __post_init__(self):
        for name in ("block_n",) + (("block_m",) if self.block_m else ()):
            b = getattr(self, name)
            if b < 16 or b & (b - 1):
                raise ValueError(f"{name}={b} must be a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16) or not 1 <= self.num_stages <= 6:
            raise ValueError(f"num_warps={self.num_warps} must be 1/2/4/8/16 and "
                             f"num_stages={self.num_stages} in 1..6")
