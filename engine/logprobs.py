"""Log-probabilities of sampled tokens, from the logits the sampler drew from."""

from __future__ import annotations

import torch

from tandem.core.types import TokenLogprob


def token_logprobs(logits: torch.Tensor, tokens: list[int], tops: list[int]) -> list[TokenLogprob]:
    """``logits`` [R, V] float (the rows that asked), ``tokens[r]`` the token sampled for row r,
    ``tops[r]`` how many alternatives row r wants (0..20)."""
    lp = torch.log_softmax(logits.float(), dim=-1)                         # [R, V]
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device).unsqueeze(1))
    chosen = chosen.squeeze(1).tolist()                                    # [R]
    k = max(tops, default=0)
    top_vals = top_ids = None
    if k:
        vals, ids = torch.topk(lp, min(k, lp.shape[1]), dim=-1)            # [R, k], sorted
        top_vals, top_ids = vals.tolist(), ids.tolist()
    out = []
    for r, (tok, value) in enumerate(zip(tokens, chosen)):
        top: tuple[tuple[int, float], ...] = ()
        if tops[r]:
            top = tuple((i, v) for i, v in zip(top_ids[r][:tops[r]], top_vals[r][:tops[r]])
                        if v != float("-inf"))
        out.append(TokenLogprob(int(tok), float(value), top))
    return out


def wants_prompt_logprobs(entries) -> bool:
    """Whether a step's plan entries (engine/sched/sched_types.py PlanEntry) hold prompt positions whose
    logprobs a request still needs: the step must then keep every position's logits."""
    return any(_needs_prompt(e) for e in entries)


def _needs_prompt(e) -> bool:
    r = e.sr.req
    return (r.params.prompt_logprobs is not None and not r.output_ids
            and len(e.sr.prompt_logprobs) < len(r.prompt_ids) - 1)


def take_prompt_logprobs(entries, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` [T, V] of the step's ``entries``: appends each asking request's new prompt
    logprobs (never one twice); returns the [B, V] rows of each entry's last position."""
    last, start = [], 0
    for e in entries:
        end = start + e.n
        last.append(end - 1)
        if _needs_prompt(e):
            _append_prompt(e.sr, logits[start:end], e.start)
        start = end
    return logits[last]


def _append_prompt(sr, rows: torch.Tensor, first_pos: int) -> None:
    ids, have = sr.req.prompt_ids, sr.prompt_logprobs
    lo = len(have) - first_pos
    hi = min(rows.shape[0], len(ids) - 1 - first_pos)
    if lo < 0 or lo >= hi:
        return
    targets = ids[first_pos + lo + 1:first_pos + hi + 1]
    have.extend(ranked_logprobs(rows[lo:hi], targets, sr.req.params.prompt_logprobs))


def ranked_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """``logits`` [R, V] -> one TokenLogprob per row for ``tokens[r]``: its logprob (log_softmax in
    float32), its ``rank`` (1 + the number of tokens strictly more likely) and the ``k`` most likely
    alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)                          # [R, V]
    idx = torch.tensor(tokens, dtype=torch.long, device=lp.device).unsqueeze(1)
    chosen = lp.gather(1, idx)                                              # [R, 1]
    ranks = (torch.sum(lp > chosen, dim=1, dtype=torch.int32) + 1).tolist()  # [R]
    chosen = chosen.squeeze(1).tolist()
    top_vals = top_ids = None
    if k:
        vals, ids = torch.topk(lp, min(k, lp.shape[1]), dim=-1)             # [R, k], sorted
        top_vals, top_ids = vals.tolist(), ids.tolist()
    return [TokenLogprob(int(t), float(v), tuple(zip(top_ids[r], top_vals[r])) if k else (), int(ranks[r]))
            for r, (t, v) in enumerate(zip(tokens, chosen))]
