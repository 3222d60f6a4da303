"""Hybrid decoder: Llama attention layers ("full" or sliding-window "swa") mixed with recurrent
("mamba") layers, plus tiny random-initialised test models built in code."""

from __future__ import annotations

import zlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention.base import AttentionBackend, AttnSpec
from tandem.engine.forward_batch import ForwardBatch
from tandem.engine.layers import Rotary, rms_norm, rope_inv_freq
from tandem.engine.model_config import ModelArchConfig, ModelLoadError
from tandem.engine.models.llama import LlamaLayer, _layer_tensors
from tandem.engine.models.mamba2 import Mamba2Dims, Mamba2Mixer, mamba2_tensors

GetTensor = Callable[[str], torch.Tensor]


class MambaBlock(nn.Module):
    """``x += mamba2(rms_norm(x))``, then ``x += down(silu(gate) * up)(rms_norm(x))``; the same call
    signature as LlamaLayer."""

    def __init__(self, layer_id: int, arch: ModelArchConfig, mixer: Mamba2Mixer,
                 t: dict[str, torch.Tensor]):
        super().__init__()
        self.layer_id, self.mixer = layer_id, mixer
        self.eps, self.inter = arch.rms_norm_eps, arch.intermediate_size
        for name, w in t.items():
            self.register_buffer(name, w.contiguous())

    def forward(self, x: torch.Tensor, cos, sin, fb: ForwardBatch, backend) -> torch.Tensor:
        x = x + self.mixer(rms_norm(x, self.input_norm, self.eps), fb)
        gu = F.linear(rms_norm(x, self.post_norm, self.eps), self.gate_up)    # [T, 2I]
        return x + F.linear(F.silu(gu[:, : self.inter]) * gu[:, self.inter:], self.down)


class HybridForCausalLM(nn.Module):
    """A decoder whose layers follow ``arch.layer_types`` ("full" | "swa" | "mamba")."""

    def __init__(self, arch: ModelArchConfig, get: GetTensor, device: torch.device,
                 dtype: torch.dtype, recurrent: Mamba2Dims | None = None):
        super().__init__()
        if "mamba" in arch.layer_types and recurrent is None:
            raise ModelLoadError("a model with mamba layers needs its Mamba2Dims")
        self.arch = arch
        self.device, self.dtype = torch.device(device), dtype

        def cvt(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=self.device, dtype=dtype).contiguous()

        def f32(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=self.device, dtype=torch.float32).contiguous()

        self.embed = nn.Parameter(cvt(get("model.embed_tokens.weight")), requires_grad=False)
        self.norm = nn.Parameter(cvt(get("model.norm.weight")), requires_grad=False)
        head = self.embed if arch.tie_word_embeddings else cvt(get("lm_head.weight"))
        self.lm_head_t = nn.Parameter(head.t().contiguous(), requires_grad=False)     # [H, V]
        scale = arch.head_dim ** -0.5
        layers: list[nn.Module] = []
        self.recurrent_layers: list[int] = []
        for i, kind in enumerate(arch.layer_types):
            if kind == "mamba":
                layers.append(_mamba_block(arch, recurrent, i, get, cvt, f32))
                self.recurrent_layers.append(i)
            else:
                spec = AttnSpec(i, arch.num_q_heads, arch.num_kv_heads, arch.head_dim, scale,
                                arch.layer_window(i))
                layers.append(LlamaLayer(arch, spec, _layer_tensors(arch, i, get, cvt)))
        self.layers = nn.ModuleList(layers)
        self.state_shape = (recurrent.layout.numel,) if recurrent is not None else None
        inv = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        self.rotary = Rotary(inv, arch.max_position, self.device, dtype)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, backend: AttentionBackend,
                return_all_logits: bool = False) -> torch.Tensor:
        """Logits [B, V] at ``fb.logit_indices`` or [T, V] (float32)."""
        x = F.embedding(fb.input_ids, self.embed)                    # [T, H]
        cos, sin = self.rotary.tables(fb.positions)                   # [T, 1, D/2]
        for layer in self.layers:
            x = layer(x, cos, sin, fb, backend)
        if not return_all_logits:
            x = x[fb.logit_indices]                              # [B, H]
        x = rms_norm(x, self.norm, self.arch.rms_norm_eps)
        return (x @ self.lm_head_t).float()                           # [B|T, V]


def _mamba_block(arch: ModelArchConfig, dims: Mamba2Dims, i: int, get: GetTensor, cvt, f32) -> MambaBlock:
    p = f"model.layers.{i}."
    mixer = Mamba2Mixer(i, dims, mamba2_tensors(p + "mamba.", get, cvt, f32, bias=False, conv_bias=True))
    t = {"input_norm": cvt(get(p + "input_layernorm.weight")),
         "post_norm": cvt(get(p + "post_attention_layernorm.weight")),
         "gate_up": cvt(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], 0)),
         "down": cvt(get(p + "mlp.down_proj.weight"))}
    return MambaBlock(i, arch, mixer, t)


TINY_LAYOUTS: dict[str, list[str]] = {
    "full+swa": ["swa", "full", "swa"],
    "full+mamba": ["mamba", "full", "mamba"],
    "full+swa+mamba": ["swa", "mamba", "full", "swa"],
}
TINY_VOCAB = 258


BYTE_CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def _byte_bpe():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tok


def byte_tokenizer():
    """That byte-level tokenizer built in memory, as Tandem's Tokenizer (with a chat template)."""
    from tandem.core.tokenizer import Tokenizer

    return Tokenizer(_byte_bpe(), name="bytes", bos_token_id=256, eos_token_ids={257},
                     chat_template=BYTE_CHAT_TEMPLATE, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


def save_byte_tokenizer(path) -> None:
    """The same tokenizer as a HF directory's tokenizer.json + tokenizer_config.json (for tiny
    models saved with ``save_pretrained``)."""
    import json
    import os

    _byte_bpe().save(os.path.join(str(path), "tokenizer.json"))
    with open(os.path.join(str(path), "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": BYTE_CHAT_TEMPLATE}, f)


def tiny_hybrid(layout: str | list[str], *, seed: int = 0, sliding_window: int = 8,
                hidden: int = 64, max_position: int = 2048, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32):
    """A seeded random hybrid model as a ``LoadedModel``."""
    from tandem.engine.loader import LoadedModel

    types = list(TINY_LAYOUTS[layout] if isinstance(layout, str) else layout)
    arch = ModelArchConfig(
        arch="llama", vocab_size=TINY_VOCAB, hidden_size=hidden, num_layers=len(types),
        num_q_heads=4, num_kv_heads=2, head_dim=hidden // 4, intermediate_size=2 * hidden,
        rms_norm_eps=1e-5, max_position=max_position, layer_types=types,
        sliding_window=sliding_window if "swa" in types else None,
        bos_token_id=256, eos_token_ids=(257,))
    dims = Mamba2Dims(hidden=hidden, n_heads=4, head_dim=hidden // 4, n_groups=2, d_state=8,
                      d_conv=4, chunk_size=8, eps=1e-5)
    model = HybridForCausalLM(arch, _random_tensors(arch, dims, seed), torch.device(device), dtype, dims)
    name = f"tiny-{layout if isinstance(layout, str) else '+'.join(types)}"
    return LoadedModel(model, arch, byte_tokenizer(), name)


def _random_tensors(arch: ModelArchConfig, d: Mamba2Dims, seed: int) -> GetTensor:
    H, I = arch.hidden_size, arch.intermediate_size
    shapes = {
        "model.embed_tokens.weight": (arch.vocab_size, H), "lm_head.weight": (arch.vocab_size, H),
        "model.norm.weight": (H,),
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (arch.q_size, H), "self_attn.k_proj.weight": (arch.kv_size, H),
        "self_attn.v_proj.weight": (arch.kv_size, H), "self_attn.o_proj.weight": (H, arch.q_size),
        "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
        "mamba.in_proj.weight": (d.inner + d.conv_dim + d.n_heads, H),
        "mamba.conv1d.weight": (d.conv_dim, 1, d.d_conv), "mamba.conv1d.bias": (d.conv_dim,),
        "mamba.dt_bias": (d.n_heads,), "mamba.A_log": (d.n_heads,), "mamba.D": (d.n_heads,),
        "mamba.norm.weight": (d.inner,), "mamba.out_proj.weight": (H, d.inner),
    }

    def get(name: str) -> torch.Tensor:
        short = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        if short not in shapes:
            raise ModelLoadError(f"tiny hybrid model has no tensor {name!r}")
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        shape = shapes[short]
        if short.endswith("norm.weight"):
            return 1.0 + 0.2 * torch.randn(shape, generator=g)
        if short == "mamba.A_log":
            return torch.log(torch.linspace(1, 8, shape[0])) + 0.1 * torch.randn(shape, generator=g)
        if short == "mamba.dt_bias":
            return 0.5 * torch.randn(shape, generator=g) - 1.0
        if short == "mamba.D":
            return 1.0 + 0.2 * torch.randn(shape, generator=g)
        return 0.15 * torch.randn(shape, generator=g)
    return get
