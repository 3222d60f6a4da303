"""What a held request's KV is, for the worker that sends it (prefill's prompt, a migrating
decode request's prompt and output): source page ids and, for hybrid models, the rows a
transfer moves besides them. Read on the engine thread (through ``Engine.inspect``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.worker.kv_regions import KV


@dataclass(frozen=True)
class HeldKV:
    pages: tuple[int, ...]      # source page ids of positions [start, end of its KV)
    cached_tokens: int          # prompt tokens this worker's prefix cache served
    rows: dict[str, tuple[int, ...]] = field(default_factory=dict)   # hybrid: "swa", "state"

    def source(self, region: str) -> tuple[int, ...]:
        """Source ids of ``region`` ("kv": the pages)."""
        return self.pages if region == KV else self.rows[region]


def held_kv(engine, rid: str, start: int) -> HeldKV:
    """Engine thread: the source ids of held ``rid``'s KV positions ``[start, computed_len)`` (a
    prefill's prompt; a migrating request's prompt and output but the last token) and, for
    hybrid models, the rows a transfer moves past ``start``. KeyError if ``rid`` is not held."""
    sr, kv = engine.scheduler.detached[rid], engine.kv
    return HeldKV(kv.pages(sr, start, sr.req.computed_len), sr.req.cached_len, kv.transfer_rows(sr, start))
