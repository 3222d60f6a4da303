"""A small reference K-quantizer (Q4_K, Q5_K, Q6_K) for test fixtures: gguf-py dequantizes
K-quants but cannot make them, and llama.cpp's quantize tool is not installed.

Not llama.cpp's search (``make_qkx2_quants`` iterates on each sub-block's scale and min); a
plain min/max fit per sub-block, scales then quantized to 6 bits (Q6_K: 8) against the
super-block's float16 ``d`` / ``dmin``. The bytes are laid out exactly as GGML's (checked by
decoding them with ``gguf.quants.dequantize``), which is all the loader and kernels see.
``quantize(x, kind)`` also takes the 32-weight types gguf-py quantizes itself (Q4_0 .. Q8_0).
"""

from __future__ import annotations

import numpy as np


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0.0, a / np.where(b == 0, 1.0, b))


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """(sc [B, 8], m [B, 8]) 6-bit -> the 12 scale bytes [B, 12]."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    d = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    m = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    md = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([d, m, md], axis=-1)


def _q45_k(x: np.ndarray, nmax: int) -> np.ndarray:
    b = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(b.min(-1), 0.0)                                  # [B, 8]
    scale = (b.max(-1) - lo) / nmax
    d = _f16(scale.max(-1) / 63).astype(np.float32)                  # [B]
    dmin = _f16(-lo.min(-1) / 63).astype(np.float32)
    sc = np.clip(np.rint(_div(scale, d[:, None])), 0, 63)
    mn = np.clip(np.rint(_div(-lo, dmin[:, None])), 0, 63)
    s, o = d[:, None] * sc, dmin[:, None] * mn
    q = np.clip(np.rint(_div(b + o[..., None], s[..., None])), 0, nmax).astype(np.uint8)   # [B, 8, 32]
    head = np.concatenate([_f16(d).view(np.uint8).reshape(-1, 2), _f16(dmin).view(np.uint8).reshape(-1, 2),
                           _pack_k_scales(sc, mn)], axis=-1)
    lo4 = q & 0x0F
    qs = (lo4[:, 0::2] | (lo4[:, 1::2] << 4)).reshape(-1, 128)     # chunk j: sub-blocks 2j, 2j + 1
    if nmax == 15:
        return np.concatenate([head, qs], axis=-1)
    hi = (q >> 4) & 1                                                 # [B, 8, 32]
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for s_ in range(8):
        qh |= hi[:, s_] << s_
    return np.concatenate([head, qh, qs], axis=-1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    b = x.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(b).max(-1) / 31                                    # [B, 16]
    d = _f16(scale.max(-1) / 127).astype(np.float32)
    sc = np.clip(np.rint(_div(scale, d[:, None])), -128, 127)
    s = d[:, None] * sc
    q = (np.clip(np.rint(_div(b, s[..., None])), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    lo, hi = q & 0x0F, q >> 4
    ql = (lo[..., :64] | (lo[..., 64:] << 4)).reshape(-1, 128)
    qh = (hi[..., 0:32] | (hi[..., 32:64] << 2) | (hi[..., 64:96] << 4) | (hi[..., 96:128] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16(d).view(np.uint8).reshape(-1, 2)],
                          axis=-1)


def quantize(x: np.ndarray, kind: str) -> np.ndarray:
    """x: [N, K] float32 -> the GGUF blocks [N, K / B * block bytes] uint8 of ``kind``."""
    import gguf

    n, k = x.shape
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        if k % 256:
            raise ValueError(f"{kind} needs K % 256 == 0, got {k}")
        raw = _q6_k(x) if kind == "Q6_K" else _q45_k(x, 15 if kind == "Q4_K" else 31)
        return raw.reshape(n, -1)
    return gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32),
                                getattr(gguf.GGMLQuantizationType, kind))


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in a *_M mix."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# llama.cpp's fallback for a row length that is not a whole number of 256-weight super-blocks
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def q4_k_m(name: str, n_layers: int) -> str:
    """The type llama.cpp's Q4_K_M gives a Llama tensor (before the row-length fallback)."""
    if name in ("output.weight", "token_embd.weight"):
        return "Q6_K"
    layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        return "Q6_K" if use_more_bits(layer, n_layers) else "Q4_K"
    return "Q4_K"


def requantize_gguf(src: str, dst: str, kind_of, blocks: dict | None = None) -> dict[str, str]:
    """Write ``dst``: ``src``'s metadata and tensors, every 2-D weight dequantized and quantized
    again as ``kind_of(name)`` (K-quants fall back as llama.cpp does where K % 256 != 0); 1-D
    tensors stay float32. Returns name -> the type written. ``blocks``: (src, name, type) -> the
    quantized blocks, filled and reused across calls (quantizing is a pure function of them)."""
    import gguf

    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), vtype, sub)
    written = {}
    for t in r.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if x.ndim < 2 or t.tensor_type.name in ("F32", "F16"):
            w.add_tensor(t.name, np.ascontiguousarray(x))
            written[t.name] = "F32"
            continue
        kind = kind_of(t.name)
        if kind.endswith("_K") and x.shape[-1] % 256:
            kind = K_FALLBACK[kind]
        key = (src, t.name, kind)
        raw = blocks.get(key) if blocks is not None else None
        if raw is None:
            raw = quantize(x.reshape(-1, x.shape[-1]), kind)
            if blocks is not None:
                blocks[key] = raw
        w.add_tensor(t.name, raw, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
        written[t.name] = kind
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
