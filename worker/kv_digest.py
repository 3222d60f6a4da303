"""KV page digests for ``--kv-digest`` (BLAKE2b over the same rows on both sides; worker/README.md)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem.worker.kv_regions import RegionSpec


def _rows(pages: Sequence[int], page_size: int, device: torch.device) -> torch.Tensor:
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


def _update(h: hashlib.blake2b, data: torch.Tensor, pages: Sequence[int], page_size: int, axis: int) -> None:
    """Feed ``h`` the rows of ``pages`` along ``axis``, slab by slab, pages in list order."""
    if not len(pages):
        return
    if data.device.type != "cpu" or not data.is_contiguous():
        part = data.index_select(axis, _rows(pages, page_size, data.device))
        part = part.reshape(-1, *part.shape[axis:]).contiguous().cpu()
        for slab in part:
            h.update(slab.view(torch.uint8).numpy())
        return
    runs = _runs(pages)
    for slab in data.reshape(-1, *data.shape[axis:]):
        for a, b in runs:
            h.update(slab[a * page_size:b * page_size].view(torch.uint8).numpy())


def page_digest(kv_data: torch.Tensor, pages: Sequence[int], page_size: int) -> str:
    """Hex digest of ``pages`` of a ``[L, 2, rows, H_kv, D]`` pool (any dtype, any device)."""
    h = hashlib.blake2b(digest_size=16)
    _update(h, kv_data, pages, page_size, 2)
    return h.hexdigest()


def regions_digest(regions: Mapping[str, RegionSpec], named_pages: Sequence[tuple[str, Sequence[int]]]) -> str:
    """Hex digest of ``named_pages`` (``[(region, pages)]``, in the transfer's order)."""
    h = hashlib.blake2b(digest_size=16)
    for name, pages in named_pages:
        spec = regions[name]
        _update(h, spec.tensor, pages, spec.page_size, spec.slab_dims)
    return h.hexdigest()


def corrupt_page(data: torch.Tensor, pages: Sequence[int], page_size: int) -> None:
    """Test lever: perturb slab 0 of the first page, as a bad transfer would."""
    if len(pages):
        r = pages[0] * page_size
        if data.dim() >= 4:
            data[0, 0, r:r + page_size] += 1.0
        else:
            data[0, r:r + page_size] += 1.0
