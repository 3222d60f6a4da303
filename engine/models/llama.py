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

import ctypes
import sys
import threading
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


# -- CPU GEMMs -------------------------------------------------------------------------------------
# On CPU (fp32) every projection runs through oneDNN with its weight reordered once at load time
# into oneDNN's blocked layout ("packed"). Measured on SmolLM2's shapes, 1 thread, weights streamed
# from DRAM as in a real step, against MKL (torch.mm / F.linear): ~1.4x faster at 32 rows
# (batched decode; the [V, H] vocab projection ~1.8x), ~1.1x at 2,048 rows (prefill), and, with
# fewer than _PACKED_MIN_ROWS rows zero-padded up to it, ~1.1x faster than the best MKL layout
# ("x @ W[K, N]") at 1 row. oneDNN's result for a row does not depend on the other rows of the
# batch (bitwise, for any row count), so a request's logits do not depend on what it is batched
# with. Elsewhere (CUDA, other dtypes, no oneDNN) weights keep plain layouts (see LlamaLayer).
_PACKED_MIN_ROWS = 4     # oneDNN's 1-2 row (GEMV) path is slower than its 4-row GEMM path
_PACK_HINT_ROWS = 32     # batch-size hint for the reorder (measured: any hint 4..2048 is as fast)
_pad_buffers = threading.local()   # (K, ...) -> [_PACKED_MIN_ROWS, K] input buffer, per thread


def _use_packed(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _packed(w: torch.Tensor) -> nn.Parameter:
    """w: [N, K] (F.linear layout) -> an oneDNN-packed copy (an opaque ``torch._mkldnn`` tensor)."""
    return nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _PACK_HINT_ROWS),
                        requires_grad=False)


def _collapse_to_hugepages(tensors: list[torch.Tensor]) -> None:
    """Best effort: back the (packed, oneDNN-layout) weights with 2 MiB pages (Linux >= 6.1
    ``madvise(MADV_COLLAPSE)`` over each allocation's aligned interior). Decode streams every
    weight once per step; with 4 KiB pages the TLB misses cost ~6% of a 1-row step (measured).
    Contents are unchanged; on any failure (other OS, old kernel, THP off) nothing happens."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        huge = 1 << 21
        for t in tensors:
            ptr, n = torch.ops.mkldnn.data_ptr(t), torch.ops.mkldnn._nbytes(t)
            start, end = -(-ptr // huge) * huge, (ptr + n) // huge * huge
            if end > start and libc.madvise(start, end - start, _MADV_COLLAPSE) != 0:
                return   # unsupported here: stop trying
    except Exception:  # noqa: BLE001 - an optimization only
        return


_MADV_COLLAPSE = 25


def _dense_state(module: nn.Module, names: tuple[str, ...]) -> dict:
    """``module.__dict__`` for pickling with the packed parameters ``names`` as plain [N, K]
    tensors (oneDNN's opaque tensors have no storage to pickle); ``_repack`` lists them."""
    state = module.__dict__.copy()
    params = dict(state["_parameters"])
    packed = tuple(n for n in names if params.get(n) is not None and params[n].layout == torch._mkldnn)
    for n in packed:
        params[n] = nn.Parameter(params[n].to_dense(), requires_grad=False)
    state["_parameters"], state["_repack"] = params, packed
    return state


def _repack_state(module: nn.Module, state: dict) -> None:
    """Inverse of :func:`_dense_state` (re-packs after unpickling, e.g. in another process)."""
    packed = state.pop("_repack", ())
    nn.Module.__setstate__(module, state)
    for n in packed:
        module._parameters[n] = _packed(module._parameters[n])


def _linear_packed(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, K] @ packed w [N, K]^T (+ bias [N]) (+ residual [T, N]) -> [T, N] (oneDNN)."""
    T = x.shape[0]
    if T >= _PACKED_MIN_ROWS:
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
        if bias is None:  # fused post-op add: bitwise equal to linear + add
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, w, None, "add")
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "").add_(residual)
    # Pad to _PACKED_MIN_ROWS rows in a reused per-thread buffer; rows >= T hold stale (finite)
    # activations whose outputs are dropped -- each output row depends on its own input row only.
    key = (x.shape[1], x.dtype, x.device, torch.is_inference_mode_enabled())
    bufs = _pad_buffers.__dict__
    xp = bufs.get(key)
    if xp is None:
        xp = bufs[key] = x.new_zeros(_PACKED_MIN_ROWS, x.shape[1])
    xp[:T] = x
    y = torch.ops.mkldnn._linear_pointwise(xp, w, bias, "none", [], "")[:T]
    return y if residual is None else y.add_(residual)


class LlamaLayer(nn.Module):
    """One decoder layer with fused projections (qkv [(Hq + 2Hkv) * D, H], o [H, Hq*D],
    gate_up [2I, H], down [H, I] in F.linear's [N, K] layout as ``_layer_tensors`` gives them).

    On CPU in fp32 they are stored oneDNN-packed (see ``_linear_packed``). Otherwise qkv, o and
    gate_up are stored input-major ("x @ W": on CPU a [1, K] x [K, N] product streams the weight
    ~1.4-2x faster than MKL's F.linear over [N, K]) and down stays [N, K] (faster for it with MKL,
    K = I > N = H, at 1 row and at 32 rows)."""

    def __init__(self, arch: ModelArchConfig, spec: AttnSpec, tensors: dict[str, torch.Tensor | None]):
        super().__init__()
        self.spec = spec
        self.eps = arch.rms_norm_eps
        self.n_q, self.n_kv, self.d = arch.num_q_heads, arch.num_kv_heads, arch.head_dim
        self.inter = arch.intermediate_size
        self.input_norm = _param(tensors["input_norm"])
        self.post_norm = _param(tensors["post_norm"])
        self.packed = _use_packed(tensors["qkv"])
        if self.packed:
            self.qkv, self.o_proj = _packed(tensors["qkv"]), _packed(tensors["o_proj"])
            self.gate_up, self.down = _packed(tensors["gate_up"]), _packed(tensors["down"])
        else:   # [K, N] for x @ W, except down
            self.qkv, self.o_proj = _param(tensors["qkv"].t()), _param(tensors["o_proj"].t())
            self.gate_up, self.down = _param(tensors["gate_up"].t()), _param(tensors["down"])
        self.qkv_bias = _param(tensors["qkv_bias"]) if tensors.get("qkv_bias") is not None else None
        # qk_norm: [Hq + Hkv, D] -- q's weight repeated per q head, then k's per kv head, so q and k
        # are normalized in one call on their [T, Hq + Hkv, D] view.
        self.qk_norm = _param(tensors["qk_norm"]) if tensors.get("qk_norm") is not None else None

    _PACKED = ("qkv", "o_proj", "gate_up", "down")

    def __getstate__(self) -> dict:
        return _dense_state(self, self._PACKED)

    def __setstate__(self, state: dict) -> None:
        _repack_state(self, state)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                fb: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        # x: [T, H] residual stream
        T = x.shape[0]
        packed = self.packed
        h = rms_norm(x, self.input_norm, self.eps)
        qkv = _linear_packed(h, self.qkv, self.qkv_bias) if packed \
            else _mm(h, self.qkv, self.qkv_bias)                      # [T, (Hq + 2Hkv) * D]
        n_qk = self.n_q + self.n_kv
        qk = qkv[:, : n_qk * self.d].view(T, n_qk, self.d)           # [T, Hq + Hkv, D]
        v = qkv[:, n_qk * self.d:].view(T, self.n_kv, self.d)        # [T, Hkv, D]
        if self.qk_norm is not None:
            qk = rms_norm(qk, None, self.eps) * self.qk_norm         # per-head norm over D
        qk = Rotary.apply(qk, cos, sin)
        q, k = qk[:, : self.n_q], qk[:, self.n_q:]
        o = backend.forward(q, k, v, self.spec, fb)                   # [T, Hq, D]
        o = o.reshape(T, self.n_q * self.d)
        x = _linear_packed(o, self.o_proj, residual=x) if packed else torch.addmm(x, o, self.o_proj)
        h = rms_norm(x, self.post_norm, self.eps)
        gu = _linear_packed(h, self.gate_up) if packed else h @ self.gate_up   # [T, 2I]
        act = F.silu(gu[:, : self.inter], inplace=True)               # [T, I] view of gu
        act.mul_(gu[:, self.inter:])                                  # silu(gate) * up, in place
        if packed:
            return _linear_packed(act, self.down, residual=x)
        return torch.addmm(x, act, self.down.t())


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
        # lm_head: [V, H] (F.linear layout, the embedding itself when tied). On CPU a second copy
        # is worth its memory: in fp32 an oneDNN-packed one (lm_head_packed; see _linear_packed),
        # else a transposed lm_head_t: [H, V]: for a few rows (decode of a small batch) the vocab
        # GEMV runs ~2x faster as x @ W; from ~8 rows on F.linear over [V, H] is ~1.5x faster.
        head = self.embed if arch.tie_word_embeddings else _param(cvt(get("lm_head.weight")))
        self.lm_head = head
        self.lm_head_packed = _packed(head) if _use_packed(head) else None
        self.lm_head_t = None if (self.lm_head_packed is not None or (
            arch.tie_word_embeddings and self.device.type == "cuda")) else _param(head.t())
        scale = arch.head_dim ** -0.5
        self.specs = [AttnSpec(i, arch.num_q_heads, arch.num_kv_heads, arch.head_dim, scale,
                               arch.layer_window(i)) for i in range(arch.num_layers)]
        self.layers = nn.ModuleList(
            LlamaLayer(arch, self.specs[i], _layer_tensors(arch, i, get, cvt))
            for i in range(arch.num_layers))
        inv = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling, rope_freq_factors)
        self.rotary = Rotary(inv, arch.max_position, self.device, dtype)
        if self.lm_head_packed is not None:
            self._hugepages()

    def __getstate__(self) -> dict:
        return _dense_state(self, ("lm_head_packed",))

    def __setstate__(self, state: dict) -> None:
        _repack_state(self, state)
        if self.lm_head_packed is not None:
            self._hugepages()

    def _hugepages(self) -> None:
        _collapse_to_hugepages([self.lm_head_packed] + [w for layer in self.layers if layer.packed
                               for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)])

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, backend: AttentionBackend,
                return_all_logits: bool = False) -> torch.Tensor:
        """Logits [B, V] at ``fb.last_token_indices`` or [T, V] with ``return_all_logits``
        (float32). ``backend.init_forward(fb)`` must have run for this step."""
        x = F.embedding(fb.input_ids, self.embed)                    # [T, H]
        cos, sin = self.rotary.tables(fb.positions)                   # [T, 1, D/2]
        for layer in self.layers:
            x = layer(x, cos, sin, fb, backend)
        if not return_all_logits and x.shape[0] != fb.batch_size:    # T == B: one token each
            x = x[fb.last_token_indices]                              # [B, H]
        x = rms_norm(x, self.norm, self.arch.rms_norm_eps)
        if self.lm_head_packed is not None:
            logits = _linear_packed(x, self.lm_head_packed)
        elif self.lm_head_t is not None and x.shape[0] < _HEAD_GEMM_ROWS:
            logits = x @ self.lm_head_t
        else:
            logits = F.linear(x, self.lm_head)
        return logits.float()                                         # [B|T, V]


_HEAD_GEMM_ROWS = 4  # from this many rows on, the [V, H] layout wins for the vocab projection


def _mm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [T, K] @ w: [K, N] (+ bias [N]) -> [T, N]."""
    return x @ w if bias is None else torch.addmm(bias, x, w)


def _layer_tensors(arch: ModelArchConfig, i: int, get: GetTensor, cvt) -> dict[str, torch.Tensor | None]:
    """Fused tensors of layer ``i`` from its HF-named pieces; matrices in F.linear's [N, K] layout."""
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
        "qkv": cvt(torch.cat([q, k, v], 0)),                                           # [N, K]
        "o_proj": cvt(get(att + "o_proj.weight")),
        "gate_up": cvt(torch.cat([get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")], 0)),
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
