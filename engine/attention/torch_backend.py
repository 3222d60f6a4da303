"""TorchAttentionBackend: paged attention in plain torch (the CPU hot path).

A step's sequences are split once, in :meth:`init_forward`, into
- *decode rows* (exactly one new token): batched. Per attention window (None = full) one padded
  slot table ``[Bd, L]`` (padding -> slot 0) and a validity mask (None when every row has all
  L keys) are built once per step; each layer then does one
  ``index_select`` gather ``k_buf -> [Bd, L, Hkv, D]`` (a row-wise memcpy; advanced indexing
  ``k_buf[rows]`` is ~4x slower on CPU) and one 4-D SDPA call with a ``[Bd, 1, 1, L]`` mask and
  grouped-query heads (``enable_gqa``; q head h reads kv head h // (Hq // Hkv)), so no Python loop
  over requests per layer. A sliding window W gathers only the last ``min(L, W)`` positions.
  Full-attention layers of the plain pool skip the gather while the decode batch is unchanged:
  the backend keeps a per-layer mirror ``[Bd, Hkv, cap, D]`` of the batch's K/V (see
  :class:`_DecodeMirror`), rebuilt by one gather when the batch changes and otherwise only
  appended to (each row's new token), so a steady decode step reads each layer's KV once, in
  place. SDPA's output does not depend on the K/V memory layout (checked bitwise), so both paths
  give identical results.
- *extend rows* (a prompt chunk): one SDPA call per sequence over its gathered prefix + new keys,
  with a causal mask offset by the prefix length (and the window, if any); a sequence without a
  prefix attends to the new K/V directly (no gather) with ``is_causal``. Prefill is matmul-bound.

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
    decode_min_len: int
    extends: list[_Extend]
    # window -> (slots [Bd, L] int64, valid [Bd, 1, 1, L] bool | None when every key is valid);
    # built lazily, once per step
    decode_tables: dict = field(default_factory=dict)
    # (i, window) -> (slots [Lk] int64, mask [n, Lk] bool | None for plain causal)
    extend_tables: dict = field(default_factory=dict)
    # (table key, index_map data_ptr) -> rows after index_map
    mapped: dict = field(default_factory=dict)
    # decode mirror plan for this step: None (not decided yet), "off", "append" or "rebuild"
    mirror: str | None = None
    mirror_rows: torch.Tensor | None = None  # [Bd * Hkv] rows of a mirror buffer's [-1, D] view
                                             # that take the new tokens' K/V (append)


_MIRROR_MAX_BYTES = 512 * 2**20  # the decode mirror never holds more than this (else: gather)


@dataclass
class _DecodeMirror:
    """A contiguous copy of the current decode batch's K/V, for full-attention layers of the
    plain pool (``index_map`` None, no window). Row b, position p of a layer's ``k``/``v``
    ``[Bd, Hkv, cap, D]`` holds the K/V at slot ``table[b, p]`` (``table``: the step's padded slot
    table ``[Bd, L]``; padding slot 0 -> zeros). Positions at or past a row's length hold finite
    values that the mask hides. It is valid for the next step only if that step has the same pool,
    the same decode rows in the same order, each exactly one token longer, every layer was written,
    and the slot table is unchanged but for the new tokens -- checked every step; anything else
    rebuilds it (one gather per layer, as without the mirror)."""

    pool: object                                 # the KV pool and req_to_token it mirrors
    req_to_token: torch.Tensor
    rows: tuple                                  # decode rows (req_to_token row ids), in order
    table: torch.Tensor                          # [Bd, L] int64 slots held
    lens: torch.Tensor                           # [Bd] lengths held
    cap: int
    bufs: dict = field(default_factory=dict)     # layer_id -> (k, v) [Bd, Hkv, cap, D]
    filled: set = field(default_factory=set)     # layers whose buffers match ``table``


class TorchAttentionBackend:
    """Implements :class:`tandem.engine.attention.base.AttentionBackend` with torch ops."""

    def __init__(self) -> None:
        self._mirror: _DecodeMirror | None = None

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
        dec_lens = fb.seq_lens_cpu if fb.is_decode else [fb.seq_lens_cpu[i] for i in dec]
        max_len, min_len = max(dec_lens, default=0), min(dec_lens, default=0)
        fb.attn_meta[_META_KEY] = _StepMeta(decode_tok, rows, lens, max_len, min_len, extends)
        if not dec:
            self._mirror = None   # no decode batch left to mirror: free it

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                fb: ForwardBatch) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> o: [T, Hq, D]."""
        meta: _StepMeta = fb.attn_meta[_META_KEY]
        lkv = fb.kv_pool.layer(spec.layer_id)
        loc = self._mapped(meta, ("out",), fb.out_cache_loc, lkv.index_map)
        lkv.k[loc] = k.to(lkv.k.dtype)
        lkv.v[loc] = v.to(lkv.v.dtype)

        if meta.decode_tok is None:  # pure decode step: T == B
            return self._decode(q, k, v, spec, fb, meta, lkv)
        if not meta.decode_tok.numel() and len(meta.extends) == 1:  # one prompt chunk: T == n
            return self._extend(q, k, v, spec, fb, meta, lkv, 0, meta.extends[0])
        o = torch.empty_like(q)
        if meta.decode_tok.numel():
            dt = meta.decode_tok
            o[dt] = self._decode(q[dt], k[dt], v[dt], spec, fb, meta, lkv)
        for i, e in enumerate(meta.extends):
            sl = slice(e.start, e.start + e.n)
            o[sl] = self._extend(q[sl], k[sl], v[sl], spec, fb, meta, lkv, i, e)
        return o

    # -- decode rows ---------------------------------------------------------------------------
    def _decode_table(self, fb: ForwardBatch, meta: _StepMeta, window: int | None):
        """(slots [Bd, L], mask [Bd, 1, 1, L] or None) for this window; row i's keys are at
        positions ``start_i .. start_i+L-1`` (padding past its length -> slot 0, masked out)."""
        tab = meta.decode_tables.get(window)
        if tab is None:
            lens, dev = meta.decode_lens, meta.decode_lens.device
            length = meta.decode_max_len if window is None else min(meta.decode_max_len, window)
            pos = torch.arange(length, device=dev)[None, :]                  # [1, L]
            if window is not None:
                pos = pos + (lens - window).clamp_(min=0)[:, None]            # [Bd, L]
            valid = pos < lens[:, None]                                      # [Bd, L]
            slots = fb.req_to_token[meta.decode_rows[:, None], pos.expand(len(lens), length)]
            mask = None
            if meta.decode_min_len < length:   # some row has fewer than L keys
                slots = torch.where(valid, slots, 0)
                mask = valid[:, None, None, :]
            tab = meta.decode_tables[window] = (slots.to(torch.int64).contiguous(), mask)
        return tab

    def _decode(self, q, k_new, v_new, spec, fb, meta, lkv):
        # q: [Bd, Hq, D]; k_new, v_new: [Bd, Hkv, D] (written to the pool already) -> o: [Bd, Hq, D]
        slots, mask = self._decode_table(fb, meta, spec.sliding_window)
        kv = None
        if spec.sliding_window is None and lkv.index_map is None:
            kv = self._mirrored(q, k_new, v_new, spec, fb, meta, lkv, slots)
        if kv is None:
            rows = self._mapped(meta, ("d", spec.sliding_window), slots.view(-1), lkv.index_map)
            shape = tuple(slots.shape) + tuple(lkv.k.shape[1:])
            kv = (lkv.k.index_select(0, rows).view(shape).to(q.dtype).transpose(1, 2),
                  lkv.v.index_select(0, rows).view(shape).to(q.dtype).transpose(1, 2))
        o = F.scaled_dot_product_attention(
            q[:, :, None], kv[0], kv[1], attn_mask=mask, scale=spec.scale,
            enable_gqa=spec.num_q_heads != spec.num_kv_heads)                # [Bd, Hq, 1, D]
        return o[:, :, 0]

    def _mirror_plan(self, fb: ForwardBatch, meta: _StepMeta, slots: torch.Tensor, lkv,
                     dtype: torch.dtype) -> None:
        """Decide, once per step, whether the decode mirror is appended to, rebuilt, or off."""
        m, lens = self._mirror, meta.decode_lens
        bd, length = slots.shape
        layers = len(getattr(fb.kv_pool, "layer_ids", ()))
        per_pos = 2 * lkv.k[0].numel() * torch.empty(0, dtype=dtype).element_size()
        cap = m.cap if m is not None and m.cap >= length else -(-(length + 64) // 64) * 64
        if not layers or bd * cap * per_pos * layers > _MIRROR_MAX_BYTES:
            self._mirror, meta.mirror = None, "off"
            return
        rows = tuple(meta.decode_rows.tolist())
        if (m is not None and m.pool is fb.kv_pool and m.req_to_token is fb.req_to_token
                and m.rows == rows and m.cap >= length and m.bufs and m.filled == set(m.bufs)
                and m.table.shape[1] == length - 1 and torch.equal(lens, m.lens + 1)):
            pos = lens - 1
            rest = slots.clone()
            rest[torch.arange(bd, device=slots.device), pos] = 0
            if not rest[:, -1].any() and torch.equal(rest[:, :-1], m.table):
                m.table, m.lens, m.filled = slots, lens, set()
                # buffer [Bd, Hkv, cap, D] viewed as [-1, D]: row (b * Hkv + h) * cap + pos[b]
                hkv = lkv.k.shape[1]
                bh = torch.arange(bd * hkv, device=slots.device).view(bd, hkv)
                meta.mirror, meta.mirror_rows = "append", (bh * m.cap + pos[:, None]).view(-1)
                return
        if m is None or m.cap != cap or m.table.shape[0] != bd:
            m = _DecodeMirror(fb.kv_pool, fb.req_to_token, rows, slots, lens, cap)  # new buffers
        m.pool, m.req_to_token, m.rows = fb.kv_pool, fb.req_to_token, rows
        m.table, m.lens, m.filled = slots, lens, set()
        self._mirror, meta.mirror = m, "rebuild"

    def _mirrored(self, q, k_new, v_new, spec, fb, meta, lkv, slots):
        """(k, v) ``[Bd, Hkv, L, D]`` views of the decode mirror for this layer, updated for this
        step; None when the mirror is off."""
        if meta.mirror is None:
            self._mirror_plan(fb, meta, slots, lkv, q.dtype)
        m = self._mirror
        if meta.mirror == "off" or m is None:
            return None
        lid, length = spec.layer_id, slots.shape[1]
        bufs = m.bufs.get(lid)
        if meta.mirror == "append":
            if bufs is None:   # a layer the last step did not mirror: cannot append
                return None
            kb, vb = bufs
            d, idx = kb.shape[-1], meta.mirror_rows
            # exactly what a gather would read back: the pool dtype's value, in q's dtype
            kb.view(-1, d).index_copy_(0, idx, k_new.to(lkv.k.dtype).to(q.dtype).reshape(-1, d))
            vb.view(-1, d).index_copy_(0, idx, v_new.to(lkv.v.dtype).to(q.dtype).reshape(-1, d))
        else:
            if bufs is None:
                shape = (slots.shape[0], lkv.k.shape[1], m.cap, lkv.k.shape[2])
                bufs = m.bufs[lid] = (torch.zeros(shape, dtype=q.dtype, device=q.device),
                                      torch.zeros(shape, dtype=q.dtype, device=q.device))
            kb, vb = bufs
            rows, shape = slots.view(-1), tuple(slots.shape) + tuple(lkv.k.shape[1:])
            kb[:, :, :length] = lkv.k.index_select(0, rows).view(shape).transpose(1, 2)
            vb[:, :, :length] = lkv.v.index_select(0, rows).view(shape).transpose(1, 2)
        m.filled.add(lid)
        return kb[:, :, :length], vb[:, :, :length]

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

    def _extend(self, q, k_new, v_new, spec, fb, meta, lkv, i, e):
        # q: [n, Hq, D]; k_new, v_new: [n, Hkv, D] (this sequence's new K/V) -> o: [n, Hq, D]
        slots, mask = self._extend_table(fb, meta, i, e, spec.sliding_window)
        if e.prefix == 0 and lkv.k.dtype == q.dtype:
            # No prefix: the keys are exactly the new tokens' K/V (just written to the pool).
            k, v = k_new, v_new                                               # [n, Hkv, D]
        else:
            rows = self._mapped(meta, ("e", i, spec.sliding_window), slots, lkv.index_map)
            k = lkv.k.index_select(0, rows).to(q.dtype)                      # [Lk, Hkv, D]
            v = lkv.v.index_select(0, rows).to(q.dtype)
        # 4-D inputs: torch's fused CPU (flash) kernel only takes [B, H, L, D]; 3-D falls back to
        # the unfused math path (measured ~10x slower on a 2048-token prefill).
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=spec.scale,
            enable_gqa=spec.num_q_heads != spec.num_kv_heads)                 # [1, Hq, n, D]
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
