"""The geometry of one registered KV region (layers x kinds slabs of ``rows`` rows, cut into
pages): what a handshake carries and what turns page ids into byte ranges (transfer/descriptors.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolLayout:
    """Geometry of one region. The two sides of a transfer may differ only in ``rows``."""

    num_layers: int
    rows: int
    page_size: int
    row_bytes: int
    kinds: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "rows", "page_size", "row_bytes", "kinds"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"PoolLayout.{name} must be a positive int, got {v!r}")
        if self.rows % self.page_size:
            raise ValueError(f"PoolLayout.rows={self.rows} is not a multiple of page_size={self.page_size}")

    @property
    def num_slabs(self) -> int:
        return self.num_layers * self.kinds

    @property
    def num_pages(self) -> int:
        return self.rows // self.page_size

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.row_bytes

    @property
    def slab_bytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def nbytes(self) -> int:
        return self.num_slabs * self.slab_bytes

    def check_compatible(self, other: "PoolLayout") -> None:
        """Raise ValueError unless pages of ``self`` can be copied into pages of ``other``."""
        for name in ("num_layers", "kinds", "page_size", "row_bytes"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                raise ValueError(f"layouts differ in {name}: source {a} vs destination {b}")
