"""Log-probabilities of sampled tokens, from the logits the sampler drew from.

Definition (what ``StreamChunk.logprobs`` reports, and what the tests check): for each row,
``log_softmax`` in float32 of the model's logits **after** the constraint's bitmask and the
``min_tokens`` bans (forbidden tokens are ``-inf``: the distribution the request may draw from) and
**before** temperature, top-k and top-p. This is vLLM's default (``raw_logprobs`` of the logits the
sampler receives, the grammar bitmask already applied) and what OpenAI documents ("the log
probability of this token"); it does not depend on the sampling settings, so a greedy token is
always ``top[0]`` and a sampled one need not be. ``top`` lists at most ``k`` alternatives, most
likely first, and leaves out forbidden (``-inf``) tokens, so a constrained row may have fewer.
"""

from __future__ import annotations

import torch

from tandem.core.types import TokenLogprob


def token_logprobs(logits: torch.Tensor, tokens: list[int], tops: list[int]) -> list[TokenLogprob]:
    """``logits`` [R, V] float (the rows that asked), ``tokens[r]`` the token sampled for row r,
    ``tops[r]`` how many alternatives row r wants (0..20). One TokenLogprob per row."""
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
