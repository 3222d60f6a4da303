"""Page ids -> byte ranges (pure numpy) over core/pool_layout.py's geometry; consecutive pages on
both sides form one range per slab."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem.core.pool_layout import PoolLayout


@dataclass(frozen=True)
class ByteRanges:
    """Parallel int64 ``[n]`` arrays: ``lengths[i]`` bytes from ``src[i]`` to ``dst[i]``, slab-major."""

    src: np.ndarray
    dst: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


def _as_pages(pages, name: str, num_pages: int) -> np.ndarray:
    a = np.asarray(pages)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {a.dtype}")
    a = a.astype(np.int64, copy=False)
    if a.size and (a.min() < 0 or a.max() >= num_pages):
        bad = a[(a < 0) | (a >= num_pages)][0]
        raise ValueError(f"{name} holds page {int(bad)} outside [0, {num_pages})")
    return a


def coalesce(src_pages, dst_pages) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of pages consecutive on both sides: int64 ``(src_start, dst_start, count)``, input order."""
    s = np.asarray(src_pages, dtype=np.int64)
    d = np.asarray(dst_pages, dtype=np.int64)
    if s.shape != d.shape or s.ndim != 1:
        raise ValueError(f"src_pages and dst_pages must be 1-D of equal length, got {s.shape} and {d.shape}")
    if s.size == 0:
        e = np.zeros(0, dtype=np.int64)
        return e, e.copy(), e.copy()
    # a new run starts where either side does not continue the previous page
    brk = (np.diff(s) != 1) | (np.diff(d) != 1)
    starts = np.concatenate(([0], np.flatnonzero(brk) + 1))
    counts = np.diff(np.append(starts, s.size))
    return s[starts], d[starts], counts


def byte_ranges(src: PoolLayout, dst: PoolLayout, src_pages, dst_pages) -> ByteRanges:
    """Byte ranges copying ``src_pages`` into ``dst_pages`` in every slab. ValueError: incompatible
    layouts, unequal lengths, out-of-range or repeated destination pages."""
    src.check_compatible(dst)
    s = _as_pages(src_pages, "src_pages", src.num_pages)
    d = _as_pages(dst_pages, "dst_pages", dst.num_pages)
    if s.shape != d.shape:
        raise ValueError(f"src_pages has {s.size} pages but dst_pages has {d.size}")
    if d.size and np.unique(d).size != d.size:
        raise ValueError("dst_pages repeats a page; two sources would write the same destination")
    s0, d0, n = coalesce(s, d)
    slabs = np.arange(src.num_slabs, dtype=np.int64)[:, None]
    pb = src.page_bytes
    src_off = (slabs * src.slab_bytes + s0[None, :] * pb).reshape(-1)
    dst_off = (slabs * dst.slab_bytes + d0[None, :] * pb).reshape(-1)
    lengths = np.broadcast_to(n[None, :] * pb, (src.num_slabs, n.size)).reshape(-1).copy()
    return ByteRanges(src_off, dst_off, lengths)


def split_even(lengths: np.ndarray, parts: int) -> list[slice]:
    """At most ``parts`` contiguous, never empty slices of ``lengths`` of about equal bytes."""
    n = len(lengths)
    parts = max(1, min(parts, n))
    if n == 0:
        return []
    cum = np.cumsum(np.asarray(lengths, dtype=np.int64))
    targets = cum[-1] * np.arange(1, parts) / parts
    # cut after the first entry whose running total reaches each target
    cuts = np.searchsorted(cum, targets, side="left") + 1
    bounds = np.unique(np.concatenate(([0], np.clip(cuts, 1, n), [n])))
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def page_table(layout: PoolLayout) -> tuple[np.ndarray, np.ndarray]:
    """int64 ``(offsets, lengths)`` of every (slab, page), entry ``slab * num_pages + page``."""
    slabs = np.arange(layout.num_slabs, dtype=np.int64)[:, None]
    pages = np.arange(layout.num_pages, dtype=np.int64)[None, :]
    off = (slabs * layout.slab_bytes + pages * layout.page_bytes).reshape(-1)
    return off, np.full(off.shape, layout.page_bytes, dtype=np.int64)


def page_table_indices(layout: PoolLayout, pages) -> np.ndarray:
    """Indices into :func:`page_table` for ``pages`` of every slab, slab-major (int64 ``[S*len]``)."""
    p = _as_pages(pages, "pages", layout.num_pages)
    slabs = np.arange(layout.num_slabs, dtype=np.int64)[:, None]
    return (slabs * layout.num_pages + p[None, :]).reshape(-1)
