"""The CPU attention backends (TorchAttentionBackend, and CpuKernelAttentionBackend where the AVX512
kernels build) against a dense reference written here.

Every case scatters pages (shuffled) and request rows, fills every pool row no query may read
with NaN (free rows, and positions that fall outside every query's sliding window), and keeps
the padding page zero: a backend that reads a wrong slot returns NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

from tandem.cache.kv_pool import KVPool, LayerKV
from tandem.cache.req_to_token import ReqToTokenPool
from tandem.engine.attention.base import AttnSpec
from tandem.engine.attention.cpu_backend import CpuKernelAttentionBackend, cpu_kernel_unavailable
from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.forward_batch import ForwardBatch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYER = 1  # pools hold two layers; the backend must use this one


class _MappedPool:
    """A pool whose layer rows are reached through ``index_map`` (as a hybrid SWA pool's are)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, index_map: torch.Tensor):
        self._layer = LayerKV(k, v, index_map)

    def layer(self, layer_id: int) -> LayerKV:
        assert layer_id == LAYER
        return self._layer


def make_case(seqs, *, hq=9, hkv=3, d=16, page_size=1, window=None, index_map=False, seed=0):
    """seqs: [(prefix_len, extend_len)]. Returns (fb, q, k, v, dense K/V per sequence, spec)."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-(p + n) // page_size) for p, n in seqs) + 3
    num_slots = num_pages * page_size
    pool = KVPool(num_slots, page_size, 2, hkv, d)
    pool.kv_data.fill_(float("nan"))
    pool.kv_data[:, :, :page_size] = 0.0                     # padding page stays zero
    r2t = ReqToTokenPool(8, 128)
    pages = (torch.randperm(num_pages, generator=g) + 1).tolist()
    rows = (torch.randperm(8, generator=g) + 1).tolist()
    k_all, v_all, q_new, k_new, v_new, locs = [], [], [], [], [], []
    for i, (prefix, n) in enumerate(seqs):
        L = prefix + n
        mine = [pages.pop() for _ in range(-(-L // page_size))]
        slots = (torch.tensor(mine)[:, None] * page_size + torch.arange(page_size)).flatten()[:L]
        r2t.req_to_token[rows[i], :L] = slots.to(torch.int32)
        k = torch.randn(L, hkv, d, generator=g)
        v = torch.randn(L, hkv, d, generator=g)
        first_visible = 0 if window is None else max(0, prefix - window + 1)
        visible = slots[first_visible:prefix]
        pool.k_buffer[LAYER][visible] = k[first_visible:prefix]
        pool.v_buffer[LAYER][visible] = v[first_visible:prefix]
        k_all.append(k)
        v_all.append(v)
        q_new.append(torch.randn(n, hq, d, generator=g))
        k_new.append(k[prefix:])
        v_new.append(v[prefix:])
        locs.append(slots[prefix:])
    kv_pool = pool
    if index_map:
        # Move this layer's rows to a permuted table: row index_map[s] of k/v holds slot s.
        perm = torch.randperm(num_slots, generator=g) + page_size
        imap = torch.cat([torch.zeros(page_size, dtype=torch.int64), perm])
        k_tab, v_tab = torch.empty_like(pool.k_buffer[LAYER]), torch.empty_like(pool.v_buffer[LAYER])
        k_tab[imap], v_tab[imap] = pool.k_buffer[LAYER], pool.v_buffer[LAYER]
        kv_pool = _MappedPool(k_tab, v_tab, imap)
    prefix_l = [p for p, _ in seqs]
    ext_l = [n for _, n in seqs]
    starts = [sum(ext_l[:i]) for i in range(len(seqs))]
    fb = ForwardBatch(
        input_ids=torch.zeros(sum(ext_l), dtype=torch.int64),
        positions=torch.cat([torch.arange(p, p + n) for p, n in seqs]),
        out_cache_loc=torch.cat(locs), req_pool_indices=torch.tensor(rows[: len(seqs)]),
        seq_lens=torch.tensor([p + n for p, n in seqs]), prefix_lens=torch.tensor(prefix_l),
        extend_lens=torch.tensor(ext_l), extend_starts=torch.tensor(starts),
        req_to_token=r2t.req_to_token, kv_pool=kv_pool,
        seq_lens_cpu=[p + n for p, n in seqs], prefix_lens_cpu=prefix_l, extend_lens_cpu=ext_l)
    spec = AttnSpec(LAYER, hq, hkv, d, scale=0.7 / math.sqrt(d), sliding_window=window)
    return fb, torch.cat(q_new), torch.cat(k_new), torch.cat(v_new), (k_all, v_all), spec


def reference(q, seqs, dense, spec):
    """Dense attention: query at position p sees keys j <= p (and j > p - W)."""
    k_all, v_all = dense
    g = spec.num_q_heads // spec.num_kv_heads
    out, t = [], 0
    for (prefix, n), k, v in zip(seqs, k_all, v_all):
        L = prefix + n
        kk = k.repeat_interleave(g, dim=1)                   # [L, Hq, D]
        vv = v.repeat_interleave(g, dim=1)
        qpos = torch.arange(prefix, L)[:, None]
        kpos = torch.arange(L)[None, :]
        mask = kpos <= qpos
        if spec.sliding_window is not None:
            mask &= kpos > qpos - spec.sliding_window
        s = torch.einsum("thd,lhd->htl", q[t:t + n], kk) * spec.scale
        s = s.masked_fill(~mask[None], float("-inf"))
        out.append(torch.einsum("htl,lhd->thd", s.softmax(-1), vv))
        t += n
    return torch.cat(out)


BACKENDS = {"torch": TorchAttentionBackend, "cpu_kernel": CpuKernelAttentionBackend}
backends = pytest.mark.parametrize("backend", [
    "torch", pytest.param("cpu_kernel", marks=pytest.mark.skipif(
        cpu_kernel_unavailable() is not None, reason=f"cpu_kernel: {cpu_kernel_unavailable()}"))])


def run(seqs, backend="torch", **kw):
    fb, q, k, v, dense, spec = make_case(seqs, **kw)
    be = BACKENDS[backend]()
    be.init_forward(fb)
    o = be.forward(q, k, v, spec, fb)
    ref = reference(q, seqs, dense, spec)
    assert o.shape == q.shape
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
    lkv = fb.kv_pool.layer(LAYER)
    rows = fb.out_cache_loc if lkv.index_map is None else lkv.index_map[fb.out_cache_loc]
    torch.testing.assert_close(lkv.k[rows], k)             # new K/V were written
    torch.testing.assert_close(lkv.v[rows], v)
    return fb


DECODE = [(0, 1), (7, 1), (20, 1), (3, 1)]
PREFILL = [(0, 9), (0, 3)]
MIXED = [(0, 7), (5, 1), (12, 1), (4, 6), (0, 1), (9, 4)]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize("index_map", [False, True])
@pytest.mark.parametrize("seqs", [DECODE, PREFILL, MIXED], ids=["decode", "prefill", "mixed"])
@backends
def test_matches_dense_reference(seqs, page_size, window, index_map, backend):
    fb = run(seqs, backend, page_size=page_size, window=window, index_map=index_map, seed=len(seqs) + page_size)
    if seqs is DECODE:
        assert fb.is_decode


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("d", [8, 32])
@backends
def test_head_layouts(hq, hkv, d, backend):
    run(MIXED, backend, hq=hq, hkv=hkv, d=d, page_size=2, window=3, seed=hq)


@backends
def test_long_sequences_cross_key_blocks(backend):
    """Keys past the kernel's 16-position blocks and the torch backend's 64-key padding."""
    run([(0, 70), (40, 1), (100, 3), (17, 1)], backend, d=16, page_size=4, window=None, seed=5)
    run([(0, 70), (40, 1), (100, 3)], backend, d=16, page_size=1, window=21, index_map=True, seed=6)


@backends
def test_other_layer_untouched(backend):
    fb, q, k, v, _, spec = make_case(MIXED, page_size=2)
    before = fb.kv_pool.kv_data[0].clone()
    be = BACKENDS[backend]()
    be.init_forward(fb)
    be.forward(q, k, v, spec, fb)
    torch.testing.assert_close(fb.kv_pool.kv_data[0], before, equal_nan=True)


def test_window_metadata_built_once_per_step():
    """Layers sharing a window reuse one gather table (built in the first layer's call)."""
    fb, q, k, v, _, spec = make_case(DECODE, page_size=1, window=4)
    be = TorchAttentionBackend()
    be.init_forward(fb)
    be.forward(q, k, v, spec, fb)
    tables = fb.attn_meta["torch"].decode_tables
    first = tables[4][0]
    be.forward(q, k, v, spec, fb)
    assert tables[4][0] is first and set(tables) == {4}
    assert first.shape == (len(DECODE), 4)                  # only the window is gathered
