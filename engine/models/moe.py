"""A top-k softmax mixture of experts in plain torch (Granite-4.0-H's ``block_sparse_moe``)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def topk_moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
             top_k: int, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x: [T, H]; router: [E, H]; gate_up: [E, 2I, H]; down: [E, H, I] -> [T, H] in x's dtype."""
    logits = F.linear(x, router).float()                                    # [T, E]
    top_v, top_i = logits.topk(top_k, dim=-1)                               # [T, k]
    weights = torch.softmax(top_v, dim=-1).to(x.dtype)                      # [T, k]
    out = torch.zeros_like(x)
    inter = down.shape[-1]
    for e in torch.unique(top_i).tolist():
        tok, slot = torch.where(top_i == e)
        gu = F.linear(x[tok], gate_up[e])                                   # [t, 2I]
        h = F.linear(act(gu[:, :inter]) * gu[:, inter:], down[e])           # [t, H]
        out.index_add_(0, tok, h * weights[tok, slot, None])
    return out
