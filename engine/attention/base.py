"""The attention backend interface used by every model layer.

Contract of :meth:`AttentionBackend.forward` for one layer of one step:
1. write the new tokens' K/V into the layer's pool at ``fb.out_cache_loc`` (through
   ``LayerKV.index_map`` when the layer's pool has one);
2. for each sequence i, attend its new queries (positions ``prefix_lens[i] ..  seq_lens[i]-1``)
   over keys at positions ``0 .. seq_lens[i]-1`` read through
   ``fb.req_to_token[fb.req_pool_indices[i]]``, causally (query at position p sees keys <= p);
   with ``spec.sliding_window = W`` a query at p sees only keys at positions > p - W;
3. return ``o: [T, H_q, D]``. Grouped-query attention: query head h reads KV head
   ``h // (H_q // H_kv)``. ``spec.scale`` multiplies q.k (default ``D ** -0.5``).
The backend never allocates or frees slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.engine.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttnSpec:
    layer_id: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # None: full attention


class AttentionBackend(Protocol):
    def init_forward(self, fb: ForwardBatch) -> None:
        """Precompute per-step metadata into ``fb.attn_meta`` (called once per step)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                fb: ForwardBatch) -> torch.Tensor:
        """q: [T, H_q, D]; k, v: [T, H_kv, D] -> o: [T, H_q, D]."""
