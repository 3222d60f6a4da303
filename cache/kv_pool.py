"""Device KV pool: per-layer K and V buffers addressed by slot id."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerKV:

    k: torch.Tensor
    v: torch.Tensor
    index_map: torch.Tensor | None = None


class KVPool:
    def __init__(
        self,
        num_slots: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        layer_ids: list[int] | None = None,
        pin_memory: bool = False,
    ):
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.layer_ids = list(range(num_layers)) if layer_ids is None else list(layer_ids)
        self._local = {lid: i for i, lid in enumerate(self.layer_ids)}
        rows = num_slots + page_size
        # kv_data: [L, 2, rows, H_kv, D]
        self.kv_data = torch.zeros(
            (len(self.layer_ids), 2, rows, num_kv_heads, head_dim), dtype=dtype, device=device,
            pin_memory=pin_memory and self.device.type == "cpu" and torch.cuda.is_available())
        self.k_buffer = [self.kv_data[i, 0] for i in range(len(self.layer_ids))]
        self.v_buffer = [self.kv_data[i, 1] for i in range(len(self.layer_ids))]

    @property
    def bytes_per_token(self) -> int:
        return len(self.layer_ids) * 2 * self.num_kv_heads * self.head_dim * self.kv_data.element_size()

    def has_layer(self, layer_id: int) -> bool:
        return layer_id in self._local

    def layer(self, layer_id: int) -> LayerKV:
        i = self._local[layer_id]
        return LayerKV(self.k_buffer[i], self.v_buffer[i])

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of new tokens. loc: int64 [T]; k, v: [T, H_kv, D]."""
        i = self._local[layer_id]
        self.k_buffer[i][loc] = k.to(self.dtype)
        self.v_buffer[i][loc] = v.to(self.dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from slots ``src`` to slots ``dst`` (same length)."""
        self.kv_data[:, :, dst] = self.kv_data[:, :, src]


class HybridKVPool:
    """The KV pool a hybrid model's attention backend sees: "full" layers in the full pool (rows =
    full slots), "swa" layers in the SWA pool (rows = ``index_map[full slot]``)."""

    def __init__(self, full: KVPool, swa: KVPool | None, index_map: torch.Tensor | None):
        self.full, self.swa, self.index_map = full, swa, index_map
        self.page_size, self.device, self.dtype = full.page_size, full.device, full.dtype
        self.num_slots, self.kv_data = full.num_slots, full.kv_data
        self._swa_layers = ({lid: LayerKV(swa.layer(lid).k, swa.layer(lid).v, index_map) for lid in swa.layer_ids}
                            if swa is not None else {})

    @property
    def bytes_per_token(self) -> int:
        return self.full.bytes_per_token

    def has_layer(self, layer_id: int) -> bool:
        return self.full.has_layer(layer_id) or layer_id in self._swa_layers

    def layer(self, layer_id: int) -> LayerKV:
        lkv = self._swa_layers.get(layer_id)
        return lkv if lkv is not None else self.full.layer(layer_id)
