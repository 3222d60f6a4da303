"""The regions a worker registers for KV transfer; two peers' agree on all but ``rows``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem.engine.engine import Engine

KV, SWA_ROWS, STATE = "kv", "swa", "state"


@dataclass(frozen=True)
class RegionSpec:
    """One region: the tensor, its page size and how many leading dims precede the row axis."""

    tensor: torch.Tensor
    page_size: int
    slab_dims: int = 2


def kv_regions(engine: Engine) -> dict[str, RegionSpec]:
    """Name -> :class:`RegionSpec` of every pool whose bytes a KV transfer may move."""
    h = engine.hybrid
    out: dict[str, RegionSpec] = {}
    full = h.full_pool if h.active else engine.kv_pool
    if full.layer_ids:
        out[KV] = RegionSpec(full.kv_data, full.page_size)
    if getattr(h, "swa_pool", None) is not None:
        out[SWA_ROWS] = RegionSpec(h.swa_pool.kv_data, 1)
    if getattr(h, "state_pool", None) is not None:
        out[STATE] = RegionSpec(h.state_pool.data, 1, slab_dims=1)
    return out


def transfer_bytes(engine: Engine, pages: dict[str, int]) -> int:
    """Bytes a transfer of ``pages[region]`` pages per region moves (for reports and tests)."""
    total = 0
    for name, n in pages.items():
        spec = kv_regions(engine)[name]
        t = spec.tensor
        rows_axis = spec.slab_dims
        row_bytes = t[(0,) * rows_axis][0].numel() * t.element_size()
        slabs = t.shape[0] * (t.shape[1] if spec.slab_dims == 2 else 1)
        total += n * spec.page_size * row_bytes * slabs
    return total
