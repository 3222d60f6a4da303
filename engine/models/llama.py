"""The Llama family: Llama, Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm), Mistral (sliding window)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention.base import AttentionBackend, AttnSpec
from tandem.engine.forward_batch import ForwardBatch
from tandem.engine.layers import Rotary, rms_norm, rope_inv_freq
from tandem.engine.models.llama_cpu import FusedLlamaLayer
from tandem.engine.model_config import ModelArchConfig, ModelLoadError
from tandem.engine.quant.blocks import QuantParts, QuantWeight
from tandem.engine.quant.linear import DenseLinear, collapse_to_hugepages, make_linear, onednn_packable
from tandem.engine.quant.preop import PreOp
from tandem.engine.quant.avx512 import avx512_reason, rope_

GetTensor = Callable[[str], "torch.Tensor | QuantWeight"]


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


WeightOrQuant = torch.Tensor | QuantWeight | QuantParts


class LlamaLayer(nn.Module):
    """One decoder layer with fused projections (qkv [(Hq + 2Hkv) * D, H], o [H, Hq*D], gate_up [2I,
    H], down [H, I] in F.linear's [N, K] layout as ``_layer_tensors`` gives them; each a dense
    tensor in the model dtype or, with ``native``, possibly the file's quantized blocks)."""

    _PROJ = ("qkv", "o_proj", "gate_up", "down")

    def __init__(self, arch: ModelArchConfig, spec: AttnSpec, tensors: dict[str, WeightOrQuant | None],
                 native: bool = False):
        super().__init__()
        self.spec = spec
        self.eps = arch.rms_norm_eps
        self.n_q, self.n_kv, self.d = arch.num_q_heads, arch.num_kv_heads, arch.head_dim
        self.inter = arch.intermediate_size
        self.input_norm = _param(tensors["input_norm"])
        self.post_norm = _param(tensors["post_norm"])
        dtype, device = self.input_norm.dtype, self.input_norm.device
        self.dequantized: list[tuple[str, str]] = []
        for name in self._PROJ:
            kernel, why = make_linear(tensors[name], dtype, device, native, input_major=name != "down",
                                      q8_bf16=True)
            setattr(self, name, kernel)
            if why is not None and why != "dequant":
                self.dequantized.append((name, why))
        self.qkv_bias = _param(tensors["qkv_bias"]) if tensors.get("qkv_bias") is not None else None
        self.qk_norm = _param(tensors["qk_norm"]) if tensors.get("qk_norm") is not None else None
        self.fused: FusedLlamaLayer | None = None
        self.fused_built = False

    def kernels(self) -> list[nn.Module]:
        return [getattr(self, n) for n in self._PROJ]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["fused"], state["fused_built"] = None, False
        return state

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                fb: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        if not self.fused_built:
            self.fused, self.fused_built = FusedLlamaLayer.build(self), True
        if self.fused is not None and (y := self.fused(x, cos, sin, fb, backend)) is not None:
            return y
        T = x.shape[0]
        qkv = self.qkv(x, self.qkv_bias, pre=PreOp.rmsnorm(self.input_norm, self.eps))  # [T, (Hq + 2Hkv) * D]
        n_qk = self.n_q + self.n_kv
        qk = qkv[:, : n_qk * self.d].view(T, n_qk, self.d)           # [T, Hq + Hkv, D]
        v = qkv[:, n_qk * self.d:].view(T, self.n_kv, self.d)        # [T, Hkv, D]
        if self.qk_norm is not None:
            qk = rms_norm(qk, None, self.eps) * self.qk_norm
        if not rope_(qk, cos, sin):
            qk = Rotary.apply(qk, cos, sin)
        q, k = qk[:, : self.n_q], qk[:, self.n_q:]
        o = backend.forward(q, k, v, self.spec, fb)                   # [T, Hq, D]
        x = self.o_proj(o.reshape(T, self.n_q * self.d), residual=x)
        gu = self.gate_up(x, pre=PreOp.rmsnorm(self.post_norm, self.eps))  # [T, 2I]
        return self.down(gu, residual=x, pre=PreOp.silu_mul())


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArchConfig, get: GetTensor, device: torch.device,
                 dtype: torch.dtype, rope_freq_factors: torch.Tensor | None = None,
                 native: bool = False):
        """Build from HF-named tensors; ``get(name)`` returns one (any dtype, on the CPU) or, for a
        projection of a GGUF file, possibly its :class:`QuantWeight`."""
        super().__init__()
        if "mamba" in arch.layer_types:
            raise ModelLoadError("mamba layers are not supported by the Llama model")
        self.arch = arch
        self.device, self.dtype = torch.device(device), dtype

        def cvt(t: WeightOrQuant) -> WeightOrQuant:
            if native and isinstance(t, (QuantWeight, QuantParts)):
                return t
            return t.to(device=self.device, dtype=dtype).contiguous()

        self.embed = _param(get("model.embed_tokens.weight").to(device=self.device, dtype=dtype))
        if self.embed.shape[0] != arch.vocab_size or self.embed.shape[1] != arch.hidden_size:
            raise ModelLoadError(f"embedding shape {tuple(self.embed.shape)} does not match "
                                 f"vocab_size={arch.vocab_size}, hidden_size={arch.hidden_size}")
        self.norm = _param(cvt(get("model.norm.weight")))
        self.dequantized: list[tuple[str, str]] = []
        tied = arch.tie_word_embeddings
        head_src = get("lm_head.weight") if (native or not tied) else None
        head_native = native and isinstance(head_src, QuantWeight)
        if head_native and head_src.kind == "Q8_0" and (
                native == "int4" or avx512_reason(head_src, dtype, self.device) is not None):
            head_native = False
            self.dequantized.append(("lm_head", f"the {'tied ' if tied else ''}Q8_0 head: dense "
                                                "bf16-packed beats int4 planes past 1 row"))
        self.lm_head = None
        if not head_native:
            self.lm_head = self.embed if tied else _param(head_src.to(device=self.device, dtype=dtype))
        self.head = None
        if head_native or onednn_packable(dtype, self.device):
            self.head, why = make_linear(head_src if head_native else self.lm_head, dtype,
                                         self.device, native, out_dtype=torch.float32)
            if why is not None and why != "dequant":
                self.dequantized.append(("lm_head", why))
        self.lm_head_t = None if (self.head is not None or (
            arch.tie_word_embeddings and self.device.type == "cuda")) else _param(self.lm_head.t())
        scale = arch.head_dim ** -0.5
        self.specs = [AttnSpec(i, arch.num_q_heads, arch.num_kv_heads, arch.head_dim, scale,
                               arch.layer_window(i)) for i in range(arch.num_layers)]
        self.layers = nn.ModuleList(
            LlamaLayer(arch, self.specs[i], _layer_tensors(arch, i, get, cvt), native)
            for i in range(arch.num_layers))
        for i, layer in enumerate(self.layers):
            self.dequantized += [(f"layers.{i}.{n}", why) for n, why in layer.dequantized]
        inv = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling, rope_freq_factors)
        self.rotary = Rotary(inv, arch.max_position, self.device, dtype)
        self._hugepages()

    def kernels(self) -> list[nn.Module]:
        """Every projection's kernel (the layers', then the vocab head's if it has one)."""
        ks = [k for layer in self.layers for k in layer.kernels()]
        return ks + ([self.head] if self.head is not None else [])

    def __setstate__(self, state: dict) -> None:
        nn.Module.__setstate__(self, state)
        self._hugepages()

    def _hugepages(self) -> None:
        if self.device.type == "cpu":
            collapse_to_hugepages([k for k in self.kernels() if not isinstance(k, DenseLinear)])

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, backend: AttentionBackend,
                return_all_logits: bool = False) -> torch.Tensor:
        """Logits [B, V] at ``fb.logit_indices`` or [T, V] with ``return_all_logits`` (float32;
        computed in the model dtype, as transformers does)."""
        if callable(getattr(backend, "attend", None)):     # the GPU path (triton) only where it can run
            from tandem.engine.models import llama_gpu

            if llama_gpu.applies(self, backend):
                return llama_gpu.forward(self, fb, backend, return_all_logits)
        x = F.embedding(fb.input_ids, self.embed)                    # [T, H]
        cos, sin = self.rotary.tables(fb.positions)                   # [T, 1, D/2]
        for layer in self.layers:
            x = layer(x, cos, sin, fb, backend)
        if not return_all_logits and (fb.logit_rows is not None or x.shape[0] != fb.batch_size):
            x = x[fb.logit_indices]                              # [B, H]
        if self.head is not None:
            return self.head(x, pre=PreOp.rmsnorm(self.norm, self.arch.rms_norm_eps)).float()
        x = rms_norm(x, self.norm, self.arch.rms_norm_eps)
        if self.lm_head_t is not None and x.shape[0] < _HEAD_GEMM_ROWS:
            logits = x @ self.lm_head_t
        else:
            logits = F.linear(x, self.lm_head)
        return logits.float()                                         # [B|T, V]


_HEAD_GEMM_ROWS = 4


def _stack(parts: list[WeightOrQuant]) -> WeightOrQuant:
    if all(isinstance(p, QuantWeight) for p in parts):
        return QuantParts.stack(parts)
    return torch.cat([p.dequantize() if isinstance(p, QuantWeight) else p for p in parts], 0)


def _layer_tensors(arch: ModelArchConfig, i: int, get: GetTensor, cvt) -> dict[str, WeightOrQuant | None]:
    p = f"model.layers.{i}."
    att, mlp = p + "self_attn.", p + "mlp."
    q, k, v = get(att + "q_proj.weight"), get(att + "k_proj.weight"), get(att + "v_proj.weight")
    want = (arch.q_size, arch.kv_size, arch.kv_size)
    if (q.shape[0], k.shape[0], v.shape[0]) != want:
        raise ModelLoadError(f"layer {i}: q/k/v rows {(q.shape[0], k.shape[0], v.shape[0])} do not "
                             f"match heads x head_dim {want}")
    out: dict[str, WeightOrQuant | None] = {
        "input_norm": cvt(get(p + "input_layernorm.weight")),
        "post_norm": cvt(get(p + "post_attention_layernorm.weight")),
        "qkv": cvt(_stack([q, k, v])),                                                 # [N, K]
        "o_proj": cvt(get(att + "o_proj.weight")),
        "gate_up": cvt(_stack([get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")])),
        "down": cvt(get(mlp + "down_proj.weight")),
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
