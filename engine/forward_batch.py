"""ForwardBatch: the device-side plan of one model step, built in exactly one place
(engine/batch_builder.py) from the scheduler's CPU-side plan.

A step runs B sequences. Sequence i already has ``prefix_lens[i]`` tokens of KV in the pool
(cached prefix + earlier chunks + earlier decode steps) and adds ``extend_lens[i]`` new tokens
(a prompt chunk, or exactly 1 for a decode step). Its new tokens are positions
``prefix_lens[i] .. seq_lens[i]-1`` and their K/V go to ``out_cache_loc``. Decode sequences are
just extends of length 1, so a step may mix prefill chunks and decodes.

Token-major tensors are laid out sequence by sequence:

    T = sum(extend_lens)
    input_ids      [T]   token ids
    positions      [T]   absolute positions (rotary)
    out_cache_loc  [T]   KV slots of the new tokens (int64)

    seq 0 new tokens | seq 1 new tokens | ... | seq B-1 new tokens
    ^ extend_starts[0]  ^ extend_starts[1]

All index tensors live on the model's device; the ``*_cpu`` lists mirror them for Python loops.
``req_to_token[req_pool_indices[i], :seq_lens[i]]`` holds every slot of sequence i, including the
new ones (the batch builder writes them before the forward).
"""

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
    kv_pool: Any                     # cache.kv_pool.KVPool (or a hybrid pool with .layer(id))
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    # Recurrent (Mamba-style) state rows of each sequence, for hybrid models; None otherwise.
    state_indices: torch.Tensor | None = None  # [B] int64
    state_pool: Any = None
    # Per-batch metadata an attention backend precomputes in init_forward (opaque to others).
    attn_meta: dict = field(default_factory=dict)

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
