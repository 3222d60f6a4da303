"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds, min_tokens.

``sample(logits [B, V], reqs) -> list[int]``. Greedy rows take ``argmax``. Sampled rows use a
per-request ``torch.Generator`` seeded from ``params.seed`` (so a seeded request is reproducible
whatever it is batched with); unseeded requests draw from the engine's generator.
"""

from __future__ import annotations

import torch

from tandem.core.types import Req


class Sampler:
    def __init__(self, seed: int = 0):
        self._gen = torch.Generator().manual_seed(seed)
        self._req_gens: dict[str, torch.Generator] = {}

    def forget(self, rid: str) -> None:
        self._req_gens.pop(rid, None)

    def _generator(self, req: Req) -> torch.Generator:
        if req.params.seed is None:
            return self._gen
        g = self._req_gens.get(req.rid)
        if g is None:
            g = self._req_gens[req.rid] = torch.Generator().manual_seed(req.params.seed)
        return g

    def sample(self, logits: torch.Tensor, reqs: list[Req], eos_ids: frozenset[int]) -> list[int]:
        """logits: [B, V] float -> one token id per request (row i belongs to reqs[i])."""
        logits = logits.float()
        owned = False  # logits may be the model's (inference-mode) output: copy before editing
        for i, r in enumerate(reqs):  # min_tokens: forbid finishing tokens early
            if len(r.output_ids) < r.params.min_tokens:
                banned = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(eos_ids))
                if banned:
                    if not owned:
                        logits, owned = logits.clone(), True
                    logits[i, list(banned)] = float("-inf")
        if all(r.params.greedy for r in reqs):
            return logits.argmax(dim=-1).tolist()
        # the per-request generators are CPU ones (same draws on any device): sample on the host
        logits = logits.cpu()
        out: list[int] = []
        for i, r in enumerate(reqs):
            row = logits[i]
            p = r.params
            if p.greedy:
                out.append(int(row.argmax()))
                continue
            row = row / p.temperature
            if p.top_k > 0 and p.top_k < row.shape[-1]:
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, dim=-1)
            if p.top_p < 1.0:
                sp, si = torch.sort(probs, descending=True)
                cum = torch.cumsum(sp, dim=-1)
                drop = (cum - sp) > p.top_p  # keep the smallest set whose mass reaches top_p
                sp[drop] = 0.0
                probs = torch.zeros_like(probs).scatter_(0, si, sp)
            out.append(int(torch.multinomial(probs, 1, generator=self._generator(r))))
        return out
