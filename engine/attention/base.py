"""The attention backend interface used by every model layer."""

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
    sliding_window: int | None = None


class AttentionBackend(Protocol):
    def init_forward(self, fb: ForwardBatch) -> None:
        """Precompute per-step metadata into ``fb.attn_meta`` (called once per step)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                fb: ForwardBatch) -> torch.Tensor:
        """q: [T, H_q, D]; k, v: [T, H_kv, D] -> o: [T, H_q, D]."""
