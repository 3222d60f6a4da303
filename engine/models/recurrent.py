"""A Mamba-style recurrent layer: gated linear attention (GLA) with a fixed-size state per request.

Per head h and token t (``dk`` key dims, ``dv`` value dims)::

    a_t = sigmoid(x_t W_a + b_a)                    [Hm, dk]   per-dimension decay in (0, 1)
    S_t = diag(a_t) S_{t-1} + k_t v_t^T             [Hm, dk, dv]
    o_t = (q_t S_t) * silu(x_t W_g)                 [Hm, dv]   (q scaled by dk ** -0.5, o RMS-normed)

followed by the output projection and, as in a Llama layer, a SwiGLU MLP. The state after a
request's last computed token is all it needs to continue: no KV grows with the sequence.

State rows live in a :class:`tandem.cache.state_pool.StatePool` (``fb.state_pool``); sequence i of
the batch reads and writes row ``fb.state_indices[i]`` (its private working row: the engine copies
a cached checkpoint into it before the forward, never the other way round). The forward is
vectorised over the batch and loops over the token index within a chunk: sequences are sorted by
extend length, so at step t the active sequences are a prefix of that order (a slice, no gather
of states).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.forward_batch import ForwardBatch
from tandem.engine.layers import rms_norm

_META_KEY = "recurrent"


def recurrent_tensor_names(i: int) -> list[str]:
    """The HF-style names of recurrent layer ``i``'s tensors (Tandem's own naming)."""
    p = f"model.layers.{i}."
    return [p + n for n in ("input_layernorm.weight", "mixer.in_proj.weight", "mixer.decay_bias",
                            "mixer.out_norm.weight", "mixer.out_proj.weight",
                            "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                            "mlp.up_proj.weight", "mlp.down_proj.weight")]


class _Schedule:
    """Per-step plan shared by every recurrent layer: for each token index t within a chunk, how
    many sequences (in extend-length order) are active and which tokens of T they own."""

    def __init__(self, fb: ForwardBatch):
        ext = fb.extend_lens_cpu
        order = sorted(range(len(ext)), key=lambda i: -ext[i])
        dev = fb.input_ids.device
        self.order = torch.tensor(order, dtype=torch.int64, device=dev)              # [B]
        starts = fb.extend_starts[self.order]                                           # [B]
        lens = [ext[i] for i in order]
        self.steps: list[tuple[int, torch.Tensor]] = []                                 # (active, tokens)
        b = len(lens)
        for t in range(lens[0] if lens else 0):
            while b and lens[b - 1] <= t:
                b -= 1
            self.steps.append((b, starts[:b] + t))
        self.uniform = all(n == 1 for n in ext)                                          # pure decode


class RecurrentLayer(nn.Module):
    """One recurrent (GLA) decoder layer. Weights are stored input-major like LlamaLayer:
    in_proj [H, Hm*(2dk + dv + dk + dv)] (q, k, v, decay logits, output gate), out_proj
    [Hm*dv, H], gate_up [H, 2I], down [I, H]."""

    def __init__(self, layer_id: int, hidden: int, heads: int, dk: int, dv: int, inter: int,
                 eps: float, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.layer_id = layer_id
        self.h, self.dk, self.dv, self.inter, self.eps = heads, dk, dv, inter, eps
        p = lambda t: nn.Parameter(t.contiguous(), requires_grad=False)  # noqa: E731
        self.input_norm = p(tensors["input_norm"])
        self.in_proj = p(tensors["in_proj"])
        self.decay_bias = p(tensors["decay_bias"])            # [Hm * dk]
        self.out_norm = p(tensors["out_norm"])                # [dv]
        self.out_proj = p(tensors["out_proj"])
        self.post_norm = p(tensors["post_norm"])
        self.gate_up = p(tensors["gate_up"])
        self.down = p(tensors["down"])

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.h, self.dk, self.dv)

    def forward(self, x: torch.Tensor, cos, sin, fb: ForwardBatch, backend) -> torch.Tensor:
        # x: [T, H] residual stream (cos, sin, backend: unused; same signature as LlamaLayer)
        T = x.shape[0]
        hm, dk, dv = self.h, self.dk, self.dv
        h = rms_norm(x, self.input_norm, self.eps)
        proj = (h @ self.in_proj).float()                                   # [T, Hm*(3dk + 2dv)]
        q, k, v, a, g = torch.split(proj, [hm * dk, hm * dk, hm * dv, hm * dk, hm * dv], dim=1)
        q = q.view(T, hm, dk) * dk ** -0.5                                  # [T, Hm, dk]
        k = k.view(T, hm, dk)
        v = v.view(T, hm, dv)
        a = torch.sigmoid(a + self.decay_bias.float()).view(T, hm, dk)     # [T, Hm, dk]
        o = self._scan(q, k, v, a, fb)                                      # [T, Hm, dv]
        o = rms_norm(o, self.out_norm.float(), self.eps) * F.silu(g.view(T, hm, dv))
        x = torch.addmm(x, o.reshape(T, hm * dv).to(x.dtype), self.out_proj)
        h = rms_norm(x, self.post_norm, self.eps)
        gu = h @ self.gate_up                                               # [T, 2I]
        act = F.silu(gu[:, : self.inter]) * gu[:, self.inter:]              # [T, I]
        return torch.addmm(x, act, self.down)

    def _scan(self, q, k, v, a, fb: ForwardBatch) -> torch.Tensor:
        """The recurrence over each sequence's new tokens, starting from (and updating) its state
        row. q, k, a: [T, Hm, dk]; v: [T, Hm, dv] -> o: [T, Hm, dv] (float32)."""
        if fb.state_indices is None or fb.state_pool is None:
            raise ValueError(f"recurrent layer {self.layer_id}: the batch has no state_indices/state_pool")
        sched = fb.attn_meta.get(_META_KEY)
        if sched is None:
            sched = fb.attn_meta[_META_KEY] = _Schedule(fb)
        pool = fb.state_pool.layer(self.layer_id)                           # [rows, Hm, dk, dv]
        rows = fb.state_indices[sched.order]                                # [B] in schedule order
        S = pool[rows].float()                                              # [B, Hm, dk, dv]
        o = torch.empty_like(v)
        for b, tok in sched.steps:
            kv = k[tok].unsqueeze(-1) * v[tok].unsqueeze(-2)                # [b, Hm, dk, dv]
            S_b = a[tok].unsqueeze(-1) * S[:b] + kv                         # [b, Hm, dk, dv]
            S[:b] = S_b
            o[tok] = (q[tok].unsqueeze(-1) * S_b).sum(-2)                   # [b, Hm, dv]
        pool[rows] = S.to(pool.dtype)
        return o
