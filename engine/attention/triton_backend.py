"""TritonAttentionBackend: paged attention with triton kernels (triton_kernels/)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from tandem.engine.attention.base import AttnSpec
from tandem.engine.attention.split_rule import DEFAULT_SPLITS, SplitTable, choose_splits
from tandem.engine.attention.triton_kernels import Tiles, decode_attention, extend_attention, store_kv
from tandem.engine.forward_batch import ForwardBatch

META_KEY = "triton"


@dataclass(frozen=True)
class TritonAttnMeta:
    """Per-step metadata, stored at ``fb.attn_meta["triton"]`` by init_forward."""

    is_decode: bool
    max_seq_len: int
    max_extend_len: int
    num_sms: int | None
    kv_span: int


def choose_kv_splits(span: int, max_kv_splits: int, min_split_tokens: int) -> int:
    """Splits per decode sequence in the interpreter (no tuning table): no split shorter than
    ``min_split_tokens`` keys of ``span``, at most ``max_kv_splits``."""
    return max(1, min(max_kv_splits, triton.cdiv(max(span, 1), min_split_tokens)))


class TritonAttentionBackend:
    """Triton implementation of :class:`~tandem.engine.attention.base.AttentionBackend`."""

    name = "triton"

    capturable = True

    def __init__(self, max_kv_splits: int = 16, min_split_tokens: int = 128, *,
                 num_kv_splits: int | None = None, decode_tiles: Tiles | None = None,
                 extend_tiles: Tiles | None = None, split_table: SplitTable | None = None):
        if max_kv_splits < 1 or min_split_tokens < 1 or (num_kv_splits is not None and num_kv_splits < 1):
            raise ValueError(f"max_kv_splits={max_kv_splits}, min_split_tokens={min_split_tokens} and "
                             f"num_kv_splits={num_kv_splits} must be >= 1")
        if extend_tiles is not None and not extend_tiles.block_m:
            raise ValueError(f"extend_tiles needs block_m, got {extend_tiles}")
        self.max_kv_splits = max_kv_splits
        self.min_split_tokens = min_split_tokens
        self.fixed_kv_splits = num_kv_splits
        self.split_table = split_table
        self.decode_tiles = decode_tiles
        self.extend_tiles = extend_tiles
        self._num_sms: dict[int, int] = {}

    def init_forward(self, fb: ForwardBatch) -> None:
        """``fb.attn_meta["triton"]``."""
        device = fb.seq_lens.device
        num_sms = None
        if device.type == "cuda":
            idx = device.index if device.index is not None else torch.cuda.current_device()
            if idx not in self._num_sms:
                self._num_sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
            num_sms = self._num_sms[idx]
        max_seq_len = max(fb.seq_lens_cpu, default=0)
        fb.attn_meta[META_KEY] = TritonAttnMeta(
            is_decode=fb.is_decode,
            max_seq_len=max_seq_len,
            max_extend_len=max(fb.extend_lens_cpu, default=0),
            num_sms=num_sms,
            kv_span=int(fb.req_to_token.shape[1]) if num_sms is not None else max_seq_len,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                fb: ForwardBatch) -> torch.Tensor:
        """q: [T, H_q, D]; k, v: [T, H_kv, D] -> o: [T, H_q, D]."""
        meta = fb.attn_meta.get(META_KEY)
        if meta is None:
            raise ValueError("TritonAttentionBackend.forward called before init_forward(fb) for this batch")
        T = q.shape[0]
        want_q, want_kv = (spec.num_q_heads, spec.head_dim), (T, spec.num_kv_heads, spec.head_dim)
        if q.shape[1:] != want_q or k.shape != want_kv or v.shape != want_kv:
            raise ValueError(
                f"layer {spec.layer_id}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not "
                f"match H_q={spec.num_q_heads}, H_kv={spec.num_kv_heads}, D={spec.head_dim}")
        if T != fb.num_tokens:
            raise ValueError(f"layer {spec.layer_id}: q has {T} tokens, the batch has {fb.num_tokens}")
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        layer = fb.kv_pool.layer(spec.layer_id)
        store_kv(k, v, layer.k, layer.v, fb.out_cache_loc, layer.index_map)
        return self.attend(q, k, v, spec, fb)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
               fb: ForwardBatch) -> torch.Tensor:
        """:meth:`forward` without the store: this step's K/V are already in the pool (the GPU layer
        path's ``rope_store`` wrote them; prefill also reads the new ``k``, ``v``). q: [T, H_q, D]
        (rows may be strided; last dim contiguous) -> o: [T, H_q, D]."""
        meta = fb.attn_meta.get(META_KEY)
        if meta is None:
            raise ValueError("TritonAttentionBackend.attend called before init_forward(fb) for this batch")
        T = q.shape[0]
        layer = fb.kv_pool.layer(spec.layer_id)
        o = torch.empty((T, spec.num_q_heads, spec.head_dim), dtype=q.dtype, device=q.device)
        if meta.is_decode:
            decode_attention(
                q, layer.k, layer.v, o, fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                spec.scale, self.num_kv_splits(meta, spec, fb.batch_size),
                spec.sliding_window, layer.index_map, self.decode_tiles)
        else:
            if k.dtype != layer.k.dtype:
                k, v = k.to(layer.k.dtype), v.to(layer.v.dtype)
            extend_attention(
                q, k, v, o, layer.k, layer.v, fb.req_to_token, fb.req_pool_indices,
                fb.prefix_lens, fb.extend_lens, fb.extend_starts, meta.max_extend_len,
                spec.scale, spec.sliding_window, layer.index_map, self.extend_tiles)
        return o

    def num_kv_splits(self, meta: TritonAttnMeta, spec: AttnSpec, batch_size: int) -> int:
        """Splits per decode sequence of this layer over ``meta.kv_span`` keys, clipped to the
        layer's window (the class docstring says which rule)."""
        if self.fixed_kv_splits is not None:
            return self.fixed_kv_splits
        span = meta.kv_span
        if spec.sliding_window is not None:
            span = min(span, spec.sliding_window)
        if self.split_table is not None or meta.num_sms is not None:
            return choose_splits(self.split_table or DEFAULT_SPLITS, span, batch_size, spec.num_kv_heads)
        return choose_kv_splits(span, self.max_kv_splits, self.min_split_tokens)
