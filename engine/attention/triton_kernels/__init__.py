"""Triton kernels of the triton attention backend (see ../triton_backend.py)."""

from tandem.engine.attention.triton_kernels.common import Tiles
from tandem.engine.attention.triton_kernels.decode import decode_attention
from tandem.engine.attention.triton_kernels.extend import extend_attention
from tandem.engine.attention.triton_kernels.store import _store_kv_kernel, store_kv

INTERPRETED: bool = type(_store_kv_kernel).__name__ == "InterpretedFunction"

__all__ = ["INTERPRETED", "Tiles", "decode_attention", "extend_attention", "store_kv"]
