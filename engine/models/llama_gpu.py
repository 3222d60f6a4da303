"""The Llama family's GPU path: a decoder layer in 9 launches (10 with a split decode attention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.attention.triton_kernels.layer_ops import add_rmsnorm, rope_store
from tandem.engine.attention.triton_kernels.layer_ops import silu_mul as _silu_mul
from tandem.engine.forward_batch import ForwardBatch


def applies(model, backend) -> bool:
    """Whether ``model`` (a LlamaForCausalLM) runs its GPU path with ``backend``."""
    return callable(getattr(backend, "attend", None)) and all(
        layer.qk_norm is None for layer in model.layers)


def forward(model, fb: ForwardBatch, backend, return_all_logits: bool = False) -> torch.Tensor:
    """Logits [B, V] (or [T, V]) as ``LlamaForCausalLM.forward`` computes them."""
    res = F.embedding(fb.input_ids, model.embed)                     # [T, H] residual stream
    eps = model.arch.rms_norm_eps
    delta = None
    for layer in model.layers:
        delta = _layer(layer, res, delta, fb, backend, model.rotary, eps)
    if not return_all_logits and (fb.logit_rows is not None or res.shape[0] != fb.batch_size):
        idx = fb.logit_indices
        res, delta = res[idx], delta[idx]                             # [B, H]
    x = add_rmsnorm(delta, res, model.norm, eps)
    if model.head is not None:
        return model.head(x).float()
    if model.lm_head_t is not None and x.shape[0] < 4:
        return (x @ model.lm_head_t).float()
    return F.linear(x, model.lm_head).float()


def _layer(layer, res: torch.Tensor, delta: torch.Tensor | None, fb: ForwardBatch, backend,
           rotary, eps: float) -> torch.Tensor:
    T = res.shape[0]
    n_q, n_kv, d = layer.n_q, layer.n_kv, layer.d
    y = add_rmsnorm(delta, res, layer.input_norm, eps)
    qkv = layer.qkv(y, layer.qkv_bias)                                # [T, (Hq + 2Hkv) * D]
    qk = qkv[:, : (n_q + n_kv) * d].view(T, n_q + n_kv, d)
    v = qkv[:, (n_q + n_kv) * d:].view(T, n_kv, d)
    kv = fb.kv_pool.layer(layer.spec.layer_id)
    rope_store(qk, v, rotary.cos, rotary.sin, fb.positions, n_q, kv.k, kv.v, fb.out_cache_loc,
               kv.index_map)
    o = backend.attend(qk[:, :n_q], qk[:, n_q:], v, layer.spec, fb)  # [T, Hq, D]
    a = layer.o_proj(o.reshape(T, n_q * d))
    y = add_rmsnorm(a, res, layer.post_norm, eps)
    return layer.down(_silu_mul(layer.gate_up(y)))
