"""How many key ranges a decode sequence's attention is split into on a GPU (1: the single-pass
kernel, no merge), read from a table a tuning sweep measured (bench/gpu/splits.py)."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass


@dataclass(frozen=True)
class SplitTable:
    """``splits[i][j]``: the split count for ``spans[i]`` keys and ``programs[j]`` = batch size x KV
    heads."""

    spans: tuple[int, ...]
    programs: tuple[int, ...]
    splits: tuple[tuple[int, ...], ...]
    source: str = ""

    def __post_init__(self):
        ok = (self.spans and self.programs and len(self.splits) == len(self.spans)
              and all(len(r) == len(self.programs) for r in self.splits)
              and all(a < b for a, b in zip(self.spans, self.spans[1:]))
              and all(a < b for a, b in zip(self.programs, self.programs[1:]))
              and all(n >= 1 for r in self.splits for n in r))
        if not ok:
            raise ValueError(f"not a split table: spans {self.spans}, programs {self.programs}, "
                             f"splits {self.splits}")

    @classmethod
    def from_rows(cls, rows: list[tuple[int, int, int]], source: str = "") -> "SplitTable":
        """The table of ``(span, programs, splits)`` rows; ValueError unless they fill the grid."""
        spans = tuple(sorted({r[0] for r in rows}))
        programs = tuple(sorted({r[1] for r in rows}))
        cell = {(s, p): n for s, p, n in rows}
        missing = [(s, p) for s in spans for p in programs if (s, p) not in cell]
        if missing:
            raise ValueError(f"split table rows leave cells empty: {missing[:8]}")
        return cls(spans, programs, tuple(tuple(cell[s, p] for p in programs) for s in spans), source)

    def to_dict(self) -> dict:
        return {"spans": list(self.spans), "programs": list(self.programs),
                "splits": [list(r) for r in self.splits], "source": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> "SplitTable":
        return cls(tuple(d["spans"]), tuple(d["programs"]), tuple(tuple(r) for r in d["splits"]),
                   d.get("source", ""))


def choose_splits(table: SplitTable, span: int, batch_size: int, num_kv_heads: int) -> int:
    """The count in the row of the largest tabled span <= ``span`` and the column of the largest
    tabled programs <= ``batch_size * num_kv_heads`` (the first row / column below the table), never
    more than ``span`` (one key per split at least)."""
    i = max(bisect_right(table.spans, span) - 1, 0)
    j = max(bisect_right(table.programs, batch_size * num_kv_heads) - 1, 0)
    return max(1, min(table.splits[i][j], span))


DEFAULT_SPLITS = SplitTable(
    spans=(128, 256, 512, 1024, 2048),
    programs=(8, 32, 64, 128, 256, 512),
    splits=((1, 1, 1, 1, 1, 1),
            (2, 2, 2, 2, 2, 1),
            (4, 4, 4, 3, 2, 1),
            (8, 8, 5, 3, 2, 1),
            (16, 9, 5, 3, 2, 1)),
    source="pending the H200 sweep")
