"""The memory regions a worker registers for KV transfer, by name (written once, for the agent
registration in role_worker.py and for the ``--kv-digest`` of both roles).

=========  ==========================================  =========  ==========  ====================
region     tensor                                      page_size  slab_dims   ids a transfer names
=========  ==========================================  =========  ==========  ====================
``kv``     full layers' pool ``[L_full, 2, rows, H, D]``  cache's    2           full pages
``swa``    SWA pool ``[L_swa, 2, rows, H, D]``         1          2           SWA rows
``state``  state pool ``[L_mamba, slots + 1, numel]``  1          1           state rows
=========  ==========================================  =========  ==========  ====================

``kv`` is absent when no layer is "full" (every layer sliding-window): its pool has no bytes.
FULL-only models have ``kv`` alone. Regions of the two workers of a transfer must agree on
everything but ``rows`` (transfer/descriptors.py ``PoolLayout.check_compatible``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV, SWA_ROWS, STATE = "kv", "swa", "state"


@dataclass(frozen=True)
class RegionSpec:
    """One region: the tensor, its page size and how many leading dims precede the row axis."""

    tensor: torch.Tensor
    page_size: int
    slab_dims: int = 2


def kv_regions(engine) -> dict[str, RegionSpec]:
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


def transfer_bytes(engine, pages: dict[str, int]) -> int:
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
