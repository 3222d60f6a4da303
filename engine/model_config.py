"""ModelArchConfig: the shape of a Llama-family model, from GGUF metadata or a HF config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tandem.core.types import TandemError

GGUF_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
HF_FAMILY_ARCHS = {
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3_text",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
}
LAYER_TYPES = ("full", "swa", "mamba")


class ModelLoadError(TandemError):
    """A model cannot be loaded as given (missing path or file, unsupported architecture, ...)."""


@dataclass(frozen=True)
class ModelArchConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if len(self.layer_types) != self.num_layers:
            raise ModelLoadError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ModelLoadError(f"unknown layer type {bad[0]!r} (known: {', '.join(LAYER_TYPES)})")
        if "swa" in self.layer_types and not self.sliding_window:
            raise ModelLoadError("sliding-window layers need a sliding_window size")
        if self.num_q_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window of layer ``layer_id`` (None for full attention)."""
        return self.sliding_window if self.layer_types[layer_id] == "swa" else None

    def with_overrides(self, sliding_window: int | None = None,
                       context_length: int | None = None) -> "ModelArchConfig":
        """``sliding_window=W`` makes every attention layer sliding-window with window W;
        ``context_length`` replaces ``max_position``."""
        changes: dict[str, Any] = {}
        if sliding_window is not None:
            if sliding_window < 1:
                raise ModelLoadError(f"sliding_window must be >= 1, got {sliding_window}")
            changes["layer_types"] = ["mamba" if t == "mamba" else "swa" for t in self.layer_types]
            changes["sliding_window"] = int(sliding_window)
        if context_length is not None:
            changes["max_position"] = int(context_length)
        return dataclasses.replace(self, **changes) if changes else self

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: set[str]) -> "ModelArchConfig":
        """From GGUF metadata (key -> Python value) and the file's tensor names."""
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHS:
            raise ModelLoadError(
                f"gguf architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHS)})")

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        def need(name: str) -> Any:
            v = key(name)
            if v is None:
                raise ModelLoadError(f"gguf metadata lacks '{arch}.{name}'")
            return v

        hidden, n_q = int(need("embedding_length")), int(need("attention.head_count"))
        n_layers = int(need("block_count"))
        n_kv = int(key("attention.head_count_kv", n_q))
        head_dim = int(key("attention.key_length", hidden // n_q))
        vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
        if not vocab:
            raise ModelLoadError(f"gguf metadata lacks '{arch}.vocab_size' and a token list")
        rope_scaling = None
        stype = key("rope.scaling.type")
        if stype not in (None, "none"):
            if stype != "linear":
                raise ModelLoadError(f"gguf rope scaling {stype!r} is not supported (supported: linear)")
            rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor", 1.0))}
        window = key("attention.sliding_window")
        swa = arch == "mistral" and bool(window)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            arch=arch, vocab_size=int(vocab), hidden_size=hidden, num_layers=n_layers,
            num_q_heads=n_q, num_kv_heads=n_kv, head_dim=head_dim,
            intermediate_size=int(need("feed_forward_length")),
            rope_theta=float(key("rope.freq_base", 10000.0)), rope_scaling=rope_scaling,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            max_position=int(key("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            layer_types=["swa" if swa else "full"] * n_layers,
            sliding_window=int(window) if swa else None,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
        )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArchConfig":
        """From a parsed ``config.json``."""
        archs = cfg.get("architectures") or []
        names = [a for a in archs if a in HF_ARCHS]
        if not names:
            shown = ", ".join(archs) if archs else f"model_type {cfg.get('model_type')!r}"
            raise ModelLoadError(
                f"architecture {shown} is not supported "
                f"(supported: {', '.join([*HF_ARCHS, *HF_FAMILY_ARCHS])})")
        arch = HF_ARCHS[names[0]]
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "vocab_size"):
            if cfg.get(k) is None:
                raise ModelLoadError(f"config.json lacks {k!r}")
        hidden, n_q = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        n_layers = int(cfg["num_hidden_layers"])
        n_kv = int(cfg.get("num_key_value_heads") or n_q)
        head_dim = int(cfg.get("head_dim") or hidden // n_q)
        rope = cfg.get("rope_parameters") or {}
        rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_scaling = _hf_rope_scaling(cfg.get("rope_scaling") or rope)
        layer_types = _hf_layer_types(arch, cfg, n_layers)
        window = cfg.get("sliding_window")
        eos = cfg.get("eos_token_id")
        eos_ids = (eos,) if isinstance(eos, int) else tuple(e for e in (eos or []) if isinstance(e, int))
        return cls(
            arch=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, num_layers=n_layers,
            num_q_heads=n_q, num_kv_heads=n_kv, head_dim=head_dim,
            intermediate_size=int(cfg["intermediate_size"]), rope_theta=rope_theta,
            rope_scaling=rope_scaling, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position=int(cfg.get("max_position_embeddings") or 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3", layer_types=layer_types,
            sliding_window=int(window) if "swa" in layer_types else None,
            bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
            eos_token_ids=eos_ids,
        )


def _hf_rope_scaling(rs: dict | None) -> dict | None:
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("llama3", "linear"):
        raise ModelLoadError(f"rope scaling {kind!r} is not supported (supported: llama3, linear)")
    out = {"rope_type": kind, "factor": float(rs.get("factor", 1.0))}
    if kind == "llama3":
        for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if k not in rs:
                raise ModelLoadError(f"llama3 rope scaling lacks {k!r}")
            out[k] = rs[k]
    return out


def _hf_layer_types(arch: str, cfg: dict, n_layers: int) -> list[str]:
    window = cfg.get("sliding_window")
    if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window"):
        window = None
    lt = cfg.get("layer_types")
    if lt is not None and arch != "mistral":
        mapping = {"full_attention": "full", "sliding_attention": "swa"}
        if len(lt) != n_layers or any(t not in mapping for t in lt):
            raise ModelLoadError(f"config.json layer_types {lt!r} is not supported")
        return [mapping[t] if window else "full" for t in lt]
    if arch == "mistral":
        return ["swa" if window else "full"] * n_layers
    if arch in ("qwen2", "qwen3") and window:
        first = int(cfg.get("max_window_layers", n_layers))
        return ["swa" if i >= first else "full" for i in range(n_layers)]
    return ["full"] * n_layers
