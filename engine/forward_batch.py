"""ForwardBatch: the device-side plan of one model step, built in exactly one place
(engine/batch_builder.py) from the scheduler's CPU-side plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor          # [T] int64
    positions: torch.Tensor          # [T] int64
    out_cache_loc: torch.Tensor      # [T] int64
    req_pool_indices: torch.Tensor   # [B] int64
    seq_lens: torch.Tensor           # [B] int64, prefix + extend
    prefix_lens: torch.Tensor        # [B] int64
    extend_lens: torch.Tensor        # [B] int64
    extend_starts: torch.Tensor      # [B] int64, offset of each sequence's first new token in T
    req_to_token: torch.Tensor       # [R + 1, max_context] int32
    kv_pool: Any
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    state_indices: torch.Tensor | None = None  # [B] int64
    state_pool: Any = None
    attn_meta: dict = field(default_factory=dict)
    logit_rows: torch.Tensor | None = None    # [R] int64 indices into T whose logits are returned
                                              # (a verify step's draft positions); None: the last ones

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token (the decode kernels apply)."""
        return all(n == 1 for n in self.extend_lens_cpu)

    @property
    def last_token_indices(self) -> torch.Tensor:
        """[B] index into T of each sequence's last new token (whose logits are sampled)."""
        return self.extend_starts + self.extend_lens - 1

    @property
    def logit_indices(self) -> torch.Tensor:
        """[R] indices into T of the rows whose logits the forward returns (``logit_rows``, else
        :attr:`last_token_indices`)."""
        return self.last_token_indices if self.logit_rows is None else self.logit_rows
