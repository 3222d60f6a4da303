"""Recurrent-state pool: one row of every recurrent layer's state per request or checkpoint."""

from __future__ import annotations

import torch


class StatePool:
    """Recurrent state rows: ``data [L_mamba, num_slots + 1, *state_shape]`` float32; row 0 is
    padding. ``layer(id)`` is the ``[num_slots + 1, *state_shape]`` view of one recurrent layer."""

    def __init__(self, num_slots: int, layer_ids: list[int], state_shape: tuple[int, ...],
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.num_slots = num_slots
        self.layer_ids = list(layer_ids)
        self._local = {lid: i for i, lid in enumerate(self.layer_ids)}
        self.data = torch.zeros((len(self.layer_ids), num_slots + 1, *state_shape), dtype=dtype,
                                device=device)

    @property
    def bytes_per_slot(self) -> int:
        return self.data[:, 0].numel() * self.data.element_size()

    def layer(self, layer_id: int) -> torch.Tensor:
        return self.data[self._local[layer_id]]

    def copy(self, src: int, dst: int) -> None:
        self.data[:, dst] = self.data[:, src]

    def zero(self, row: int) -> None:
        self.data[:, row] = 0
