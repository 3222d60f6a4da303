"""Batched sampling: grammar bitmask, min_tokens bans, greedy / temperature / top-k / top-p,
per-request seeds, logprobs."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from tandem.core.types import TokenLogprob
from tandem.engine.grammar import add_bias, bitmask_bias
from tandem.engine.logprobs import token_logprobs


@dataclass
class Sampled:
    """``tokens[i]``: the token for row i (None: its grammar allowed nothing)."""

    tokens: list[int | None]
    logprobs: list[TokenLogprob | None] | None = None


@dataclass
class Masks:
    """The grammar masks of one batch: ``words[i]`` ([W] int32 bitmask) and ``bias[i]`` ([32W]
    float32, 0 / -inf; CPU) for row ``rows[i]``; ``dead``: rows whose grammar allows no token."""

    rows: list[int]
    words: torch.Tensor
    bias: torch.Tensor
    dead: set[int]


_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


def draw_seed(seed: int, step: int) -> int:
    """The generator seed of a seeded request's ``step``-th output token (0-based), in
    [0, 2**63)."""
    return _mix64(_mix64(seed & _M64) ^ (step + 1)) >> 1


def greedy(logits: torch.Tensor) -> list[int]:
    """logits [B, V] -> each row's argmax: the first maximal index, a NaN counting as the maximum
    (torch's and numpy's rule alike)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


class Sampler:
    def __init__(self, seed: int = 0, grammar: Callable[[], object] | None = None):
        """``grammar``: returns the engine's GrammarCompiler (called only for batches with a
        constrained row; it fills the bitmask)."""
        self._gen = torch.Generator().manual_seed(seed)
        self._seeded = torch.Generator()
        self._grammar = grammar
        self._pool: ThreadPoolExecutor | None = None

    def prepare(self, srs: list, drafts: dict | None = None) -> "Future[Masks] | None":
        """Start computing the grammar masks of the batch ``srs`` (the rows ``sample`` will get) on
        the helper thread; None when no row is constrained. ``drafts``: a verify step's drafts by
        SchedReq id (engine/sched/spec/): that request's rows are consecutive, one per draft position,
        and row j's mask is the grammar's after the draft's first j tokens."""
        constrained = [(sr.matcher, i) for i, sr in enumerate(srs) if sr.matcher is not None]
        if not constrained:
            return None
        drafts = drafts or {}
        along = [(sr.matcher, drafts[id(sr)], i) for i, sr in enumerate(srs)        # each first row
                 if sr.matcher is not None and drafts.get(id(sr)) and (i == 0 or srs[i - 1] is not sr)]
        drafted = {i + j for _, d, i in along for j in range(len(d) + 1)}
        rest = [(m, i) for m, i in constrained if i not in drafted]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        return self._pool.submit(self._masks, constrained, len(srs), rest, along)

    def _masks(self, constrained: list, batch: int, rest: list | None = None, along=()) -> Masks:
        grammar = self._grammar()
        bitmask = grammar.allocate_bitmask(batch)                      # [B, W] int32, all allowed
        grammar.fill_bitmasks(constrained if rest is None else rest, bitmask)
        for m, draft, first in along:
            m.fill_along(draft, bitmask, list(range(first, first + len(draft) + 1)))
        rows = [i for _, i in constrained]
        words = bitmask[rows]                                          # [R, W]
        alive = (words != 0).any(dim=1).tolist()
        return Masks(rows, words, bitmask_bias(words), {i for i, ok in zip(rows, alive) if not ok})

    def close(self) -> None:
        """Stop the helper thread (a later ``prepare`` starts a new one)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def _generator(self, req, offset: int = 0) -> torch.Generator:
        if req.params.seed is None:
            return self._gen
        return self._seeded.manual_seed(draw_seed(req.params.seed, len(req.output_ids) + offset))

    def sample(self, logits: torch.Tensor, srs: list, eos_ids: frozenset[int],
               masks: "Future[Masks] | None" = None, offsets: list[int] | None = None) -> Sampled:
        """logits: [B, V] float -> Sampled (row i belongs to srs[i]); ``masks``: what
        :meth:`prepare` returned for these ``srs`` (computed here when None); ``offsets[i]``: row i
        picks output token ``len(output_ids) + offsets[i]`` (a verify step's draft positions: the
        min_tokens bans and a seeded draw are those of that token; default 0)."""
        logits = logits.float()
        offsets = offsets or [0] * len(srs)
        reqs = [sr.req for sr in srs]
        constrained = [(sr.matcher, i) for i, sr in enumerate(srs) if sr.matcher is not None]
        owned = False
        dead: set[int] = set()
        if constrained:
            m = masks.result() if masks is not None else self._masks(constrained, len(srs))
            if m.rows != [i for _, i in constrained]:
                raise ValueError(f"masks were prepared for rows {m.rows}, the batch constrains "
                                 f"{[i for _, i in constrained]}")
            logits, owned = logits.clone(), True
            bias = m.bias if logits.device.type == "cpu" else bitmask_bias(m.words.to(logits.device))
            add_bias(logits, bias, m.rows)
            dead = m.dead
        masked = {i for _, i in constrained}
        for i, r in enumerate(reqs):
            if len(r.output_ids) + offsets[i] < r.params.min_tokens:
                banned = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(eos_ids))
                if banned:
                    if not owned:
                        logits, owned = logits.clone(), True
                    if i in masked:
                        ban = list(banned)
                        rest = logits[i].clone()
                        rest[ban] = float("-inf")
                        if not torch.isfinite(rest).any():
                            continue
                    logits[i, list(banned)] = float("-inf")
        for i in dead:
            logits[i] = 0.0
        if all(r.params.greedy for r in reqs):
            tokens: list[int | None] = greedy(logits)
        else:
            host = logits.cpu()
            tokens = [self._one(host[i], r, offsets[i]) for i, r in enumerate(reqs)]
        lps = None
        asked = [i for i, r in enumerate(reqs) if r.params.logprobs and i not in dead]
        if asked:
            rows = logits if len(asked) == len(reqs) else logits[asked]
            got = token_logprobs(rows, [tokens[i] for i in asked],
                                 [reqs[i].params.top_logprobs for i in asked])
            lps = [None] * len(reqs)
            for i, lp in zip(asked, got):
                lps[i] = lp
        for i in dead:
            tokens[i] = None
        return Sampled(tokens, lps)

    def _one(self, row: torch.Tensor, r, offset: int = 0) -> int:
        p = r.params
        if p.greedy:
            return greedy(row[None])[0]
        row = row / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sp, si = torch.sort(probs, descending=True)
            cum = torch.cumsum(sp, dim=-1)
            drop = (cum - sp) > p.top_p
            sp[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, si, sp)
        return int(torch.multinomial(probs, 1, generator=self._generator(r, offset)))
