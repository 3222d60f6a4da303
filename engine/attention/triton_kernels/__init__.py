"""Triton kernels of the triton attention backend (see ../triton_backend.py).

decode.py  split-KV (flash-decoding) attention of one query token per sequence
extend.py  attention of a chunk of new tokens over the cached prefix plus themselves (causal)
store.py   writes new tokens' K/V into the pool at their slots
common.py  ``Tiles`` (block sizes, warps, stages: each launcher takes one; defaults per GPU)

Every kernel reads a sequence's KV slots through ``req_to_token`` one token at a time, so it is
page-size agnostic, and takes an optional ``index_map`` (full-pool slot -> pool row).
Kernels follow triton's process-wide mode: compiled (CUDA tensors), or run by its numpy
interpreter when TRITON_INTERPRET=1 was set before triton was first imported (tests).
"""

from tandem.engine.attention.triton_kernels.common import Tiles
from tandem.engine.attention.triton_kernels.decode import decode_attention
from tandem.engine.attention.triton_kernels.extend import extend_attention
from tandem.engine.attention.triton_kernels.store import _store_kv_kernel, store_kv

# True when the kernels run in triton's interpreter (TRITON_INTERPRET=1 at first triton import).
INTERPRETED: bool = type(_store_kv_kernel).__name__ == "InterpretedFunction"

__all__ = ["INTERPRETED", "Tiles", "decode_attention", "extend_attention", "store_kv"]
