"""Mamba2's two recurrences in plain torch, each carrying its state across calls."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. x: [n, C] new inputs; window: [C, K-1] the inputs before them; weight: [C, K];
    bias: [C] -> (y [n, C] before the activation, window after the last token [C, K-1])."""
    k = weight.shape[1]
    full = torch.cat([window.to(x.dtype), x.t()], dim=1)                       # [C, K-1+n]
    y = F.conv1d(full[None], weight[:, None, :], bias, groups=weight.shape[0])[0]  # [C, n]
    return y.t(), full[:, full.shape[1] - (k - 1):]


def causal_conv1d_step(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences. x: [B, C]; window: [B, C, K-1] -> (y [B, C], new window [B,
    C, K-1])."""
    full = torch.cat([window.to(x.dtype), x[..., None]], dim=-1)               # [B, C, K]
    y = (full * weight).sum(-1)
    if bias is not None:
        y = y + bias
    return y, full[..., 1:]


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    L = a.shape[-1]
    x = a[..., None].expand(*a.shape, L)                                        # [..., t, s] = a[t]
    below = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=-1)
    seg = x.masked_fill(~below, 0).cumsum(dim=-2)
    keep = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=0)
    return seg.masked_fill(~keep, -torch.inf)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             state: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. x: [n, H, P]; dt: [n, H] (after softplus and clamping); A: [H]; B, C: [n, H,
    N]; state: [H, P, N] before the first token -> (y [n, H, P], state after the last)."""
    ys = []
    for s in range(0, x.shape[0], chunk):
        xs, dts, Bs, Cs = x[s:s + chunk], dt[s:s + chunk], B[s:s + chunk], C[s:s + chunk]
        a = (dts * A).t()                                                       # [H, L] log-decays
        acum = a.cumsum(dim=-1)                                                 # [H, L]
        xdt = xs * dts[..., None]                                               # [L, H, P]
        decay = torch.exp(_segment_sum(a))                                      # [H, t, s]
        scores = torch.einsum("thn,shn->hts", Cs, Bs) * decay                   # [H, L, L]
        y = torch.einsum("hts,shp->thp", scores, xdt)
        y = y + torch.einsum("thn,hpn->thp", Cs, state) * torch.exp(acum).t()[..., None]
        to_end = torch.exp(acum[:, -1:] - acum)                                 # [H, L] token -> chunk end
        state = state * torch.exp(acum[:, -1])[:, None, None] \
            + torch.einsum("hs,shp,shn->hpn", to_end, xdt, Bs)
        ys.append(y)
    return torch.cat(ys), state


def ssd_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences. x: [B, H, P]; dt: [B, H]; A: [H]; B, C: [B, H, N]; state:
    [B, H, P, N] -> (y [B, H, P], new state [B, H, P, N])."""
    dA = torch.exp(dt * A)                                                      # [B, H]
    state = state * dA[..., None, None] + (x * dt[..., None])[..., None] * B[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", state, C)
    return y, state
