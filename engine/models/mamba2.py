"""The Mamba2 mixer over a ForwardBatch, with its state in the engine's state pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.forward_batch import ForwardBatch
from tandem.engine.models.norms import gated_group_rms_norm
from tandem.engine.models.ssd import causal_conv1d, causal_conv1d_step, ssd_scan, ssd_step
from tandem.engine.models.state_layout import StateLayout

_META_KEY = "mamba2"


@dataclass(frozen=True)
class Mamba2Dims:
    """Shape of a Mamba2 mixer (transformers' ``mamba_*`` config fields)."""

    hidden: int
    n_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    d_conv: int
    chunk_size: int
    eps: float
    time_step_min: float = 0.0
    time_step_max: float = float("inf")

    @property
    def inner(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.n_groups * self.d_state

    @property
    def layout(self) -> StateLayout:
        return StateLayout({"conv": (self.conv_dim, self.d_conv - 1),
                            "ssm": (self.n_heads, self.head_dim, self.d_state)})


def mamba2_tensors(prefix: str, get, cvt, f32, bias: bool, conv_bias: bool) -> dict:
    """The mixer's tensors under ``prefix`` (e.g."""
    return {
        "in_proj": cvt(get(prefix + "in_proj.weight")),                          # [I+C+H, hidden]
        "in_bias": cvt(get(prefix + "in_proj.bias")) if bias else None,
        "conv_w": f32(get(prefix + "conv1d.weight")[:, 0, :]),                   # [C, K]
        "conv_b": f32(get(prefix + "conv1d.bias")) if conv_bias else None,       # [C]
        "dt_bias": f32(get(prefix + "dt_bias")), "A_log": f32(get(prefix + "A_log")),  # [H]
        "D": f32(get(prefix + "D")),                                             # [H]
        "norm": f32(get(prefix + "norm.weight")),                                # [I]
        "out_proj": cvt(get(prefix + "out_proj.weight")),                        # [hidden, I]
        "out_bias": cvt(get(prefix + "out_proj.bias")) if bias else None,
    }


class _Plan:
    """Per step, shared by every Mamba2 layer: the decode rows (batched) and the extend rows."""

    def __init__(self, fb: ForwardBatch):
        ext = fb.extend_lens_cpu
        starts, acc = [], 0
        for n in ext:
            starts.append(acc)
            acc += n
        dev = fb.input_ids.device
        dec = [i for i, n in enumerate(ext) if n == 1]
        self.all_decode = len(dec) == len(ext)
        self.dec = torch.tensor(dec, dtype=torch.int64, device=dev)             # [Bd] batch index
        self.dec_tok = torch.tensor([starts[i] for i in dec], dtype=torch.int64, device=dev)
        self.extends = [(i, starts[i], n) for i, n in enumerate(ext) if n > 1]


class Mamba2Mixer(nn.Module):
    """One Mamba2 mixer: ``forward(h [T, hidden], fb) -> [T, hidden]`` (no residual)."""

    def __init__(self, layer_id: int, dims: Mamba2Dims, tensors: dict):
        super().__init__()
        self.layer_id, self.dims, self.layout = layer_id, dims, dims.layout
        for name, t in tensors.items():
            self.register_buffer(name, None if t is None else t.contiguous())
        self.register_buffer("A", -torch.exp(self.A_log))                        # [H] float32

    @property
    def state_shape(self) -> tuple[int]:
        return (self.layout.numel,)

    def forward(self, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        d = self.dims
        if fb.state_indices is None or fb.state_pool is None:
            raise ValueError(f"mamba2 layer {self.layer_id}: the batch has no state_indices/state_pool")
        plan = fb.attn_meta.get(_META_KEY)
        if plan is None:
            plan = fb.attn_meta[_META_KEY] = _Plan(fb)
        zxbcdt = F.linear(h, self.in_proj, self.in_bias)                         # [T, I + C + H]
        z, xbc, dt = zxbcdt.split([d.inner, d.conv_dim, d.n_heads], dim=-1)
        xbc, dt = xbc.float(), dt.float()
        pool = fb.state_pool.layer(self.layer_id)                                # [rows, numel]
        rows = pool[fb.state_indices].float()                                    # [B, numel] copy
        conv = self.layout.view(rows, "conv")                                    # [B, C, K-1]
        ssm = self.layout.view(rows, "ssm")                                      # [B, H, P, N]
        y = torch.empty(h.shape[0], d.n_heads, d.head_dim, dtype=torch.float32, device=h.device)
        if len(plan.dec):
            tok = slice(None) if plan.all_decode else plan.dec_tok
            xc, conv_new = causal_conv1d_step(xbc[tok], conv[plan.dec], self.conv_w, self.conv_b)
            x, dts, B, C = self._ssm_inputs(F.silu(xc), dt[tok])
            yd, ssm_new = ssd_step(x, dts, self.A, B, C, ssm[plan.dec])
            y[tok] = yd + self.D[:, None] * x
            conv[plan.dec] = conv_new
            ssm[plan.dec] = ssm_new
        for i, s, n in plan.extends:
            xc, conv_new = causal_conv1d(xbc[s:s + n], conv[i], self.conv_w, self.conv_b)
            x, dts, B, C = self._ssm_inputs(F.silu(xc), dt[s:s + n])
            ye, ssm_new = ssd_scan(x, dts, self.A, B, C, ssm[i], d.chunk_size)
            y[s:s + n] = ye + self.D[:, None] * x
            conv[i] = conv_new
            ssm[i] = ssm_new
        pool[fb.state_indices] = rows.to(pool.dtype)
        o = gated_group_rms_norm(y.view(-1, d.inner), z, self.norm, d.inner // d.n_groups, d.eps)
        return F.linear(o.to(h.dtype), self.out_proj, self.out_bias)              # [T, hidden]

    def _ssm_inputs(self, xc: torch.Tensor, dt: torch.Tensor):
        d = self.dims
        n, gn = xc.shape[0], d.n_groups * d.d_state
        x, B, C = xc.split([d.inner, gn, gn], dim=-1)
        rep = d.n_heads // d.n_groups
        B = B.reshape(n, d.n_groups, d.d_state).repeat_interleave(rep, dim=1)
        C = C.reshape(n, d.n_groups, d.d_state).repeat_interleave(rep, dim=1)
        dt = F.softplus(dt + self.dt_bias).clamp(d.time_step_min, d.time_step_max)
        return x.reshape(n, d.n_heads, d.head_dim), dt, B, C
