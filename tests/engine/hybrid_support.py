"""Helpers for the hybrid-model tests: a dense, cache-free greedy oracle and multi-turn sessions.

The oracle recomputes the whole sequence for every token with no pools at all: attention is one
masked SDPA over all positions (causal, and windowed for "swa" layers), the recurrent layers start
from a zero state. Nothing of the engine's paging, ``index_map``, window release or state copies
is involved, so engine output == oracle output checks all of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.core.types import SamplingParams
from tandem.engine.forward_batch import ForwardBatch
from tandem.cache.state_pool import StatePool


class DenseBackend:
    """One sequence, every position computed in one forward: no KV pool."""

    def init_forward(self, fb) -> None:
        pass

    def forward(self, q, k, v, spec, fb):
        T = q.shape[0]
        pos = torch.arange(T)
        mask = pos[None, :] <= pos[:, None]                                  # [T, T]
        if spec.sliding_window is not None:
            mask &= pos[None, :] > pos[:, None] - spec.sliding_window
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=spec.scale,
                                           enable_gqa=spec.num_q_heads != spec.num_kv_heads)
        return o.transpose(0, 1)


def dense_greedy(loaded, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids``, recomputing everything for each one."""
    model = loaded.model
    ids = list(ids)
    out = []
    for _ in range(n):
        T = len(ids)
        pool = StatePool(1, model.recurrent_layers, model.state_shape) \
            if getattr(model, "state_shape", None) else None
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        fb = ForwardBatch(
            input_ids=t(ids), positions=torch.arange(T), out_cache_loc=torch.zeros(T, dtype=torch.int64),
            req_pool_indices=t([0]), seq_lens=t([T]), prefix_lens=t([0]), extend_lens=t([T]),
            extend_starts=t([0]), req_to_token=None, kv_pool=None, seq_lens_cpu=[T],
            prefix_lens_cpu=[0], extend_lens_cpu=[T], state_indices=t([1]), state_pool=pool)
        tok = int(model.forward(fb, DenseBackend())[0].argmax())
        out.append(tok)
        ids.append(tok)
    return out


def session_prompts(n_sessions: int) -> list[list[int]]:
    """A shared system prefix, then a per-session part (byte token ids)."""
    shared = list(b"You are a tiny hybrid model. Be brief. ")
    return [shared + list(f"[session {s}] ".encode()) for s in range(n_sessions)]


def run_sessions(engine, n_sessions: int = 3, turns: int = 3, max_tokens: int = 8):
    """Sessions interleave turn by turn; each turn's prompt is the previous prompt + its output
    + a new user message. Returns per session: [(prompt ids, output ids, cached tokens)]."""
    history = session_prompts(n_sessions)
    out = [[] for _ in range(n_sessions)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for turn in range(turns):
        reqs = []
        for s in range(n_sessions):
            history[s] = history[s] + list(f"<user> question {turn} of {s}? <bot>".encode())
            reqs.append(engine.make_request(history[s], params, session_id=f"s{s}"))
        for s, c in enumerate(engine.generate_many(reqs, timeout=300)):
            assert c.error is None, c.error
            out[s].append((list(history[s]), c.token_ids, c.cached_tokens))
            history[s] = history[s] + c.token_ids
    return out


def check_index_map(engine) -> int:
    """Every tree node holding SWA rows is reachable through ``index_map[its full slots]`` (the
    engine writes the map at allocation, the cache's SWA component when the tree adopts rows).
    Returns how many tokens were checked."""
    radix = engine.kv.cache
    i = radix._aux_index["swa"]
    imap = engine.hybrid.index_map
    checked, stack = 0, [radix._tree.root]
    while stack:
        nd = stack.pop()
        stack.extend(nd.children.values())
        rows = nd.aux[i] if nd.aux is not None else None
        if rows is not None and nd.value is not None and len(nd.key):
            assert torch.equal(imap[nd.value], rows), f"{nd}: index_map disagrees with its SWA rows"
            checked += len(rows)
    return checked
