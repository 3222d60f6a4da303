"""Granite-4.0-H (transformers' ``GraniteMoeHybridForCausalLM``): Mamba2 layers beside attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention.base import AttentionBackend, AttnSpec
from tandem.engine.forward_batch import ForwardBatch
from tandem.engine.layers import Rotary, rms_norm, rope_inv_freq
from tandem.engine.model_config import ModelArchConfig, ModelLoadError, _hf_rope_scaling
from tandem.engine.models.hf_config import hf_float, need, rope_theta, special_ids
from tandem.engine.models.mamba2 import Mamba2Dims, Mamba2Mixer, mamba2_tensors
from tandem.engine.models.moe import topk_moe

GetTensor = Callable[[str], torch.Tensor]
_LAYER_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full",
                "full_attention": "full"}


@dataclass(frozen=True)
class GraniteHybridExtras:
    """What Granite-4.0-H needs beyond ModelArchConfig."""

    mamba: Mamba2Dims
    mamba_bias: bool
    conv_bias: bool
    rope: bool
    attention_multiplier: float
    embedding_multiplier: float
    residual_multiplier: float
    logits_scaling: float
    num_experts: int
    top_k: int
    expert_intermediate: int


def granite_hybrid_arch(cfg: dict[str, Any]) -> tuple[ModelArchConfig, GraniteHybridExtras]:
    """Parse a ``GraniteMoeHybridForCausalLM`` config.json (transformers 4.5x or 5.x layout)."""
    need(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"Granite hybrid hidden_act {act!r} is not supported (supported: silu)")
    hidden, n_layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    n_q = int(cfg["num_attention_heads"])
    kinds = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n_layers
    if len(kinds) != n_layers or any(k not in _LAYER_KINDS for k in kinds):
        raise ModelLoadError(f"config.json layer_types {kinds!r} is not supported")
    pos = cfg.get("position_embedding_type")
    if pos not in (None, "rope", "nope"):
        raise ModelLoadError(f"position_embedding_type {pos!r} is not supported (supported: rope, nope)")
    n_heads = int(cfg.get("mamba_n_heads", 128))
    inner = int(cfg.get("mamba_expand", 2)) * hidden
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = inner // n_heads if d_head in (None, "auto") else int(d_head)
    n_groups = int(cfg.get("mamba_n_groups", 1))
    if d_head * n_heads != inner or n_heads % n_groups:
        raise ModelLoadError(f"mamba heads {n_heads} x head dim {d_head} != expand * hidden {inner}, "
                             f"or {n_heads} heads not divisible into {n_groups} groups")
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    dims = Mamba2Dims(hidden=hidden, n_heads=n_heads, head_dim=d_head, n_groups=n_groups,
                      d_state=int(cfg.get("mamba_d_state", 256)), d_conv=int(cfg.get("mamba_d_conv", 4)),
                      chunk_size=int(cfg.get("mamba_chunk_size", 256)), eps=eps,
                      time_step_min=hf_float(limit[0]), time_step_max=hf_float(limit[1]))
    rope = cfg.get("rope_parameters") or {}
    bos, eos = special_ids(cfg)
    n_experts = int(cfg.get("num_local_experts") or 0)
    arch = ModelArchConfig(
        arch="granitemoehybrid", vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        num_layers=n_layers, num_q_heads=n_q, num_kv_heads=int(cfg.get("num_key_value_heads") or n_q),
        head_dim=int(cfg.get("head_dim") or hidden // n_q),
        intermediate_size=int(cfg.get("shared_intermediate_size", 1024)),
        rope_theta=rope_theta(cfg, rope, 10000.0), rope_scaling=_hf_rope_scaling(cfg.get("rope_scaling") or rope),
        rms_norm_eps=eps, max_position=int(cfg.get("max_position_embeddings") or 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        layer_types=[_LAYER_KINDS[k] for k in kinds], bos_token_id=bos, eos_token_ids=eos)
    extras = GraniteHybridExtras(
        mamba=dims, mamba_bias=bool(cfg.get("mamba_proj_bias", False)),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)), rope=pos == "rope",
        attention_multiplier=float(cfg.get("attention_multiplier", 1.0)),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)), num_experts=n_experts,
        top_k=int(cfg.get("num_experts_per_tok") or 0),
        expert_intermediate=int(cfg.get("intermediate_size") or 0))
    return arch, extras


class GraniteHybridLayer(nn.Module):
    """One layer: ``mixer`` (a :class:`Mamba2Mixer`, or None for attention with ``qkv``/``o_proj``
    in ``t``) and the MLP."""

    def __init__(self, arch: ModelArchConfig, ex: GraniteHybridExtras, spec: AttnSpec | None,
                 mixer: Mamba2Mixer | None, t: dict[str, torch.Tensor | None]):
        super().__init__()
        self.spec, self.mixer, self.ex = spec, mixer, ex
        self.eps, self.inter = arch.rms_norm_eps, arch.intermediate_size
        self.n_q, self.n_kv, self.d = arch.num_q_heads, arch.num_kv_heads, arch.head_dim
        for name, w in t.items():
            self.register_buffer(name, None if w is None else w.contiguous())

    def forward(self, x: torch.Tensor, rot, fb: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        h = rms_norm(x, self.input_norm, self.eps)
        m = self.mixer(h, fb) if self.mixer is not None else self._attention(h, rot, fb, backend)
        x = x + m * self.ex.residual_multiplier
        h = rms_norm(x, self.post_norm, self.eps)
        gu = F.linear(h, self.mlp_in)                                       # [T, 2I]
        mlp = F.linear(F.silu(gu[:, : self.inter]) * gu[:, self.inter:], self.mlp_out)
        if self.ex.num_experts:
            mlp = topk_moe(h, self.moe_router, self.moe_gate_up, self.moe_down, self.ex.top_k, F.silu) + mlp
        return x + mlp * self.ex.residual_multiplier

    def _attention(self, h, rot, fb, backend):
        T = h.shape[0]
        qkv = F.linear(h, self.qkv, self.qkv_bias)                          # [T, (Hq + 2Hkv) * D]
        q_end, k_end = self.n_q * self.d, (self.n_q + self.n_kv) * self.d
        q = qkv[:, :q_end].view(T, self.n_q, self.d)
        k = qkv[:, q_end:k_end].view(T, self.n_kv, self.d)
        v = qkv[:, k_end:].view(T, self.n_kv, self.d)
        if rot is not None:
            q, k = Rotary.apply(q, *rot), Rotary.apply(k, *rot)
        o = backend.forward(q, k, v, self.spec, fb).reshape(T, q_end)
        return F.linear(o, self.o_proj, self.o_bias)


class GraniteHybridForCausalLM(nn.Module):
    """``forward(fb, backend, return_all_logits) -> logits [B | T, V]`` float32."""

    def __init__(self, arch: ModelArchConfig, ex: GraniteHybridExtras, get: GetTensor,
                 device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.arch, self.extras = arch, ex
        self.device, self.dtype = torch.device(device), dtype

        def cvt(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=self.device, dtype=dtype).contiguous()

        def f32(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=self.device, dtype=torch.float32).contiguous()

        self.register_buffer("embed", cvt(get("model.embed_tokens.weight")))    # [V, H]
        if tuple(self.embed.shape) != (arch.vocab_size, arch.hidden_size):
            raise ModelLoadError(f"embedding shape {tuple(self.embed.shape)} does not match "
                                 f"vocab_size={arch.vocab_size}, hidden_size={arch.hidden_size}")
        self.register_buffer("norm", cvt(get("model.norm.weight")))
        self.register_buffer("lm_head", self.embed if arch.tie_word_embeddings
                             else cvt(get("lm_head.weight")))                  # [V, H]
        layers, self.recurrent_layers = [], []
        for i, kind in enumerate(arch.layer_types):
            p = f"model.layers.{i}."
            t = {"input_norm": cvt(get(p + "input_layernorm.weight")),
                 "post_norm": cvt(get(p + "post_attention_layernorm.weight")),
                 "mlp_in": cvt(get(p + "shared_mlp.input_linear.weight")),     # [2I, H]
                 "mlp_out": cvt(get(p + "shared_mlp.output_linear.weight"))}   # [H, I]
            if ex.num_experts:
                moe = p + "block_sparse_moe."
                t |= {"moe_router": cvt(get(moe + "router.layer.weight")),     # [E, H]
                      "moe_gate_up": cvt(get(moe + "input_linear.weight")),    # [E, 2I, H]
                      "moe_down": cvt(get(moe + "output_linear.weight"))}      # [E, H, I]
            spec = mixer = None
            if kind == "mamba":
                mixer = Mamba2Mixer(i, ex.mamba, mamba2_tensors(p + "mamba.", get, cvt, f32,
                                                                ex.mamba_bias, ex.conv_bias))
                self.recurrent_layers.append(i)
            else:
                a = p + "self_attn."
                bias = arch.attention_bias
                t |= {"qkv": cvt(torch.cat([get(a + f"{n}_proj.weight") for n in "qkv"])),
                      "qkv_bias": cvt(torch.cat([get(a + f"{n}_proj.bias") for n in "qkv"])) if bias else None,
                      "o_proj": cvt(get(a + "o_proj.weight")),
                      "o_bias": cvt(get(a + "o_proj.bias")) if bias else None}
                if t["qkv"].shape[0] != arch.q_size + 2 * arch.kv_size:
                    raise ModelLoadError(f"layer {i}: q/k/v rows {t['qkv'].shape[0]} do not match "
                                         f"heads x head_dim {arch.q_size + 2 * arch.kv_size}")
                spec = AttnSpec(i, arch.num_q_heads, arch.num_kv_heads, arch.head_dim,
                                ex.attention_multiplier, arch.layer_window(i))
            layers.append(GraniteHybridLayer(arch, ex, spec, mixer, t))
        self.layers = nn.ModuleList(layers)
        self.state_shape = (ex.mamba.layout.numel,) if self.recurrent_layers else None
        self.rotary = Rotary(rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling),
                             arch.max_position, self.device, dtype) if ex.rope else None

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, backend: AttentionBackend,
                return_all_logits: bool = False) -> torch.Tensor:
        """Logits [B, V] at ``fb.logit_indices`` or [T, V] (float32)."""
        x = F.embedding(fb.input_ids, self.embed) * self.extras.embedding_multiplier   # [T, H]
        rot = self.rotary.tables(fb.positions) if self.rotary is not None else None
        for layer in self.layers:
            x = layer(x, rot, fb, backend)
        if not return_all_logits:
            x = x[fb.logit_indices]                                    # [B, H]
        x = rms_norm(x, self.norm, self.arch.rms_norm_eps)
        return (F.linear(x, self.lm_head) / self.extras.logits_scaling).float()   # [B | T, V]
