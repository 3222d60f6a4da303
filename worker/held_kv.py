"""A held request's source page ids (and hybrid rows), read on the engine thread."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.worker.kv_regions import KV

if TYPE_CHECKING:
    from tandem.engine.engine import Engine


@dataclass(frozen=True)
class HeldKV:
    pages: tuple[int, ...]
    cached_tokens: int
    rows: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def source(self, region: str) -> tuple[int, ...]:
        """Source ids of ``region`` ("kv": the pages)."""
        return self.pages if region == KV else self.rows[region]


def held_kv(engine: Engine, rid: str, start: int) -> HeldKV:
    """Engine thread: held ``rid``'s source ids from ``start`` (and hybrid rows); KeyError if not held."""
    sr, kv = engine.scheduler.detached[rid], engine.kv
    return HeldKV(kv.pages(sr, start, sr.req.computed_len), sr.req.cached_len, kv.transfer_rows(sr, start))
