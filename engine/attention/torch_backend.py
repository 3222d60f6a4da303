"""TorchAttentionBackend: paged attention in plain torch (the CPU hot path).

A step's sequences are split once, in :meth:`init_forward`, into
- *decode rows* (exactly one new token): batched. Per attention window (None = full) one padded
  slot table ``[Bd, L]`` (padding -> slot 0) and a validity mask are built once per step; each
  layer then does one gather ``k_buf[rows] -> [Bd, L, Hkv, D]`` and one 4-D SDPA call with a
  ``[Bd, 1, 1, L]`` mask and grouped-query heads (``enable_gqa``; q head h reads kv head
  h // (Hq // Hkv)), so no Python loop over requests per layer.
  A sliding window W gathers only the last ``min(L, W)`` positions.
- *extend rows* (a prompt chunk): one SDPA call per sequence over its gathered prefix + new keys,
  with a causal mask offset by the prefix length (and the window, if any). Prefill is matmul-bound.

The layer's K/V are written first (``fb.kv_pool.layer(id)``; rows = ``index_map[slots]`` when the
layer's pool has an index map), then read back, so new tokens attend to themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.engine.attention.base import AttnSpec
from tandem.engine.forward_batch import ForwardBatch

_META_KEY = "torch"


@dataclass
class _Extend:
    """One extend sequence: new tokens ``start .. start+n-1`` at positions ``prefix .. prefix+n-1``."""
    row: int
    start: int
    n: int
    prefix: int
    seq_len: int


@dataclass
class _StepMeta:
    decode_tok: torch.Tensor | None          # [Bd] token index in T of each decode row (None: all T)
    decode_rows: torch.Tensor                # [Bd] req_to_token rows
    decode_lens: torch.Tensor                # [Bd] seq lens (device)
    decode_max_len: int
    extends: list[_Extend]
    # window -> (slots [Bd, L] int64, valid [Bd, L] bool); built lazily, once per step
    decode_tables: dict = field(default_factory=dict)
    # (i, window) -> (slots [Lk] int64, mask [n, Lk] bool | None for plain causal)
    extend_tables: dict = field(default_factory=dict)
    # (table key, index_map data_ptr) -> rows after index_map
    mapped: dict = field(default_factory=dict)


class TorchAttentionBackend:
    """Implements :class:`tandem.engine.attention.base.AttentionBackend` with torch ops."""

    def init_forward(self, fb: ForwardBatch) -> None:
        ext = fb.extend_lens_cpu
        if fb.is_decode:
            dec = list(range(fb.batch_size))
            decode_tok = None
            rows, lens = fb.req_pool_indices, fb.seq_lens
        else:
            dec = [i for i, n in enumerate(ext) if n == 1]
            sel = torch.tensor(dec, dtype=torch.int64, device=fb.seq_lens.device)
            decode_tok = fb.extend_starts[sel]
            rows, lens = fb.req_pool_indices[sel], fb.seq_lens[sel]
        dec_set = set(dec)
        starts = fb.extend_starts.tolist() if len(dec_set) < fb.batch_size else []
        row_list = fb.req_pool_indices.tolist() if starts else []
        extends = [_Extend(row_list[i], starts[i], ext[i], fb.prefix_lens_cpu[i], fb.seq_lens_cpu[i])
                   for i in range(fb.batch_size) if i not in dec_set]
        max_len = max((fb.seq_lens_cpu[i] for i in dec), default=0)
        fb.attn_meta[_META_KEY] = _StepMeta(decode_tok, rows, lens, max_len, extends)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                fb: ForwardBatch) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> o: [T, Hq, D]."""
        meta: _StepMeta = fb.attn_meta[_META_KEY]
        lkv = fb.kv_pool.layer(spec.layer_id)
        loc = fb.out_cache_loc if lkv.index_map is None else lkv.index_map[fb.out_cache_loc]
        lkv.k[loc] = k.to(lkv.k.dtype)
        lkv.v[loc] = v.to(lkv.v.dtype)

        if meta.decode_tok is None:  # pure decode step: T == B
            return self._decode(q, spec, fb, meta, lkv)
        o = torch.empty_like(q)
        if meta.decode_tok.numel():
            o[meta.decode_tok] = self._decode(q[meta.decode_tok], spec, fb, meta, lkv)
        for i, e in enumerate(meta.extends):
            o[e.start:e.start + e.n] = self._extend(q[e.start:e.start + e.n], spec, fb, meta, lkv, i, e)
        return o

    # -- decode rows ---------------------------------------------------------------------------
    def _decode_table(self, fb: ForwardBatch, meta: _StepMeta, window: int | None):
        """(slots [Bd, L], valid [Bd, L]) for this window; key positions ``start .. start+L-1``."""
        tab = meta.decode_tables.get(window)
        if tab is None:
            lens, dev = meta.decode_lens, meta.decode_lens.device
            length = meta.decode_max_len if window is None else min(meta.decode_max_len, window)
            pos = torch.arange(length, device=dev)[None, :]                  # [1, L]
            if window is not None:
                pos = pos + (lens - window).clamp_(min=0)[:, None]            # [Bd, L]
            valid = pos < lens[:, None]                                      # [Bd, L]
            pos = torch.where(valid, pos, 0)
            slots = fb.req_to_token[meta.decode_rows[:, None], pos].to(torch.int64)
            slots = torch.where(valid, slots, 0)
            tab = meta.decode_tables[window] = (slots, valid)
        return tab

    def _decode(self, q, spec, fb, meta, lkv):
        # q: [Bd, Hq, D] -> o: [Bd, Hq, D]
        slots, valid = self._decode_table(fb, meta, spec.sliding_window)
        rows = self._mapped(meta, ("d", spec.sliding_window), slots, lkv.index_map)
        k = lkv.k[rows].to(q.dtype).transpose(1, 2)                          # [Bd, Hkv, L, D]
        v = lkv.v[rows].to(q.dtype).transpose(1, 2)                          # [Bd, Hkv, L, D]
        o = F.scaled_dot_product_attention(
            q[:, :, None], k, v, attn_mask=valid[:, None, None, :], scale=spec.scale,
            enable_gqa=spec.num_q_heads != spec.num_kv_heads)                # [Bd, Hq, 1, D]
        return o[:, :, 0]

    # -- extend rows ---------------------------------------------------------------------------
    def _extend_table(self, fb, meta, i: int, e: _Extend, window: int | None):
        """Slots of the keys this sequence's new queries may see, and their [n, Lk] mask."""
        tab = meta.extend_tables.get((i, window))
        if tab is None:
            kstart = 0 if window is None else max(0, e.prefix - window + 1)
            slots = fb.req_to_token[e.row, kstart:e.seq_len].to(torch.int64)  # [Lk]
            mask = None
            if e.prefix > 0 or window is not None:
                dev = slots.device
                qpos = torch.arange(e.prefix, e.seq_len, device=dev)[:, None]  # [n, 1]
                kpos = torch.arange(kstart, e.seq_len, device=dev)[None, :]    # [1, Lk]
                mask = kpos <= qpos
                if window is not None:
                    mask &= kpos > qpos - window
            tab = meta.extend_tables[(i, window)] = (slots, mask)
        return tab

    def _extend(self, q, spec, fb, meta, lkv, i, e):
        # q: [n, Hq, D] -> o: [n, Hq, D]
        slots, mask = self._extend_table(fb, meta, i, e, spec.sliding_window)
        rows = self._mapped(meta, ("e", i, spec.sliding_window), slots, lkv.index_map)
        # 4-D inputs: torch's fused CPU (flash) kernel only takes [B, H, L, D]; 3-D falls back to
        # the unfused math path (measured ~10x slower on a 2048-token prefill).
        k = lkv.k[rows].to(q.dtype).transpose(0, 1)[None]                     # [1, Hkv, Lk, D]
        v = lkv.v[rows].to(q.dtype).transpose(0, 1)[None]                     # [1, Hkv, Lk, D]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=mask is None,
            scale=spec.scale, enable_gqa=spec.num_q_heads != spec.num_kv_heads)  # [1, Hq, n, D]
        return o[0].transpose(0, 1)

    @staticmethod
    def _mapped(meta: _StepMeta, key, slots: torch.Tensor, index_map: torch.Tensor | None):
        """Pool rows of ``slots`` (through ``index_map`` when the layer's pool has one)."""
        if index_map is None:
            return slots
        ck = (key, index_map.data_ptr())
        rows = meta.mapped.get(ck)
        if rows is None:
            rows = meta.mapped[ck] = index_map[slots]
        return rows
