"""TorchAttentionBackend: paged attention in plain torch (the CPU fallback where the cpu_kernel
backend's C file cannot build, and the reference it is tested beside)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.engine.attention.base import AttnSpec
from tandem.engine.forward_batch import ForwardBatch

_META_KEY = "torch"


@dataclass
class _Extend:
    """One extend sequence: new tokens ``start .. start+n-1`` at positions ``prefix ..
    prefix+n-1``."""
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
    decode_lens_cpu: list                    # [Bd] seq lens (host), for the width groups
    extends: list[_Extend]
    decode_tables: dict = field(default_factory=dict)
    extend_tables: dict = field(default_factory=dict)
    mapped: dict = field(default_factory=dict)
    mirror: str | None = None
    mirror_rows: torch.Tensor | None = None  # [Bd * Hkv] rows of a mirror buffer's [-1, D] view


_MIRROR_MAX_BYTES = 512 * 2**20
KEY_BLOCK = 64
QUERY_BLOCK = 32
_MIN_ROWS = 4


def _padded(n: int) -> int:
    return -(-n // KEY_BLOCK) * KEY_BLOCK


def _width_groups(widths: list[int], device) -> list[tuple[slice | torch.Tensor, int]]:
    if len(set(widths)) == 1:
        return [(slice(None), widths[0])]
    runs: list[tuple[int, int, int]] = []
    for i, w in enumerate(widths):
        if runs and runs[-1][2] == w:
            runs[-1] = (runs[-1][0], i + 1, w)
        else:
            runs.append((i, i + 1, w))
    if len(runs) == len(set(widths)):
        return [(slice(a, b), w) for a, b, w in runs]
    return [(torch.tensor([i for i, x in enumerate(widths) if x == w], device=device), w)
            for w in sorted(set(widths))]


@dataclass
class _DecodeMirror:
    """A contiguous copy of the current decode batch's K/V, for full-attention layers of the plain
    pool (``index_map`` None, no window)."""

    pool: object
    req_to_token: torch.Tensor
    rows: tuple
    table: torch.Tensor                          # [Bd, L] int64 slots held
    lens: torch.Tensor                           # [Bd] lengths held
    cap: int
    bufs: dict = field(default_factory=dict)
    filled: set = field(default_factory=set)


class TorchAttentionBackend:
    """Implements :class:`tandem.engine.attention.base.AttentionBackend` with torch ops."""

    name = "torch"

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
        fb.attn_meta[_META_KEY] = _StepMeta(decode_tok, rows, lens, max_len, min_len, list(dec_lens),
                                            extends)
        if not dec:
            self._mirror = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                fb: ForwardBatch) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> o: [T, Hq, D]."""
        meta: _StepMeta = fb.attn_meta[_META_KEY]
        lkv = fb.kv_pool.layer(spec.layer_id)
        loc = self._mapped(meta, ("out",), fb.out_cache_loc, lkv.index_map)
        lkv.k[loc] = k.to(lkv.k.dtype)
        lkv.v[loc] = v.to(lkv.v.dtype)

        if meta.decode_tok is None:
            return self._decode(q, k, v, spec, fb, meta, lkv)
        if not meta.decode_tok.numel() and len(meta.extends) == 1:
            return self._extend(q, k, v, spec, fb, meta, lkv, 0, meta.extends[0])
        o = torch.empty_like(q)
        if meta.decode_tok.numel():
            dt = meta.decode_tok
            o[dt] = self._decode(q[dt], k[dt], v[dt], spec, fb, meta, lkv)
        for i, e in enumerate(meta.extends):
            sl = slice(e.start, e.start + e.n)
            o[sl] = self._extend(q[sl], k[sl], v[sl], spec, fb, meta, lkv, i, e)
        return o

    def _decode_table(self, fb: ForwardBatch, meta: _StepMeta, window: int | None):
        tab = meta.decode_tables.get(window)
        if tab is None:
            lens, dev = meta.decode_lens, meta.decode_lens.device
            length = meta.decode_max_len if window is None else min(meta.decode_max_len, window)
            padded = _padded(length)
            pos = torch.arange(padded, device=dev)[None, :]                  # [1, Lp]
            if window is not None:
                pos = pos + (lens - window).clamp_(min=0)[:, None]            # [Bd, Lp]
            valid = pos < lens[:, None]                                      # [Bd, Lp]
            pos = pos[:, :length].expand(len(lens), length)
            slots = fb.req_to_token[meta.decode_rows[:, None], pos]          # [Bd, L]
            if meta.decode_min_len < length:
                slots = torch.where(valid[:, :length], slots, 0)
            widths = [_padded(n if window is None else min(n, window)) for n in meta.decode_lens_cpu]
            tab = meta.decode_tables[window] = (slots.to(torch.int64).contiguous(),
                                                valid[:, None, None, :], _width_groups(widths, dev))
        return tab

    def _decode(self, q, k_new, v_new, spec, fb, meta, lkv):
        slots, mask, groups = self._decode_table(fb, meta, spec.sliding_window)
        kv = None
        if spec.sliding_window is None and lkv.index_map is None:
            kv = self._mirrored(q, k_new, v_new, spec, fb, meta, lkv, slots)
        if kv is None:
            padded = F.pad(slots, (0, mask.shape[-1] - slots.shape[1]))     # [Bd, Lp], pad -> slot 0
            rows = self._mapped(meta, ("d", spec.sliding_window), padded.view(-1), lkv.index_map)
            shape = tuple(padded.shape) + tuple(lkv.k.shape[1:])
            kv = (lkv.k.index_select(0, rows).view(shape).to(q.dtype).transpose(1, 2),
                  lkv.v.index_select(0, rows).view(shape).to(q.dtype).transpose(1, 2))
        bd, hkv, d = q.shape[0], spec.num_kv_heads, q.shape[-1]
        g = spec.num_q_heads // hkv
        qg = q.reshape(bd, hkv, g, d)                                        # [Bd, Hkv, G, D]
        if g < _MIN_ROWS:
            qg = torch.cat([qg, qg[:, :, :1].expand(bd, hkv, _MIN_ROWS - g, d)], 2)
        if len(groups) == 1:
            w = groups[0][1]
            o = F.scaled_dot_product_attention(qg, kv[0][:, :, :w], kv[1][:, :, :w],
                                               attn_mask=mask[..., :w], scale=spec.scale)
        else:
            o = torch.empty(qg.shape, dtype=q.dtype, device=q.device)
            for rows, w in groups:
                o[rows] = F.scaled_dot_product_attention(
                    qg[rows], kv[0][rows, :, :w], kv[1][rows, :, :w], attn_mask=mask[rows, ..., :w],
                    scale=spec.scale)
        return o[:, :, :g].reshape(bd, spec.num_q_heads, d)                 # [Bd, Hq, D]

    def _mirror_plan(self, fb: ForwardBatch, meta: _StepMeta, slots: torch.Tensor, lkv,
                     dtype: torch.dtype) -> None:
        m, lens = self._mirror, meta.decode_lens
        bd, length = slots.shape
        layers = len(getattr(fb.kv_pool, "layer_ids", ()))
        per_pos = 2 * lkv.k[0].numel() * torch.empty(0, dtype=dtype).element_size()
        cap = m.cap if m is not None and m.cap >= length else _padded(length + 1)
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
                hkv = lkv.k.shape[1]
                bh = torch.arange(bd * hkv, device=slots.device).view(bd, hkv)
                meta.mirror, meta.mirror_rows = "append", (bh * m.cap + pos[:, None]).view(-1)
                return
        if m is None or m.cap != cap or m.table.shape[0] != bd:
            m = _DecodeMirror(fb.kv_pool, fb.req_to_token, rows, slots, lens, cap)
        m.pool, m.req_to_token, m.rows = fb.kv_pool, fb.req_to_token, rows
        m.table, m.lens, m.filled = slots, lens, set()
        self._mirror, meta.mirror = m, "rebuild"

    def _mirrored(self, q, k_new, v_new, spec, fb, meta, lkv, slots):
        """(k, v) ``[Bd, Hkv, Lp, D]`` views of the decode mirror for this layer, updated for this
        step (positions past a row's length hold finite values the mask hides); None when the mirror
        is off."""
        if meta.mirror is None:
            self._mirror_plan(fb, meta, slots, lkv, q.dtype)
        m = self._mirror
        if meta.mirror == "off" or m is None:
            return None
        lid, length = spec.layer_id, slots.shape[1]
        bufs = m.bufs.get(lid)
        if meta.mirror == "append":
            if bufs is None:
                return None
            kb, vb = bufs
            d, idx = kb.shape[-1], meta.mirror_rows
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
        padded = _padded(length)
        return kb[:, :, :padded], vb[:, :, :padded]

    def _extend_table(self, fb, meta, i: int, e: _Extend, window: int | None):
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
        if spec.sliding_window is None:
            return self._extend_blocks(q, spec, fb, meta, lkv, i, e)
        slots, mask = self._extend_table(fb, meta, i, e, spec.sliding_window)
        rows = self._mapped(meta, ("e", i, spec.sliding_window), slots, lkv.index_map)
        k = lkv.k.index_select(0, rows).to(q.dtype)                          # [Lk, Hkv, D]
        v = lkv.v.index_select(0, rows).to(q.dtype)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=spec.scale,
            enable_gqa=spec.num_q_heads != spec.num_kv_heads)                 # [1, Hq, n, D]
        return o[0].transpose(0, 1)

    def _extend_plan(self, fb, meta, i: int, e: _Extend):
        tab = meta.extend_tables.get((i, "blocks"))
        if tab is None:
            dev = fb.req_to_token.device
            lp = _padded(e.seq_len)
            slots = F.pad(fb.req_to_token[e.row, : e.seq_len].to(torch.int64), (0, lp - e.seq_len))
            cuts = [e.prefix, *range((e.prefix // QUERY_BLOCK + 1) * QUERY_BLOCK, e.seq_len, QUERY_BLOCK),
                    e.seq_len]
            kpos = torch.arange(lp, device=dev)
            blocks = []
            for a, b in zip(cuts[:-1], cuts[1:]):
                rows = max(b - a, _MIN_ROWS)
                qpos = torch.arange(a, a + rows, device=dev).clamp_(max=b - 1)
                kl = _padded(b)
                blocks.append((a - e.prefix, b - e.prefix, rows, kl,
                               (kpos[None, :kl] <= qpos[:, None])[None, None]))
            tab = meta.extend_tables[(i, "blocks")] = (slots, blocks)
        return tab

    def _extend_blocks(self, q, spec, fb, meta, lkv, i, e):
        slots, blocks = self._extend_plan(fb, meta, i, e)
        rows = self._mapped(meta, ("e", i, None), slots, lkv.index_map)
        k = lkv.k.index_select(0, rows).to(q.dtype).transpose(0, 1)[None]     # [1, Hkv, Lp, D]
        v = lkv.v.index_select(0, rows).to(q.dtype).transpose(0, 1)[None]
        gqa = spec.num_q_heads != spec.num_kv_heads
        qt = q.transpose(0, 1)                                               # [Hq, n, D]
        out = torch.empty_like(q)
        for a, b, nrows, kl, mask in blocks:
            qb = qt[:, a:b]
            if nrows > b - a:
                qb = torch.cat([qb, qb[:, -1:].expand(-1, nrows - (b - a), -1)], 1)
            o = F.scaled_dot_product_attention(qb[None], k[:, :, :kl], v[:, :, :kl], attn_mask=mask,
                                               scale=spec.scale, enable_gqa=gqa)   # [1, Hq, rows, D]
            out[a:b] = o[0, :, : b - a].transpose(0, 1)
        return out

    @staticmethod
    def _mapped(meta: _StepMeta, key, slots: torch.Tensor, index_map: torch.Tensor | None):
        if index_map is None:
            return slots
        ck = (key, index_map.data_ptr())
        rows = meta.mapped.get(ck)
        if rows is None:
            rows = meta.mapped[ck] = index_map[slots]
        return rows
