"""Gemma 3 (text): interleaved sliding-window ("local") and global attention layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention.base import AttentionBackend, AttnSpec
from tandem.engine.forward_batch import ForwardBatch
from tandem.engine.layers import Rotary, rope_inv_freq
from tandem.engine.model_config import ModelArchConfig, ModelLoadError, _hf_rope_scaling
from tandem.engine.models.gemma3_cpu import FusedGemmaLayer, composed, native
from tandem.engine.models.hf_config import need, special_ids
from tandem.engine.models.norms import offset_rms_norm, offset_weight
from tandem.engine.quant.blocks import QuantParts, QuantWeight
from tandem.engine.quant.avx512 import Avx512Linear
from tandem.engine.quant.linear import make_linear
from tandem.engine.quant.preop import PreOp

_PROJ = ("qkv", "o_proj", "gate_up", "down")

GetTensor = Callable[[str], torch.Tensor]

GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def gemma3_gguf_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """A ``Gemma3ForCausalLM`` config.json equivalent of a gemma3 GGUF's metadata (what the file
    omits at the defaults transformers and llama.cpp share)."""
    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"gemma3.{name}", default)

    for name in ("embedding_length", "block_count", "attention.head_count", "feed_forward_length"):
        if key(name) is None:
            raise ModelLoadError(f"gguf metadata lacks 'gemma3.{name}'")
    n_q = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", int(key("embedding_length")) // n_q))
    cfg: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": int(key("embedding_length")), "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": n_q, "num_key_value_heads": int(key("attention.head_count_kv", n_q)),
        "head_dim": head_dim, "intermediate_size": int(key("feed_forward_length")),
        "vocab_size": int(key("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(key("context_length", 131072)),
        "rope_theta": float(key("rope.freq_base", 1_000_000.0)), "rope_local_base_freq": 10_000.0,
        "sliding_window": key("attention.sliding_window"),
        "query_pre_attn_scalar": head_dim, "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": key("final_logit_softcapping"),
        "attn_logit_softcapping": key("attn_logit_softcapping"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    pattern = key("attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)):
        cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        cfg["sliding_window_pattern"] = int(pattern or 6)
    stype = key("rope.scaling.type")
    if stype not in (None, "none"):
        if stype != "linear":
            raise ModelLoadError(f"gguf rope scaling {stype!r} is not supported (supported: linear)")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor", 1.0))}
    return cfg
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class Gemma3Extras:
    """What Gemma 3 needs beyond ModelArchConfig."""

    rope_kinds: tuple[str, ...]
    local_theta: float
    local_scaling: dict | None
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    gelu_approximate: str


def gemma3_arch(cfg: dict[str, Any]) -> tuple[ModelArchConfig, Gemma3Extras]:
    """Parse a ``Gemma3ForCausalLM`` config.json (transformers 4.5x or 5.x layout)."""
    need(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
         "vocab_size")
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError("Gemma 3 attn_logit_softcapping is not supported (transformers' "
                             "Gemma 3 ignores it; Gemma 3 checkpoints set it to null)")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError("Gemma 3 with use_bidirectional_attention is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU:
        raise ModelLoadError(f"Gemma 3 hidden_activation {act!r} is not supported "
                             f"(supported: {', '.join(_GELU)})")
    n_layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    n_q = int(cfg["num_attention_heads"])
    kinds = cfg.get("layer_types")
    if kinds is None:
        pattern = int(cfg.get("sliding_window_pattern", 6))
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    mapping = {"sliding_attention": "swa", "full_attention": "full"}
    if len(kinds) != n_layers or any(k not in mapping for k in kinds):
        raise ModelLoadError(f"config.json layer_types {kinds!r} is not supported")
    window = cfg.get("sliding_window")
    layer_types = [mapping[k] if window else "full" for k in kinds]
    rp = cfg.get("rope_parameters") or {}
    glob = dict(rp.get("full_attention") or {})
    loc = dict(rp.get("sliding_attention") or {})
    if not glob and cfg.get("rope_scaling"):
        glob = dict(cfg["rope_scaling"])
    g_theta = float(glob.get("rope_theta") or cfg.get("rope_theta") or 1_000_000.0)
    l_theta = float(loc.get("rope_theta") or cfg.get("rope_local_base_freq") or 10_000.0)
    bos, eos = special_ids(cfg)
    arch = ModelArchConfig(
        arch="gemma3", vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, num_layers=n_layers,
        num_q_heads=n_q, num_kv_heads=int(cfg.get("num_key_value_heads") or n_q),
        head_dim=int(cfg.get("head_dim") or hidden // n_q),
        intermediate_size=int(cfg["intermediate_size"]), rope_theta=g_theta,
        rope_scaling=_hf_rope_scaling(glob), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=int(cfg.get("max_position_embeddings") or 131072),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_bias=bool(cfg.get("attention_bias", False)), qk_norm=True,
        layer_types=layer_types, sliding_window=int(window) if "swa" in layer_types else None,
        bos_token_id=bos, eos_token_ids=eos)
    extras = Gemma3Extras(
        rope_kinds=tuple("local" if k == "sliding_attention" else "global" for k in kinds),
        local_theta=l_theta, local_scaling=_hf_rope_scaling(loc),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or arch.head_dim),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        gelu_approximate=_GELU[act])
    return arch, extras


_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131_072, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "hidden_activation": "gelu_pytorch_tanh",
}


def gemma3_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a ``Gemma3ForConditionalGeneration`` config.json."""
    text = dict(cfg.get("text_config") or {})
    out = {**_TEXT_DEFAULTS, **text}
    for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):
        if out.get(k) is None and cfg.get(k) is not None:
            out[k] = cfg[k]
    return out


def text_weights(get: GetTensor) -> GetTensor:
    """``get`` of a Gemma3ForConditionalGeneration checkpoint, asked for text-model names:
    ``model.language_model.*`` (transformers 5) or ``language_model.model.*`` (4.x)."""
    def text_get(name: str) -> torch.Tensor:
        if name.startswith("model."):
            rest = name[len("model."):]
            cands = [f"model.language_model.{rest}", f"language_model.model.{rest}"]
        else:
            cands = [name, f"language_model.{name}"]
        err = None
        for c in cands:
            try:
                return get(c)
            except ModelLoadError as e:
                err = err or e
        raise err

    return text_get


class Gemma3Layer(nn.Module):
    """One decoder layer."""

    def __init__(self, arch: ModelArchConfig, spec: AttnSpec, rope_kind: str, gelu: str,
                 t: dict[str, torch.Tensor | None], native: bool | str = False,
                 dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu")):
        super().__init__()
        self.spec, self.rope_kind, self.gelu = spec, rope_kind, gelu
        self.eps, self.inter = arch.rms_norm_eps, arch.intermediate_size
        self.n_q, self.n_kv, self.d = arch.num_q_heads, arch.num_kv_heads, arch.head_dim
        self.dequantized: list[tuple[str, str]] = []
        for name, w in t.items():
            if isinstance(w, (QuantWeight, QuantParts)):
                kernel, why = make_linear(w, dtype, device, native, q8_bf16=True)
                setattr(self, name + "_k", kernel)
                self.register_buffer(name, None)
                if why is not None and why != "dequant":
                    self.dequantized.append((name, why))
            else:
                if name in _PROJ:
                    setattr(self, name + "_k", None)
                self.register_buffer(name, None if w is None else w.contiguous())

        self.native_path, self.fused, self.fused_built = False, None, False

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["fused"], state["fused_built"] = None, False
        return state

    def kernels(self) -> list[nn.Module]:
        return [k for n in _PROJ if (k := getattr(self, n + "_k")) is not None]

    def _lin(self, name: str, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        k = getattr(self, name + "_k")
        return k(x, bias) if k is not None else F.linear(x, getattr(self, name), bias)

    def forward(self, x: torch.Tensor, rot: dict, fb: ForwardBatch,
                backend: AttentionBackend) -> torch.Tensor:
        cos, sin = rot[self.rope_kind]                                      # [T, 1, D/2]
        if not self.fused_built:
            self.native_path, self.fused, self.fused_built = native(self), FusedGemmaLayer.build(self), True
        if self.fused is not None and (y := self.fused(x, cos, sin, fb, backend)) is not None:
            return y
        if self.native_path:
            return composed(self, x, cos, sin, fb, backend)
        T, eps = x.shape[0], self.eps
        h = offset_rms_norm(x, self.input_norm, eps)
        qkv = self._lin("qkv", h, self.qkv_bias)                            # [T, (Hq + 2Hkv) * D]
        q_end, k_end = self.n_q * self.d, (self.n_q + self.n_kv) * self.d
        q = offset_rms_norm(qkv[:, :q_end].view(T, self.n_q, self.d), self.q_norm, eps)
        k = offset_rms_norm(qkv[:, q_end:k_end].view(T, self.n_kv, self.d), self.k_norm, eps)
        v = qkv[:, k_end:].view(T, self.n_kv, self.d)
        q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
        o = backend.forward(q, k, v, self.spec, fb).reshape(T, q_end)       # [T, Hq * D]
        x = x + offset_rms_norm(self._lin("o_proj", o, self.o_bias), self.post_attn_norm, eps)
        h = offset_rms_norm(x, self.pre_ff_norm, eps)
        gu = self._lin("gate_up", h)                                        # [T, 2I]
        act = F.gelu(gu[:, : self.inter], approximate=self.gelu) * gu[:, self.inter:]
        return x + offset_rms_norm(self._lin("down", act), self.post_ff_norm, eps)


class Gemma3ForCausalLM(nn.Module):
    """``forward(fb, backend, return_all_logits) -> logits [B | T, V]`` float32."""

    def __init__(self, arch: ModelArchConfig, extras: Gemma3Extras, get: GetTensor,
                 device: torch.device, dtype: torch.dtype, native: bool | str = False):
        """``native``: ``get`` gives a GGUF's projections (and, tied, the head) as QuantWeight, run
        on their own blocks (engine/quant/); otherwise every tensor is dense."""
        super().__init__()
        self.arch, self.extras = arch, extras
        self.device, self.dtype = torch.device(device), dtype
        self.dequantized: list[tuple[str, str]] = []

        def cvt(t):
            if native and isinstance(t, (QuantWeight, QuantParts)):
                return t
            return t.to(device=self.device, dtype=dtype).contiguous()

        def stack(parts):
            if all(isinstance(p, QuantWeight) for p in parts):
                return QuantParts.stack(parts)
            return torch.cat([p.dequantize() if isinstance(p, QuantWeight) else p for p in parts])

        def norm(name: str) -> torch.Tensor:
            return offset_weight(get(name)).to(self.device)

        self.register_buffer("embed", cvt(get("model.embed_tokens.weight")))    # [V, H]
        if tuple(self.embed.shape) != (arch.vocab_size, arch.hidden_size):
            raise ModelLoadError(f"embedding shape {tuple(self.embed.shape)} does not match "
                                 f"vocab_size={arch.vocab_size}, hidden_size={arch.hidden_size}")
        self.register_buffer("embed_scale", torch.tensor(arch.hidden_size ** 0.5).to(self.device, dtype))
        self.register_buffer("norm", norm("model.norm.weight"))
        self.head = None
        head_q = get("lm_head.weight") if native else None
        if isinstance(head_q, QuantWeight):
            self.head, why = make_linear(head_q, dtype, self.device, native, out_dtype=torch.float32)
            if why is not None and why != "dequant":
                self.dequantized.append(("lm_head", why))
        self.register_buffer("lm_head", self.embed if arch.tie_word_embeddings
                             else cvt(get("lm_head.weight")) if head_q is None or self.head is None
                             else None)                                          # [V, H]
        scale = extras.query_pre_attn_scalar ** -0.5
        layers = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = [get(a + f"{n}_proj.weight") for n in "qkv"]
            want = (arch.q_size, arch.kv_size, arch.kv_size)
            if tuple(w.shape[0] for w in qkv) != want:
                raise ModelLoadError(f"layer {i}: q/k/v rows {tuple(w.shape[0] for w in qkv)} do "
                                     f"not match heads x head_dim {want}")
            bias = arch.attention_bias
            t = {
                "input_norm": norm(p + "input_layernorm.weight"),
                "post_attn_norm": norm(p + "post_attention_layernorm.weight"),
                "pre_ff_norm": norm(p + "pre_feedforward_layernorm.weight"),
                "post_ff_norm": norm(p + "post_feedforward_layernorm.weight"),
                "q_norm": norm(a + "q_norm.weight"), "k_norm": norm(a + "k_norm.weight"),
                "qkv": cvt(stack(qkv)),
                "qkv_bias": cvt(torch.cat([get(a + f"{n}_proj.bias") for n in "qkv"])) if bias else None,
                "o_proj": cvt(get(a + "o_proj.weight")),
                "o_bias": cvt(get(a + "o_proj.bias")) if bias else None,
                "gate_up": cvt(stack([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])),
                "down": cvt(get(p + "mlp.down_proj.weight")),
            }
            spec = AttnSpec(i, arch.num_q_heads, arch.num_kv_heads, arch.head_dim, scale,
                            arch.layer_window(i))
            layers.append(Gemma3Layer(arch, spec, extras.rope_kinds[i], extras.gelu_approximate, t, native,
                                      dtype, self.device))
            self.dequantized += [(f"layers.{i}.{n}", why) for n, why in layers[-1].dequantized]
        self.layers = nn.ModuleList(layers)
        self.rotary = {
            "global": Rotary(rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling),
                             arch.max_position, self.device, dtype),
            "local": Rotary(rope_inv_freq(arch.head_dim, extras.local_theta, extras.local_scaling),
                            arch.max_position, self.device, dtype),
        }

    def kernels(self) -> list[nn.Module]:
        """The projections' quant/linear.py kernels (native), for the startup line."""
        ks = [k for layer in self.layers for k in layer.kernels()]
        return ks + ([self.head] if self.head is not None else [])

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, backend: AttentionBackend,
                return_all_logits: bool = False) -> torch.Tensor:
        """Logits [B, V] at ``fb.logit_indices`` or [T, V] (float32)."""
        x = F.embedding(fb.input_ids, self.embed) * self.embed_scale        # [T, H]
        rot = {k: r.tables(fb.positions) for k, r in self.rotary.items()}
        for layer in self.layers:
            x = layer(x, rot, fb, backend)
        if not return_all_logits:
            x = x[fb.logit_indices]                                    # [B, H]
        eps = self.arch.rms_norm_eps
        if isinstance(self.head, Avx512Linear):
            logits = self.head(x, pre=PreOp.rmsnorm_f32(self.norm, eps))
        else:
            x = offset_rms_norm(x, self.norm, eps)
            logits = self.head(x) if self.head is not None else F.linear(x, self.lm_head)   # [B | T, V]
        cap = self.extras.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
