"""Hybrid decoder: Llama attention layers ("full" or sliding-window "swa") mixed with recurrent
("mamba") layers, plus tiny random-initialised test models built in code.

The attention layers are :class:`~tandem.engine.models.llama.LlamaLayer` (their KV goes through the
attention backend: the full pool, or the SWA pool via ``LayerKV.index_map``); the recurrent layers
are :class:`~tandem.engine.models.recurrent.RecurrentLayer` (their state rows come from
``fb.state_pool`` at ``fb.state_indices``). Per step::

    input_ids [T] -> embed [T, H] -> N x (attention layer | recurrent layer)
    -> rows at fb.last_token_indices [B, H] (or all T) -> final norm -> lm_head -> logits [B|T, V]

:func:`tiny_hybrid` returns a ``LoadedModel`` (seeded random weights, a byte-level tokenizer) for
the layouts in :data:`TINY_LAYOUTS`; engine tests use them to exercise every cache-component
combination (FULL+SWA, FULL+MAMBA, FULL+SWA+MAMBA) on the CPU in seconds.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention.base import AttentionBackend, AttnSpec
from tandem.engine.forward_batch import ForwardBatch
from tandem.engine.layers import Rotary, rms_norm, rope_inv_freq
from tandem.engine.model_config import ModelArchConfig, ModelLoadError
from tandem.engine.models.llama import LlamaLayer, _layer_tensors
from tandem.engine.models.recurrent import RecurrentLayer

GetTensor = Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class RecurrentSpec:
    """Shape of the recurrent layers' state: ``heads x key_dim x value_dim`` per request."""

    heads: int
    key_dim: int
    value_dim: int


class HybridForCausalLM(nn.Module):
    """A decoder whose layers follow ``arch.layer_types`` ("full" | "swa" | "mamba").

    ``recurrent_layers``: ids of the "mamba" layers; ``state_shape``: ``(Hm, dk, dv)`` of one
    request's state in each of them (the engine sizes its state pool from these)."""

    def __init__(self, arch: ModelArchConfig, get: GetTensor, device: torch.device,
                 dtype: torch.dtype, recurrent: RecurrentSpec | None = None):
        super().__init__()
        if "mamba" in arch.layer_types and recurrent is None:
            raise ModelLoadError("a model with mamba layers needs a RecurrentSpec")
        self.arch = arch
        self.device, self.dtype = torch.device(device), dtype

        def cvt(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=self.device, dtype=dtype).contiguous()

        self.embed = nn.Parameter(cvt(get("model.embed_tokens.weight")), requires_grad=False)
        self.norm = nn.Parameter(cvt(get("model.norm.weight")), requires_grad=False)
        head = self.embed if arch.tie_word_embeddings else cvt(get("lm_head.weight"))
        self.lm_head_t = nn.Parameter(head.t().contiguous(), requires_grad=False)     # [H, V]
        scale = arch.head_dim ** -0.5
        layers: list[nn.Module] = []
        self.recurrent_layers: list[int] = []
        for i, kind in enumerate(arch.layer_types):
            if kind == "mamba":
                layers.append(_recurrent_layer(arch, recurrent, i, get, cvt))
                self.recurrent_layers.append(i)
            else:
                spec = AttnSpec(i, arch.num_q_heads, arch.num_kv_heads, arch.head_dim, scale,
                                arch.layer_window(i))
                layers.append(LlamaLayer(arch, spec, _layer_tensors(arch, i, get, cvt)))
        self.layers = nn.ModuleList(layers)
        self.state_shape = (recurrent.heads, recurrent.key_dim, recurrent.value_dim) \
            if recurrent is not None else None
        inv = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        self.rotary = Rotary(inv, arch.max_position, self.device, dtype)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, backend: AttentionBackend,
                return_all_logits: bool = False) -> torch.Tensor:
        """Logits [B, V] at ``fb.last_token_indices`` or [T, V] (float32)."""
        x = F.embedding(fb.input_ids, self.embed)                    # [T, H]
        cos, sin = self.rotary.tables(fb.positions)                   # [T, 1, D/2]
        for layer in self.layers:
            x = layer(x, cos, sin, fb, backend)
        if not return_all_logits:
            x = x[fb.last_token_indices]                              # [B, H]
        x = rms_norm(x, self.norm, self.arch.rms_norm_eps)
        return (x @ self.lm_head_t).float()                           # [B|T, V]


def _recurrent_layer(arch: ModelArchConfig, rs: RecurrentSpec, i: int, get: GetTensor, cvt) -> RecurrentLayer:
    p = f"model.layers.{i}."
    gate, up = get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")
    tensors = {
        "input_norm": cvt(get(p + "input_layernorm.weight")),
        "in_proj": cvt(get(p + "mixer.in_proj.weight").t()),
        "decay_bias": cvt(get(p + "mixer.decay_bias")),
        "out_norm": cvt(get(p + "mixer.out_norm.weight")),
        "out_proj": cvt(get(p + "mixer.out_proj.weight").t()),
        "post_norm": cvt(get(p + "post_attention_layernorm.weight")),
        "gate_up": cvt(torch.cat([gate, up], 0).t()),
        "down": cvt(get(p + "mlp.down_proj.weight").t()),
    }
    return RecurrentLayer(i, arch.hidden_size, rs.heads, rs.key_dim, rs.value_dim,
                          arch.intermediate_size, arch.rms_norm_eps, tensors)


# -- tiny random test models -----------------------------------------------------------------------
TINY_LAYOUTS: dict[str, list[str]] = {
    "full+swa": ["swa", "full", "swa"],
    "full+mamba": ["mamba", "full", "mamba"],
    "full+swa+mamba": ["swa", "mamba", "full", "swa"],
}
TINY_VOCAB = 258                       # 256 bytes, <s> = 256, </s> = 257


def byte_tokenizer():
    """A byte-level tokenizer built in memory: ids 0..255 are bytes, 256 = <s>, 257 = </s>."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from tandem.core.tokenizer import Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return Tokenizer(tok, name="bytes", bos_token_id=256, eos_token_ids={257},
                     chat_template="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}",
                     special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


def tiny_hybrid(layout: str | list[str], *, seed: int = 0, sliding_window: int = 8,
                hidden: int = 64, max_position: int = 2048, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32):
    """A seeded random hybrid model as a ``LoadedModel``. ``layout``: a key of
    :data:`TINY_LAYOUTS` or a list of layer types. Weights depend only on (seed, tensor name)."""
    from tandem.engine.loader import LoadedModel

    types = list(TINY_LAYOUTS[layout] if isinstance(layout, str) else layout)
    arch = ModelArchConfig(
        arch="llama", vocab_size=TINY_VOCAB, hidden_size=hidden, num_layers=len(types),
        num_q_heads=4, num_kv_heads=2, head_dim=hidden // 4, intermediate_size=2 * hidden,
        rms_norm_eps=1e-5, max_position=max_position, layer_types=types,
        sliding_window=sliding_window if "swa" in types else None,
        bos_token_id=256, eos_token_ids=(257,))
    rs = RecurrentSpec(heads=2, key_dim=16, value_dim=16)
    model = HybridForCausalLM(arch, _random_tensors(arch, rs, seed), torch.device(device), dtype, rs)
    name = f"tiny-{layout if isinstance(layout, str) else '+'.join(types)}"
    return LoadedModel(model, arch, byte_tokenizer(), name)


def _random_tensors(arch: ModelArchConfig, rs: RecurrentSpec, seed: int) -> GetTensor:
    H, I = arch.hidden_size, arch.intermediate_size
    n_in = rs.heads * (3 * rs.key_dim + 2 * rs.value_dim)
    shapes = {
        "model.embed_tokens.weight": (arch.vocab_size, H), "lm_head.weight": (arch.vocab_size, H),
        "model.norm.weight": (H,),
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (arch.q_size, H), "self_attn.k_proj.weight": (arch.kv_size, H),
        "self_attn.v_proj.weight": (arch.kv_size, H), "self_attn.o_proj.weight": (H, arch.q_size),
        "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
        "mixer.in_proj.weight": (n_in, H), "mixer.decay_bias": (rs.heads * rs.key_dim,),
        "mixer.out_norm.weight": (rs.value_dim,), "mixer.out_proj.weight": (H, rs.heads * rs.value_dim),
    }

    def get(name: str) -> torch.Tensor:
        short = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        if short not in shapes:
            raise ModelLoadError(f"tiny hybrid model has no tensor {name!r}")
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        shape = shapes[short]
        if short.endswith("norm.weight"):
            return 1.0 + 0.2 * torch.randn(shape, generator=g)
        if short == "mixer.decay_bias":
            return 2.0 + torch.randn(shape, generator=g)    # decays mostly in (0.7, 0.97)
        return 0.15 * torch.randn(shape, generator=g)
    return get
