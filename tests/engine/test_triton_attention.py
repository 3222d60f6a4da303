"""TritonAttentionBackend against a dense reference attention written here.

CPU runs use triton's interpreter (numpy), so sizes stay small. Every case scatters pages and
request rows, and fills every pool row a sequence should not read (free rows, and rows of
positions outside a sliding window) with NaN: a kernel that reads a wrong slot produces NaN.
The reserved padding page stays zero, as in serving.
"""

from __future__ import annotations

import os
import subprocess
import sys

# Triton's interpret mode is process-wide and fixed at its first import. An explicit
# TRITON_INTERPRET=0 (set by test_gpu_compiled_kernels for its child) runs every test compiled.
_TRITON_WAS_IMPORTED = "triton" in sys.modules
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from tandem.cache.kv_pool import KVPool, LayerKV  # noqa: E402
from tandem.cache.req_to_token import ReqToTokenPool  # noqa: E402
from tandem.engine.attention.base import AttnSpec  # noqa: E402
from tandem.engine.attention.triton_backend import META_KEY, TritonAttentionBackend  # noqa: E402
from tandem.engine.attention.triton_kernels import INTERPRETED  # noqa: E402
from tandem.engine.forward_batch import ForwardBatch  # noqa: E402

# triton's own library functions (tl.max, ...) took the mode of triton's first import
_TRITON_INTERPRETED = type(triton.language.standard.max).__name__ == "InterpretedFunction"
if _TRITON_WAS_IMPORTED and INTERPRETED != _TRITON_INTERPRETED:
    pytest.skip("triton was imported before this module could set TRITON_INTERPRET; run this file "
                "on its own or export TRITON_INTERPRET=1", allow_module_level=True)
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("triton kernels are compiled (TRITON_INTERPRET=0) and there is no GPU",
                allow_module_level=True)
DEVICE = "cpu" if INTERPRETED else "cuda"  # the CPU tests run compiled on a GPU in the child

LAYER = 1  # pools hold two layers; the backend must pick this one


class _MappedPool:
    """A sliding-window pool reached through ``index_map`` (what a hybrid pool's layer() gives)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, index_map: torch.Tensor):
        self._layer = LayerKV(k, v, index_map)

    def layer(self, layer_id: int) -> LayerKV:
        assert layer_id == LAYER
        return self._layer


class Case:
    """One batch: its ForwardBatch, the new tokens' q/k/v, and every sequence's true K/V."""

    def __init__(self, prefix_lens, extend_lens, *, hq=9, hkv=3, d=64, page_size=1, window=None,
                 index_map=False, dtype=torch.float32, device=DEVICE, seed=0):
        g = torch.Generator().manual_seed(seed)
        B = len(prefix_lens)
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        self.spec = AttnSpec(LAYER, hq, hkv, d, d ** -0.5, window)
        self.prefix_lens, self.extend_lens, self.seq_lens = list(prefix_lens), list(extend_lens), seq_lens

        # scattered pages: a random order of pages 1..num_pages, two spare
        pages_per_seq = [-(-L // page_size) for L in seq_lens]
        num_pages = sum(pages_per_seq) + 2
        pool = KVPool(num_pages * page_size, page_size, 2, hkv, d, dtype, device)
        pool.kv_data.fill_(float("nan"))
        pool.kv_data[:, :, :page_size] = 0  # the reserved padding page stays finite, as in serving
        order = (torch.randperm(num_pages, generator=g) + 1).tolist()
        r2t = ReqToTokenPool(B + 3, max(seq_lens) + 5, device)
        all_rows = [r2t.alloc() for _ in range(B + 3)]
        rows = all_rows[::-1][:B]  # not 1, 2, ...
        self.keys, self.values, slots = [], [], []
        for i, L in enumerate(seq_lens):
            pages = torch.tensor(order[:pages_per_seq[i]])
            order = order[pages_per_seq[i]:]
            s = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:L]
            slots.append(s)
            r2t.write(rows[i], 0, s)
            self.keys.append(torch.randn(L, hkv, d, generator=g).to(dtype))
            self.values.append(torch.randn(L, hkv, d, generator=g).to(dtype))

        # the cached prefix goes into the pool; positions no query can see stay NaN
        def first_visible(i):
            return 0 if window is None else max(0, prefix_lens[i] - window + 1)

        if index_map:
            rows_total = pool.kv_data.shape[2]
            # row 0: padding (zeros); rows 1..rows_total: data; the last row: NaN ("evicted")
            mk = torch.full((rows_total + 2, hkv, d), float("nan"), dtype=dtype, device=device)
            mk[0] = 0
            mv = mk.clone()
            evicted = rows_total + 1
            imap = torch.zeros(rows_total, dtype=torch.int64)  # unused slots -> padding row 0
            free_rows = (torch.randperm(rows_total, generator=g) + 1).tolist()
            for i, s in enumerate(slots):
                imap[s] = torch.tensor(free_rows[:len(s)])
                free_rows = free_rows[len(s):]
                keep = s[first_visible(i):prefix_lens[i]]
                mk[imap[keep]] = self.keys[i][first_visible(i):prefix_lens[i]].to(device)
                mv[imap[keep]] = self.values[i][first_visible(i):prefix_lens[i]].to(device)
                imap[s[:first_visible(i)]] = evicted
            kv_pool = _MappedPool(mk, mv, imap.to(device))
        else:
            for i, s in enumerate(slots):
                keep = slice(first_visible(i), prefix_lens[i])
                pool.set_kv(LAYER, s[keep].to(device), self.keys[i][keep].to(device),
                            self.values[i][keep].to(device))
            kv_pool = pool
        self.layer = kv_pool.layer(LAYER)

        def cat(xs):
            return torch.cat(xs).to(device)

        self.k = cat([self.keys[i][p:] for i, p in enumerate(prefix_lens)])
        self.v = cat([self.values[i][p:] for i, p in enumerate(prefix_lens)])
        T = sum(extend_lens)
        self.q = torch.randn(T, hq, d, generator=g).to(dtype).to(device)
        starts = [sum(extend_lens[:i]) for i in range(B)]

        def t64(xs):
            return torch.tensor(xs, dtype=torch.int64, device=device)

        self.fb = ForwardBatch(
            input_ids=torch.zeros(T, dtype=torch.int64, device=device),
            positions=cat([torch.arange(p, L) for p, L in zip(prefix_lens, seq_lens)]),
            out_cache_loc=cat([s[p:] for s, p in zip(slots, prefix_lens)]),
            req_pool_indices=t64(rows), seq_lens=t64(seq_lens), prefix_lens=t64(prefix_lens),
            extend_lens=t64(extend_lens), extend_starts=t64(starts),
            req_to_token=r2t.req_to_token, kv_pool=kv_pool,
            seq_lens_cpu=seq_lens, prefix_lens_cpu=list(prefix_lens), extend_lens_cpu=list(extend_lens))

    def reference(self) -> torch.Tensor:
        """Dense causal (windowed) GQA attention in float64: [T, H_q, D]."""
        spec, out, t = self.spec, [], 0
        group = spec.num_q_heads // spec.num_kv_heads
        for i, (p, e, L) in enumerate(zip(self.prefix_lens, self.extend_lens, self.seq_lens)):
            q = self.q[t:t + e].cpu().double()
            k = self.keys[i].double().repeat_interleave(group, 1)
            v = self.values[i].double().repeat_interleave(group, 1)
            s = torch.einsum("qhd,khd->hqk", q, k) * spec.scale
            qpos, kpos = torch.arange(p, L)[:, None], torch.arange(L)[None, :]
            visible = kpos <= qpos
            if spec.sliding_window is not None:
                visible &= kpos > qpos - spec.sliding_window
            s = s.masked_fill(~visible, float("-inf"))
            out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
            t += e
        return torch.cat(out)

    def run(self, backend: TritonAttentionBackend) -> torch.Tensor:
        backend.init_forward(self.fb)
        return backend.forward(self.q, self.k, self.v, self.spec, self.fb)

    def check_stored(self) -> None:
        """The new tokens' K/V are in the layer's rows (through index_map when present)."""
        rows = self.fb.out_cache_loc
        if self.layer.index_map is not None:
            rows = self.layer.index_map[rows]
        assert torch.equal(self.layer.k[rows], self.k.to(self.layer.k.dtype))
        assert torch.equal(self.layer.v[rows], self.v.to(self.layer.v.dtype))


def _check(case: Case, backend: TritonAttentionBackend, atol: float = 1e-4, rtol: float = 0.0):
    o = case.run(backend)
    assert o.shape == case.q.shape and o.dtype == case.q.dtype
    torch.testing.assert_close(o.cpu().double(), case.reference(), atol=atol, rtol=rtol)
    case.check_stored()
    return o


# ---------------------------------------------------------------- decode (split-KV kernels)

@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("max_splits,min_split", [(16, 128), (4, 16)], ids=["one-split", "four-splits"])
def test_decode_varied_lengths_gqa(page_size, max_splits, min_split):
    # SmolLM2-135M geometry: 9 query heads over 3 KV heads, head_dim 64
    case = Case([0, 6, 32, 69], [1, 1, 1, 1], page_size=page_size)
    backend = TritonAttentionBackend(max_kv_splits=max_splits, min_split_tokens=min_split)
    backend.init_forward(case.fb)
    meta = case.fb.attn_meta[META_KEY]
    assert meta.is_decode
    want = 1 if max_splits == 16 else 4  # the length-1 sequence then has three empty splits
    assert backend.num_kv_splits(meta, case.spec, case.fb.batch_size) == want
    _check(case, backend)


@pytest.mark.parametrize("index_map", [False, True], ids=["direct", "index-map"])
def test_decode_sliding_window(index_map):
    case = Case([4, 19, 20, 49], [1, 1, 1, 1], page_size=16, window=20, index_map=index_map, seed=1)
    _check(case, TritonAttentionBackend(max_kv_splits=4, min_split_tokens=4))


# ---------------------------------------------------------------- extend (prefill) kernel

@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_prefix_and_new_tokens(page_size):
    # fresh prompt, a decode riding along (mixed batch), cached prefixes; lengths cross 16-blocks
    case = Case([0, 5, 20, 3], [17, 1, 9, 33], page_size=page_size, seed=2)
    backend = TritonAttentionBackend()
    backend.init_forward(case.fb)
    assert not case.fb.attn_meta[META_KEY].is_decode
    _check(case, backend)


@pytest.mark.parametrize("index_map", [False, True], ids=["direct", "index-map"])
def test_extend_sliding_window(index_map):
    case = Case([0, 12, 30], [20, 5, 17], page_size=16, window=8, index_map=index_map, seed=3)
    _check(case, TritonAttentionBackend())


def test_head_dim_not_power_of_two():
    backend = TritonAttentionBackend(max_kv_splits=2, min_split_tokens=8)
    _check(Case([3, 10], [1, 1], hq=4, hkv=1, d=40, page_size=4, seed=4), backend)
    _check(Case([3, 0], [6, 18], hq=4, hkv=1, d=40, page_size=4, seed=5), backend)


def test_wide_gqa_group_spans_two_head_blocks():
    # 40 query heads on one KV head: the decode kernel packs 32 heads per program, so two programs
    backend = TritonAttentionBackend(max_kv_splits=2, min_split_tokens=8)
    _check(Case([5, 17], [1, 1], hq=40, hkv=1, d=16, page_size=2, seed=8), backend)
    _check(Case([5, 0], [3, 4], hq=40, hkv=1, d=16, page_size=2, seed=9), backend)


def test_chunked_prefill_then_decode_reads_what_it_stored():
    """Three steps over one pool: chunk 1, chunk 2 over chunk 1's stored KV, then a decode."""
    hq, hkv, d, L = 9, 3, 64, 30
    g = torch.Generator().manual_seed(6)
    keys, values = torch.randn(L, hkv, d, generator=g), torch.randn(L, hkv, d, generator=g)
    q_all = torch.randn(L, hq, d, generator=g)
    pool = KVPool(64, 16, 2, hkv, d, device=DEVICE)
    pool.kv_data.fill_(float("nan"))
    r2t = ReqToTokenPool(2, 40, DEVICE)
    row = r2t.alloc()
    slots = torch.cat([torch.arange(48, 64), torch.arange(16, 32)])[:L]  # pages 3 then 1
    r2t.write(row, 0, slots)
    spec = AttnSpec(LAYER, hq, hkv, d, d ** -0.5)
    backend = TritonAttentionBackend(max_kv_splits=2, min_split_tokens=8)
    for start, end in [(0, 17), (17, 29), (29, 30)]:
        n = end - start

        def dev(xs):
            return torch.tensor(xs, dtype=torch.int64, device=DEVICE)

        fb = ForwardBatch(
            input_ids=torch.zeros(n, dtype=torch.int64, device=DEVICE),
            positions=torch.arange(start, end, device=DEVICE), out_cache_loc=slots[start:end].to(DEVICE),
            req_pool_indices=dev([row]), seq_lens=dev([end]), prefix_lens=dev([start]),
            extend_lens=dev([n]), extend_starts=dev([0]), req_to_token=r2t.req_to_token, kv_pool=pool,
            seq_lens_cpu=[end], prefix_lens_cpu=[start], extend_lens_cpu=[n])
        backend.init_forward(fb)
        assert fb.attn_meta[META_KEY].is_decode == (n == 1)
        o = backend.forward(q_all[start:end].to(DEVICE), keys[start:end].to(DEVICE),
                            values[start:end].to(DEVICE), spec, fb)
        k = keys[:end].double().repeat_interleave(3, 1)
        v = values[:end].double().repeat_interleave(3, 1)
        s = torch.einsum("qhd,khd->hqk", q_all[start:end].double(), k) * spec.scale
        s = s.masked_fill(torch.arange(end)[None, :] > torch.arange(start, end)[:, None], float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        torch.testing.assert_close(o.cpu().double(), ref, atol=1e-4, rtol=0)


def test_forward_before_init_forward_raises():
    case = Case([2], [1], hq=2, hkv=1, d=16)
    with pytest.raises(ValueError, match="init_forward"):
        TritonAttentionBackend().forward(case.q, case.k, case.v, case.spec, case.fb)


def test_matches_torch_backend():
    torch_backend = pytest.importorskip("tandem.engine.attention.torch_backend")
    cls = getattr(torch_backend, "TorchAttentionBackend", None)
    if cls is None:
        pytest.skip("torch_backend has no TorchAttentionBackend yet")
    for prefix, ext in [([0, 6, 32], [1, 1, 1]), ([0, 5, 20], [17, 1, 9])]:
        a, b = (Case(prefix, ext, page_size=16, window=12, seed=7) for _ in range(2))  # two pools
        tb = cls()
        tb.init_forward(b.fb)
        torch.testing.assert_close(a.run(TritonAttentionBackend(max_kv_splits=4, min_split_tokens=8)),
                                   tb.forward(b.q, b.k, b.v, b.spec, b.fb), atol=1e-4, rtol=0)


# ---------------------------------------------------------------- launch parameters (tuning)

def test_choose_kv_splits_exact():
    from tandem.engine.attention.triton_backend import choose_kv_splits

    # the interpreter's rule (no tuning table): the keys decide, capped by max_kv_splits
    assert [choose_kv_splits(n, 16, 128) for n in (1, 128, 129, 1000, 9000)] == [1, 1, 2, 8, 16]
    assert choose_kv_splits(20, 16, 4) == 5        # a 20-token window


@pytest.mark.parametrize("tiles", [dict(block_n=16), dict(block_n=64)], ids=["n16", "n64"])
def test_decode_tiles(tiles):
    from tandem.engine.attention.triton_kernels import Tiles

    backend = TritonAttentionBackend(max_kv_splits=4, min_split_tokens=16,
                                     decode_tiles=Tiles(num_warps=4, num_stages=2, **tiles))
    _check(Case([0, 6, 32, 69], [1, 1, 1, 1], page_size=16, seed=10), backend)


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_decode_fixed_kv_splits(splits):
    backend = TritonAttentionBackend(num_kv_splits=splits)
    case = Case([0, 6, 32, 69], [1, 1, 1, 1], page_size=1, seed=11)
    backend.init_forward(case.fb)
    assert backend.num_kv_splits(case.fb.attn_meta[META_KEY], case.spec, 4) == splits
    _check(case, backend)


def test_a_split_table_picks_the_count_and_every_count_it_can_pick_agrees():
    """The backend takes its decode split count from a tuning table (span = the step's longest
    sequence here, programs = batch x KV heads), and each count the table holds gives the same
    output as the single pass, all of them matching the dense reference."""
    from tandem.engine.attention.split_rule import SplitTable

    table = SplitTable.from_rows([(1, 3, 1), (1, 12, 1), (64, 3, 5), (64, 12, 2),
                                  (128, 3, 8), (128, 12, 3)], "test")
    case = Case([0, 6, 32, 69], [1, 1, 1, 1], page_size=1, seed=13)      # span 70, 4 x 3 programs
    backend = TritonAttentionBackend(split_table=table)
    backend.init_forward(case.fb)
    assert backend.num_kv_splits(case.fb.attn_meta[META_KEY], case.spec, 4) == 2
    one = _check(case, TritonAttentionBackend(num_kv_splits=1))
    for n in sorted({c for row in table.splits for c in row}):
        torch.testing.assert_close(_check(case, TritonAttentionBackend(num_kv_splits=n)), one,
                                   atol=1e-5, rtol=0)
    torch.testing.assert_close(case.run(backend), one, atol=1e-5, rtol=0)


@pytest.mark.parametrize("m,n", [(16, 32), (32, 16)])
def test_extend_tiles(m, n):
    from tandem.engine.attention.triton_kernels import Tiles

    backend = TritonAttentionBackend(extend_tiles=Tiles(block_m=m, block_n=n, num_warps=4, num_stages=1))
    _check(Case([0, 5, 20, 3], [17, 1, 9, 33], page_size=16, seed=12), backend)


def test_tiles_validation():
    from tandem.engine.attention.triton_kernels import Tiles

    with pytest.raises(ValueError, match="block_n=24 must be a power of two"):
        Tiles(block_n=24, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="num_warps=3"):
        Tiles(block_n=32, num_warps=3, num_stages=1)
    with pytest.raises(ValueError, match="needs block_m"):
        TritonAttentionBackend(extend_tiles=Tiles(block_n=32, num_warps=4, num_stages=1))


def test_decode_cuda_graph_padding_rows():
    """Rows a CUDA graph pads with (request row 0, seq_len 1: the reserved padding slot 0 only)
    read nothing but slot 0 and leave the real rows' outputs as they are."""
    case = Case([6, 32], [1, 1], page_size=1, seed=13)
    fb = case.fb
    backend = TritonAttentionBackend(max_kv_splits=4, min_split_tokens=8)
    want = _check(case, backend)
    pad = 3
    dev = fb.seq_lens.device

    def grow(t, value):
        return torch.cat([t, torch.full((pad,), value, dtype=t.dtype, device=dev)])

    hq, hkv, d = case.spec.num_q_heads, case.spec.num_kv_heads, case.spec.head_dim
    padded = ForwardBatch(
        input_ids=grow(fb.input_ids, 0), positions=grow(fb.positions, 0),
        out_cache_loc=grow(fb.out_cache_loc, 0), req_pool_indices=grow(fb.req_pool_indices, 0),
        seq_lens=grow(fb.seq_lens, 1), prefix_lens=grow(fb.prefix_lens, 0),
        extend_lens=grow(fb.extend_lens, 1), extend_starts=torch.arange(2 + pad, device=dev),
        req_to_token=fb.req_to_token, kv_pool=fb.kv_pool, seq_lens_cpu=fb.seq_lens_cpu + [1] * pad,
        prefix_lens_cpu=fb.prefix_lens_cpu + [0] * pad, extend_lens_cpu=[1] * (2 + pad))
    g = torch.Generator().manual_seed(14)
    q = torch.cat([case.q, torch.randn(pad, hq, d, generator=g).to(dev)])
    k = torch.cat([case.k, torch.randn(pad, hkv, d, generator=g).to(dev)])
    v = torch.cat([case.v, torch.randn(pad, hkv, d, generator=g).to(dev)])
    backend.init_forward(padded)
    o = backend.forward(q, k, v, case.spec, padded)
    assert torch.equal(o[:2], want)
    # each padding row sees one key, slot 0, which holds the last padding token's V
    slot0_v = case.layer.v[0].repeat_interleave(hq // hkv, 0)
    torch.testing.assert_close(o[2:], slot0_v.expand(pad, hq, d), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- the same on a GPU, compiled

def _gpu_comparisons(dtype: torch.dtype) -> None:
    atol, rtol = (1e-4, 0.0) if dtype == torch.float32 else (2e-2, 2e-2)
    lens = [0, 6, 32, 69, 300, 1000]
    decode_backend = TritonAttentionBackend(max_kv_splits=8, min_split_tokens=16)
    for page_size in (1, 16):
        for window, imap in [(None, False), (20, False), (20, True)]:
            kw = dict(page_size=page_size, window=window, index_map=imap, dtype=dtype, device="cuda")
            _check(Case(lens, [1] * len(lens), **kw), decode_backend, atol, rtol)
            _check(Case([0, 5, 20, 3, 130], [17, 1, 9, 200, 70], **kw), TritonAttentionBackend(), atol, rtol)
    _check(Case([3, 10], [1, 1], hq=4, hkv=1, d=40, dtype=dtype, device="cuda"), decode_backend, atol, rtol)
    # Llama-8B geometry: 32 query heads over 8 KV heads, head_dim 128
    _check(Case([0, 64], [129, 64], hq=32, hkv=8, d=128, page_size=16, dtype=dtype, device="cuda"),
           TritonAttentionBackend(), atol, rtol)
    _check(Case([100, 513], [1, 1], hq=32, hkv=8, d=128, page_size=16, dtype=dtype, device="cuda"),
           decode_backend, atol, rtol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs compiled kernels on a GPU")
def test_gpu_split_count_depends_on_batch_size_only():
    """On CUDA the decode split count is sized for the context limit: two steps of one batch
    size split alike whatever their lengths (what lets a CUDA graph replay an eager step)."""
    import dataclasses

    backend = TritonAttentionBackend()
    case = Case([300, 900], [1, 1], device="cuda", seed=1)
    short = dataclasses.replace(case.fb, seq_lens=torch.tensor([4, 6], device="cuda"), seq_lens_cpu=[4, 6],
                                prefix_lens_cpu=[3, 5], attn_meta={})
    counts = []
    for fb in (case.fb, short):
        backend.init_forward(fb)
        meta = fb.attn_meta[META_KEY]
        assert meta.kv_span == fb.req_to_token.shape[1] and meta.num_sms
        counts.append(backend.num_kv_splits(meta, case.spec, 2))
    from tandem.engine.attention.split_rule import DEFAULT_SPLITS, choose_splits

    width = case.fb.req_to_token.shape[1]
    assert counts[0] == counts[1] == choose_splits(DEFAULT_SPLITS, width, 2, case.spec.num_kv_heads)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_kernels():
    """Compiled kernels on CUDA, fp32 and bf16. Under the interpreter this reruns the whole file
    in a child process with TRITON_INTERPRET=0, where every test above runs compiled on CUDA."""
    if not INTERPRETED:
        for dtype in (torch.float32, torch.bfloat16):
            _gpu_comparisons(dtype)
        return
    child = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-x", "-p", "no:cacheprovider"],
        env=dict(os.environ, TRITON_INTERPRET="0"), capture_output=True, text=True, timeout=540)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
