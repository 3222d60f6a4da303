"""KV integrity on the prefill -> decode handoff (``--kv-digest``).

Both sides hash the same bytes in the same order: for every layer and kind (K, V) of the pool
(``kv_data: [L, 2, rows, H_kv, D]``, page ``p`` = rows ``[p * page_size, (p + 1) * page_size)``),
the rows of the given pages in page-list order, with BLAKE2b (16-byte digest). On the CPU each
maximal run of consecutive pages is hashed in place (no gathered copy; what hashing costs:
docs/PERFORMANCE.md, bench/kv_digest.py); on a GPU the rows are gathered and copied to the host once. Prefill digests the source pages it
writes; decode digests its destination pages once the write is done and refuses to decode on a
mismatch (SGLang and vLLM added the same check after silent-corruption reports).

Hybrid models move several regions (worker/kv_regions.py): :func:`regions_digest` hashes each
region's rows (page rows along the region's row axis) in the transfer's region order; with only
``kv`` it equals :func:`page_digest`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch


def _rows(pages: Sequence[int], page_size: int, device) -> torch.Tensor:
    p = torch.as_tensor(list(pages), dtype=torch.int64)
    rows = (p[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()
    return rows.to(device)


def _runs(pages: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs ``[a, b)`` of consecutive page ids, in list order."""
    out: list[tuple[int, int]] = []
    for p in pages:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def _update(h, data: torch.Tensor, pages: Sequence[int], page_size: int, axis: int) -> None:
    """Feed ``h`` the rows of ``pages`` along ``axis`` of ``data``, slab by slab (each index of
    the ``axis`` leading dims), pages in list order: the same bytes on every device."""
    if not len(pages):
        return
    if data.device.type != "cpu" or not data.is_contiguous():
        part = data.index_select(axis, _rows(pages, page_size, data.device))      # [*slabs, n, ...]
        part = part.reshape(-1, *part.shape[axis:]).contiguous().cpu()
        for slab in part:
            h.update(slab.view(torch.uint8).numpy())
        return
    runs = _runs(pages)
    for slab in data.reshape(-1, *data.shape[axis:]):              # [rows, ...], contiguous
        for a, b in runs:
            h.update(slab[a * page_size:b * page_size].view(torch.uint8).numpy())


def page_digest(kv_data: torch.Tensor, pages: Sequence[int], page_size: int) -> str:
    """Hex digest of ``pages`` of a ``[L, 2, rows, H_kv, D]`` pool (any dtype, any device)."""
    h = hashlib.blake2b(digest_size=16)
    _update(h, kv_data, pages, page_size, 2)
    return h.hexdigest()


def regions_digest(regions: Mapping, named_pages: Sequence[tuple[str, Sequence[int]]]) -> str:
    """Hex digest of several regions' pages: ``named_pages`` is ``[(region, pages)]`` in the
    transfer's order; ``regions`` maps a name to its ``RegionSpec`` (worker/kv_regions.py)."""
    h = hashlib.blake2b(digest_size=16)
    for name, pages in named_pages:
        spec = regions[name]
        _update(h, spec.tensor, pages, spec.page_size, spec.slab_dims)
    return h.hexdigest()


def corrupt_page(data: torch.Tensor, pages: Sequence[int], page_size: int) -> None:
    """Test lever: perturb slab 0 of the first page (layer 0's K of a ``[L, 2, rows, ...]`` pool,
    layer 0 of a ``[L, rows, ...]`` state pool): what a bad transfer would do."""
    if len(pages):
        r = pages[0] * page_size
        if data.dim() >= 4:
            data[0, 0, r:r + page_size] += 1.0
        else:
            data[0, r:r + page_size] += 1.0
