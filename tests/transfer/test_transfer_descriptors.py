"""Page ids -> coalesced per-(layer, k/v) byte ranges, pinned to exact offsets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.cache.kv_pool import KVPool
from tandem.core.pool_layout import PoolLayout
from tandem.transfer.descriptors import byte_ranges, coalesce, page_table, page_table_indices, split_even


def _l(a):
    return np.asarray(a).tolist()


def test_coalesce_breaks_where_either_side_jumps():
    # src jumps 5->9, dst jumps 11->20 and 22->30
    s0, d0, n = coalesce([3, 4, 5, 9, 10, 11, 12], [10, 11, 20, 21, 22, 30, 31])
    assert (_l(s0), _l(d0), _l(n)) == ([3, 5, 9, 11], [10, 20, 21, 30], [2, 1, 2, 2])


def test_coalesce_single_and_empty():
    assert [_l(x) for x in coalesce([7], [0])] == [[7], [0], [1]]
    assert [_l(x) for x in coalesce([], [])] == [[], [], []]
    # descending pages never join a run
    assert _l(coalesce([5, 4], [1, 2])[2]) == [1, 1]


def test_byte_ranges_exact_offsets_with_different_row_counts():
    # 2 layers x (K, V) = 4 slabs; page = 4 rows x 8 bytes = 32 bytes
    src = PoolLayout(num_layers=2, rows=16, page_size=4, row_bytes=8)   # slab 128 bytes
    dst = PoolLayout(num_layers=2, rows=20, page_size=4, row_bytes=8)   # slab 160 bytes
    br = byte_ranges(src, dst, [0, 1, 3], [2, 3, 0])                    # runs: 0,1->2,3 | 3->0
    assert _l(br.src) == [0, 96, 128, 224, 256, 352, 384, 480]
    assert _l(br.dst) == [64, 0, 224, 160, 384, 320, 544, 480]
    assert _l(br.lengths) == [64, 32] * 4
    assert len(br) == 8 and br.nbytes == 4 * 96


def test_byte_ranges_fully_contiguous_is_one_range_per_slab():
    lay = PoolLayout(num_layers=3, rows=64, page_size=16, row_bytes=4)
    br = byte_ranges(lay, lay, [1, 2, 3], [0, 1, 2])
    assert _l(br.lengths) == [192] * 6
    assert _l(br.src) == [s * 256 + 64 for s in range(6)]
    assert _l(br.dst) == [s * 256 for s in range(6)]


def test_byte_ranges_one_kind_state_pool():
    lay = PoolLayout(num_layers=2, rows=8, page_size=1, row_bytes=100, kinds=1)
    br = byte_ranges(lay, lay, [5], [2])
    assert (_l(br.src), _l(br.dst), _l(br.lengths)) == ([500, 1300], [200, 1000], [100, 100])


@pytest.mark.parametrize("src, dst, match", [
    ([0, 1], [0], "src_pages has 2 pages but dst_pages has 1"),
    ([4], [0], "src_pages holds page 4 outside \\[0, 4\\)"),
    ([0], [-1], "dst_pages holds page -1"),
    ([0, 1], [2, 2], "dst_pages repeats a page"),
    ([0.0], [1], "src_pages must hold integers"),
])
def test_byte_ranges_rejects_bad_pages(src, dst, match):
    lay = PoolLayout(num_layers=1, rows=16, page_size=4, row_bytes=8)
    with pytest.raises(ValueError, match=match):
        byte_ranges(lay, lay, src, dst)


def test_incompatible_layouts_name_the_field():
    a = PoolLayout(num_layers=1, rows=16, page_size=4, row_bytes=8)
    b = PoolLayout(num_layers=1, rows=16, page_size=8, row_bytes=8)
    with pytest.raises(ValueError, match="page_size: source 4 vs destination 8"):
        byte_ranges(a, b, [0], [0])
    with pytest.raises(ValueError, match="rows=10 is not a multiple of page_size=4"):
        PoolLayout(num_layers=1, rows=10, page_size=4, row_bytes=8)


def test_split_even():
    assert split_even(np.array([4, 4, 4, 4]), 2) == [slice(0, 2), slice(2, 4)]
    assert split_even(np.array([10, 1, 1, 1]), 2) == [slice(0, 1), slice(1, 4)]
    assert split_even(np.array([4, 4]), 5) == [slice(0, 1), slice(1, 2)]
    assert split_even(np.array([4, 4, 4]), 1) == [slice(0, 3)]
    assert split_even(np.array([], dtype=np.int64), 3) == []


def test_page_table_and_indices():
    lay = PoolLayout(num_layers=1, rows=8, page_size=4, row_bytes=2)    # 2 slabs x 2 pages
    off, ln = page_table(lay)
    assert _l(off) == [0, 8, 16, 24] and _l(ln) == [8] * 4
    assert _l(page_table_indices(lay, [1, 0])) == [1, 0, 3, 2]


def test_offsets_match_kv_pool_layout():
    """Copying the computed byte ranges moves exactly the pool's page rows, every layer and kind."""
    page = 4
    src = KVPool(num_slots=6 * page, page_size=page, num_layers=2, num_kv_heads=2, head_dim=3)
    dst = KVPool(num_slots=4 * page, page_size=page, num_layers=2, num_kv_heads=2, head_dim=3)
    src.kv_data.copy_(torch.randn_like(src.kv_data))
    row_bytes = 2 * 3 * 4
    s_lay = PoolLayout(2, src.kv_data.shape[2], page, row_bytes)
    d_lay = PoolLayout(2, dst.kv_data.shape[2], page, row_bytes)
    sp, dp = [1, 2, 5, 6], [3, 4, 1, 2]
    br = byte_ranges(s_lay, d_lay, sp, dp)
    sb = src.kv_data.view(-1).view(torch.uint8).numpy()
    db = dst.kv_data.view(-1).view(torch.uint8).numpy()
    for s, d, n in zip(br.src, br.dst, br.lengths):
        db[d:d + n] = sb[s:s + n]
    want = torch.zeros_like(dst.kv_data)
    for s, d in zip(sp, dp):
        want[:, :, d * page:(d + 1) * page] = src.kv_data[:, :, s * page:(s + 1) * page]
    assert torch.equal(dst.kv_data, want)
