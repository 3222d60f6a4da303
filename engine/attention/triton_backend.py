"""TritonAttentionBackend: paged attention with triton kernels (triton_kernels/).

Works on CUDA tensors (compiled kernels) and, when ``TRITON_INTERPRET=1`` was set before triton
was first imported, on CPU tensors through triton's interpreter (slow: tests only; CPU serving
uses the torch backend). Per layer and step, :meth:`forward`:

1. stores the new K/V at ``fb.out_cache_loc`` (through the layer's ``index_map``, if any);
2. runs the split-KV decode kernels when every sequence adds one token (``fb.is_decode``),
   else the extend kernel (prefill chunks, or a mix of chunks and decodes);
3. returns ``o: [T, H_q, D]`` in q's dtype.

:meth:`init_forward` reads only host-side lists, so neither method synchronizes with the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from tandem.engine.attention.base import AttnSpec
from tandem.engine.attention.triton_kernels import decode_attention, extend_attention, store_kv
from tandem.engine.forward_batch import ForwardBatch

META_KEY = "triton"


@dataclass(frozen=True)
class TritonAttnMeta:
    """Per-step metadata, stored at ``fb.attn_meta["triton"]`` by init_forward."""

    is_decode: bool
    max_seq_len: int
    max_extend_len: int
    num_sms: int | None  # streaming multiprocessors of the device; None on the CPU


class TritonAttentionBackend:
    """Triton implementation of :class:`~tandem.engine.attention.base.AttentionBackend`.

    ``max_kv_splits`` caps how many ranges a decode sequence's keys are split into;
    ``min_split_tokens`` is the fewest keys worth a split of their own. The decode kernel uses
    just enough splits to give the GPU about two programs per SM.
    """

    def __init__(self, max_kv_splits: int = 16, min_split_tokens: int = 128):
        if max_kv_splits < 1 or min_split_tokens < 1:
            raise ValueError(f"max_kv_splits={max_kv_splits} and min_split_tokens={min_split_tokens} "
                             "must be >= 1")
        self.max_kv_splits = max_kv_splits
        self.min_split_tokens = min_split_tokens
        self._num_sms: dict[int, int] = {}

    def init_forward(self, fb: ForwardBatch) -> None:
        device = fb.seq_lens.device
        num_sms = None
        if device.type == "cuda":
            idx = device.index if device.index is not None else torch.cuda.current_device()
            if idx not in self._num_sms:
                self._num_sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
            num_sms = self._num_sms[idx]
        fb.attn_meta[META_KEY] = TritonAttnMeta(
            is_decode=fb.is_decode,
            max_seq_len=max(fb.seq_lens_cpu, default=0),
            max_extend_len=max(fb.extend_lens_cpu, default=0),
            num_sms=num_sms,
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
        o = torch.empty((T, spec.num_q_heads, spec.head_dim), dtype=q.dtype, device=q.device)
        if meta.is_decode:
            decode_attention(
                q, layer.k, layer.v, o, fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                spec.scale, self.num_kv_splits(meta, spec, fb.batch_size),
                spec.sliding_window, layer.index_map)
        else:
            # read the new tokens at the pool's precision, as later steps will read them
            if k.dtype != layer.k.dtype:
                k, v = k.to(layer.k.dtype), v.to(layer.v.dtype)
            extend_attention(
                q, k, v, o, layer.k, layer.v, fb.req_to_token, fb.req_pool_indices,
                fb.prefix_lens, fb.extend_lens, fb.extend_starts, meta.max_extend_len,
                spec.scale, spec.sliding_window, layer.index_map)
        return o

    def num_kv_splits(self, meta: TritonAttnMeta, spec: AttnSpec, batch_size: int) -> int:
        """Splits per decode sequence: enough to fill the GPU, none shorter than min_split_tokens."""
        span = meta.max_seq_len
        if spec.sliding_window is not None:
            span = min(span, spec.sliding_window)
        n = min(self.max_kv_splits, triton.cdiv(max(span, 1), self.min_split_tokens))
        if meta.num_sms is not None:
            programs_per_split = max(1, batch_size * spec.num_kv_heads)
            n = min(n, triton.cdiv(2 * meta.num_sms, programs_per_split))
        return max(1, n)
