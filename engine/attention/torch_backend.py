"""TorchAttentionBackend: paged attention in plain torch (the CPU fallback where the cpu_kernel
backend's C file cannot build, and the reference it is tested beside).

It implements :class:`~tandem.engine.attention.base.AttentionBackend`: a layer's K/V are written
first (``fb.kv_pool.layer(id)``; rows = ``index_map[slots]`` when the layer's pool has an index
map), then read back, so new tokens attend to themselves. How a step is split into batched
decode rows and blocked extend rows: :class:`TorchAttentionBackend`.

**Exactness.** A query's attention output in a full-attention layer is bitwise the same whether
it is computed in a prefill, in a chunk after a cached prefix, or as a decode row in any batch
(bf16 and fp32, 1 and 2 threads; ``tests/engine/test_batch_invariance.py``), because every SDPA
call torch's CPU flash kernel sees for it has the same shape: the query at position i sees
exactly ``_padded(i + 1)`` keys (its own, rounded up to a multiple of KEY_BLOCK, the rest
masked), in a call with at most QUERY_BLOCK and at least 4 query rows (below 4 its GEMMs take
another code path), and query blocks never straddle a KEY_BLOCK boundary. Hence decode rows are
grouped by that width. Without this a row's output moved by an ulp with its batch, its chunking
or the padded key count (the kernel's softmax sums follow the padded length), in bf16 enough to
flip a near-tie, so the prefix cache on/off and prefill/decode disaggregation oracles did not
hold. Windowed layers keep their per-row key offsets and are not covered.
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
    decode_lens_cpu: list                    # [Bd] seq lens (host), for the width groups
    extends: list[_Extend]
    # window -> (slots [Bd, L] int64, valid [Bd, 1, 1, Lp] bool, groups); built lazily, once per
    # step. groups: [(rows: slice | index tensor, key width)], the rows whose keys pad to that width
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
KEY_BLOCK = 64      # a query at position i sees exactly _padded(i + 1) keys (the rest masked)
QUERY_BLOCK = 32    # extend queries per SDPA call, blocks aligned at multiples of this
_MIN_ROWS = 4       # SDPA calls get at least this many query rows per (batch, head)


def _padded(n: int) -> int:
    """n keys rounded up to a multiple of KEY_BLOCK."""
    return -(-n // KEY_BLOCK) * KEY_BLOCK


def _width_groups(widths: list[int], device) -> list[tuple[slice | torch.Tensor, int]]:
    """Decode rows grouped by key width: runs of equal widths as slices, scattered ones as index
    tensors. One group (one SDPA call) when the batch's lengths share a KEY_BLOCK bucket."""
    if len(set(widths)) == 1:
        return [(slice(None), widths[0])]
    runs: list[tuple[int, int, int]] = []                 # (start, end, width)
    for i, w in enumerate(widths):
        if runs and runs[-1][2] == w:
            runs[-1] = (runs[-1][0], i + 1, w)
        else:
            runs.append((i, i + 1, w))
    if len(runs) == len(set(widths)):                      # each width one contiguous run
        return [(slice(a, b), w) for a, b, w in runs]
    return [(torch.tensor([i for i, x in enumerate(widths) if x == w], device=device), w)
            for w in sorted(set(widths))]


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
    """Implements :class:`tandem.engine.attention.base.AttentionBackend` with torch ops.

    A step's sequences are split once, in :meth:`init_forward`, into
    - *decode rows* (exactly one new token): batched. Per attention window (None = full) one
      padded slot table ``[Bd, L]`` (padding -> slot 0) and a validity mask ``[Bd, 1, 1, Lp]``
      are built once per step; each layer then does one ``index_select`` gather ``k_buf ->
      [Bd, Lp, Hkv, D]`` (a row-wise copy, not advanced indexing) and one 4-D SDPA call per key
      width, the query heads of a kv head as rows (``[Bd, Hkv, max(G, 4), D]``, G = Hq / Hkv,
      padded with copies), so no Python loop over requests per layer. A sliding window W
      gathers only the last ``min(L, W)`` positions. Full-attention layers of the plain pool
      skip the gather while the decode batch is unchanged: a per-layer mirror ``[Bd, Hkv, cap,
      D]`` of the batch's K/V (:class:`_DecodeMirror`) is rebuilt by one gather when the batch
      changes and otherwise only appended to, so a steady decode step reads each layer's KV
      once, in place.
    - *extend rows* (a prompt chunk): full-attention layers split the queries at absolute
      positions that are multiples of ``QUERY_BLOCK`` and run one SDPA call per block (at least
      4 rows, padded with copies) over the keys ``[0, Lp)`` with an explicit causal mask;
      windowed layers run one SDPA call per sequence over its window with a mask.
    """

    name = "torch"   # what the startup line calls it

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
        """(slots [Bd, L], mask [Bd, 1, 1, Lp]) for this window; row i's keys are at positions
        ``start_i .. start_i+L-1`` (padding past its length -> slot 0, masked out); ``Lp`` is L
        rounded up to a multiple of KEY_BLOCK, the keys SDPA sees (the rest masked)."""
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
            if meta.decode_min_len < length:   # some row has fewer than L keys
                slots = torch.where(valid[:, :length], slots, 0)
            widths = [_padded(n if window is None else min(n, window)) for n in meta.decode_lens_cpu]
            tab = meta.decode_tables[window] = (slots.to(torch.int64).contiguous(),
                                                valid[:, None, None, :], _width_groups(widths, dev))
        return tab

    def _decode(self, q, k_new, v_new, spec, fb, meta, lkv):
        # q: [Bd, Hq, D]; k_new, v_new: [Bd, Hkv, D] (written to the pool already) -> o: [Bd, Hq, D]
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
        if len(groups) == 1:   # every row's keys pad to one width: one call, no copies
            w = groups[0][1]
            o = F.scaled_dot_product_attention(qg, kv[0][:, :, :w], kv[1][:, :, :w],
                                               attn_mask=mask[..., :w], scale=spec.scale)
        else:                  # one call per width (a slice of the batch, or its gathered rows)
            o = torch.empty(qg.shape, dtype=q.dtype, device=q.device)
            for rows, w in groups:
                o[rows] = F.scaled_dot_product_attention(
                    qg[rows], kv[0][rows, :, :w], kv[1][rows, :, :w], attn_mask=mask[rows, ..., :w],
                    scale=spec.scale)
        return o[:, :, :g].reshape(bd, spec.num_q_heads, d)                 # [Bd, Hq, D]

    def _mirror_plan(self, fb: ForwardBatch, meta: _StepMeta, slots: torch.Tensor, lkv,
                     dtype: torch.dtype) -> None:
        """Decide, once per step, whether the decode mirror is appended to, rebuilt, or off."""
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
        """(k, v) ``[Bd, Hkv, Lp, D]`` views of the decode mirror for this layer, updated for this
        step (positions past a row's length hold finite values the mask hides); None when the
        mirror is off."""
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
        padded = _padded(length)   # <= cap (a multiple of KEY_BLOCK); the rest is masked
        return kb[:, :, :padded], vb[:, :, :padded]

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
        if spec.sliding_window is None:
            return self._extend_blocks(q, spec, fb, meta, lkv, i, e)
        slots, mask = self._extend_table(fb, meta, i, e, spec.sliding_window)
        rows = self._mapped(meta, ("e", i, spec.sliding_window), slots, lkv.index_map)
        k = lkv.k.index_select(0, rows).to(q.dtype)                          # [Lk, Hkv, D]
        v = lkv.v.index_select(0, rows).to(q.dtype)
        # 4-D inputs: torch's fused CPU (flash) kernel only takes [B, H, L, D]; 3-D falls back to
        # the unfused math path.
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=spec.scale,
            enable_gqa=spec.num_q_heads != spec.num_kv_heads)                 # [1, Hq, n, D]
        return o[0].transpose(0, 1)

    def _extend_plan(self, fb, meta, i: int, e: _Extend):
        """Full attention: (pool slots [Lp] of keys 0..Lp-1 (padding -> slot 0), blocks) with one
        block per QUERY_BLOCK-aligned run of the new queries: (start, end) in the chunk, rows (>=
        _MIN_ROWS: the last query repeated), key count Lp_b and the causal mask [1, 1, rows, Lp_b]."""
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
        """Full attention in canonical blocks (see the module docstring). q: [n, Hq, D] -> [n, Hq, D]."""
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
        """Pool rows of ``slots`` (through ``index_map`` when the layer's pool has one)."""
        if index_map is None:
            return slots
        ck = (key, index_map.data_ptr())
        rows = meta.mapped.get(ck)
        if rows is None:
            rows = meta.mapped[ck] = index_map[slots]
        return rows
