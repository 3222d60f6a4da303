"""The Llama family: Llama, Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm), Mistral (sliding window).

Weights arrive under Hugging Face names (``model.layers.{i}.self_attn.q_proj.weight`` ...; the
loader renames GGUF tensors to these) and are fused at load time: q/k/v into one ``qkv`` matrix,
gate/up into one ``gate_up`` matrix, so one decoder layer is 4 matmuls. Attention goes through an
:class:`AttentionBackend`; the model never sees the KV pool.

Per step (T new tokens over B sequences, H hidden, V vocab):

    input_ids [T] -> embed [T, H] -> 30 x (norm, qkv, rotary, attention, o_proj, norm, MLP)
    -> rows at fb.last_token_indices [B, H] (or all T) -> final norm -> lm_head -> logits [B|T, V]
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention.base import AttentionBackend, AttnSpec
from tandem.engine.forward_batch import ForwardBatch
from tandem.engine.layers import Rotary, rms_norm, rope_inv_freq
from tandem.engine.model_config import ModelArchConfig, ModelLoadError

GetTensor = Callable[[str], torch.Tensor]  # HF tensor name -> tensor (raises ModelLoadError if absent)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


class LlamaLayer(nn.Module):
    """One decoder layer with fused projections, stored input-major ("x @ W") because a
    [1, K] x [K, N] product streams the weight faster on CPUs than F.linear's [N, K] layout
    (decode is memory-bound). Shapes: qkv [H, (Hq + 2Hkv) * D], o [Hq*D, H], gate_up [H, 2I],
    down [I, H]."""

    def __init__(self, arch: ModelArchConfig, spec: AttnSpec, tensors: dict[str, torch.Tensor | None]):
        super().__init__()
        self.spec = spec
        self.eps = arch.rms_norm_eps
        self.n_q, self.n_kv, self.d = arch.num_q_heads, arch.num_kv_heads, arch.head_dim
        self.inter = arch.intermediate_size
        self.input_norm = _param(tensors["input_norm"])
        self.post_norm = _param(tensors["post_norm"])
        self.qkv = _param(tensors["qkv"])
        self.qkv_bias = _param(tensors["qkv_bias"]) if tensors.get("qkv_bias") is not None else None
        # qk_norm: [Hq + Hkv, D] -- q's weight repeated per q head, then k's per kv head, so q and k
        # are normalized in one call on their [T, Hq + Hkv, D] view.
        self.qk_norm = _param(tensors["qk_norm"]) if tensors.get("qk_norm") is not None else None
        self.o_proj = _param(tensors["o_proj"])
        self.gate_up = _param(tensors["gate_up"])
        self.down = _param(tensors["down"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                fb: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        # x: [T, H] residual stream
        T = x.shape[0]
        h = rms_norm(x, self.input_norm, self.eps)
        qkv = _mm(h, self.qkv, self.qkv_bias)                         # [T, (Hq + 2Hkv) * D]
        n_qk = self.n_q + self.n_kv
        qk = qkv[:, : n_qk * self.d].view(T, n_qk, self.d)           # [T, Hq + Hkv, D]
        v = qkv[:, n_qk * self.d:].view(T, self.n_kv, self.d)        # [T, Hkv, D]
        if self.qk_norm is not None:
            qk = rms_norm(qk, None, self.eps) * self.qk_norm         # per-head norm over D
        qk = Rotary.apply(qk, cos, sin)
        q, k = qk[:, : self.n_q], qk[:, self.n_q:]
        o = backend.forward(q, k, v, self.spec, fb)                   # [T, Hq, D]
        x = torch.addmm(x, o.reshape(T, self.n_q * self.d), self.o_proj)
        h = rms_norm(x, self.post_norm, self.eps)
        gu = h @ self.gate_up                                         # [T, 2I]
        act = F.silu(gu[:, : self.inter]) * gu[:, self.inter:]        # [T, I]
        return torch.addmm(x, act, self.down)


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArchConfig, get: GetTensor, device: torch.device,
                 dtype: torch.dtype, rope_freq_factors: torch.Tensor | None = None):
        """Build from HF-named tensors; ``get(name)`` returns one (any dtype, on the CPU)."""
        super().__init__()
        if "mamba" in arch.layer_types:
            raise ModelLoadError("mamba layers are not supported by the Llama model")
        self.arch = arch
        self.device, self.dtype = torch.device(device), dtype

        def cvt(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=self.device, dtype=dtype).contiguous()

        self.embed = _param(cvt(get("model.embed_tokens.weight")))
        if self.embed.shape[0] != arch.vocab_size or self.embed.shape[1] != arch.hidden_size:
            raise ModelLoadError(f"embedding shape {tuple(self.embed.shape)} does not match "
                                 f"vocab_size={arch.vocab_size}, hidden_size={arch.hidden_size}")
        self.norm = _param(cvt(get("model.norm.weight")))
        # lm_head: [V, H] (F.linear layout, the embedding itself when tied). On CPU a transposed
        # copy lm_head_t: [H, V] is worth its memory: for a few rows (decode of a small batch) the
        # vocab GEMV runs ~2x faster as x @ W; from ~8 rows on F.linear over [V, H] is ~1.5x faster.
        head = self.embed if arch.tie_word_embeddings else _param(cvt(get("lm_head.weight")))
        self.lm_head = head
        self.lm_head_t = None if (arch.tie_word_embeddings and self.device.type == "cuda") \
            else _param(head.t())
        scale = arch.head_dim ** -0.5
        self.specs = [AttnSpec(i, arch.num_q_heads, arch.num_kv_heads, arch.head_dim, scale,
                               arch.layer_window(i)) for i in range(arch.num_layers)]
        self.layers = nn.ModuleList(
            LlamaLayer(arch, self.specs[i], _layer_tensors(arch, i, get, cvt))
            for i in range(arch.num_layers))
        inv = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling, rope_freq_factors)
        self.rotary = Rotary(inv, arch.max_position, self.device, dtype)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, backend: AttentionBackend,
                return_all_logits: bool = False) -> torch.Tensor:
        """Logits [B, V] at ``fb.last_token_indices`` or [T, V] with ``return_all_logits``
        (float32). ``backend.init_forward(fb)`` must have run for this step."""
        x = F.embedding(fb.input_ids, self.embed)                    # [T, H]
        cos, sin = self.rotary.tables(fb.positions)                   # [T, 1, D/2]
        for layer in self.layers:
            x = layer(x, cos, sin, fb, backend)
        if not return_all_logits:
            x = x[fb.last_token_indices]                              # [B, H]
        x = rms_norm(x, self.norm, self.arch.rms_norm_eps)
        if self.lm_head_t is None or x.shape[0] >= _HEAD_GEMM_ROWS:
            logits = F.linear(x, self.lm_head)
        else:
            logits = x @ self.lm_head_t
        return logits.float()                                         # [B|T, V]


_HEAD_GEMM_ROWS = 4  # from this many rows on, the [V, H] layout wins for the vocab projection


def _mm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [T, K] @ w: [K, N] (+ bias [N]) -> [T, N]."""
    return x @ w if bias is None else torch.addmm(bias, x, w)


def _layer_tensors(arch: ModelArchConfig, i: int, get: GetTensor, cvt) -> dict[str, torch.Tensor | None]:
    """Fused tensors of layer ``i`` from its HF-named pieces."""
    p = f"model.layers.{i}."
    att, mlp = p + "self_attn.", p + "mlp."
    q, k, v = get(att + "q_proj.weight"), get(att + "k_proj.weight"), get(att + "v_proj.weight")
    want = (arch.q_size, arch.kv_size, arch.kv_size)
    if (q.shape[0], k.shape[0], v.shape[0]) != want:
        raise ModelLoadError(f"layer {i}: q/k/v rows {(q.shape[0], k.shape[0], v.shape[0])} do not "
                             f"match heads x head_dim {want}")
    out: dict[str, torch.Tensor | None] = {
        "input_norm": cvt(get(p + "input_layernorm.weight")),
        "post_norm": cvt(get(p + "post_attention_layernorm.weight")),
        "qkv": cvt(torch.cat([q, k, v], 0).t()),
        "o_proj": cvt(get(att + "o_proj.weight").t()),
        "gate_up": cvt(torch.cat([get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")], 0).t()),
        "down": cvt(get(mlp + "down_proj.weight").t()),
        "qkv_bias": None, "qk_norm": None,
    }
    if arch.attention_bias:
        out["qkv_bias"] = cvt(torch.cat([get(att + "q_proj.bias"), get(att + "k_proj.bias"),
                                         get(att + "v_proj.bias")], 0))
    if arch.qk_norm:
        qn, kn = get(att + "q_norm.weight"), get(att + "k_norm.weight")
        out["qk_norm"] = cvt(torch.cat([qn.expand(arch.num_q_heads, -1),
                                        kn.expand(arch.num_kv_heads, -1)], 0))
    return out
