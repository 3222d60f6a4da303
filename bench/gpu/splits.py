"""The decode attention split-K sweep: for context lengths x batch sizes, each split count timed
on the same paged inputs, the fastest kept; its rows become the table the backend's rule reads
(engine/attention/split_rule.py). Every count's output is checked against the single pass."""

from __future__ import annotations

import time
from typing import Any

import torch

from tandem.bench.gpu.kernels import GEOMETRIES, Inputs, Shape, _bench
from tandem.engine.attention.split_rule import SplitTable

SPANS = (512, 2048, 8192)
BATCHES = (1, 4, 16, 64, 128)
SPLITS = (1, 2, 4, 8, 16)
SMOKE: dict[str, Any] = {"geometries": ("tiny",), "spans": (16, 40), "batches": (1, 2), "splits": (1, 2)}


def sweep(device, dtype, budget_s: float, smoke: bool = False) -> dict:
    """``rows`` (geometry, span, batch, programs, microseconds by split count (a string key), the
    fastest count),
    ``table`` (a :class:`SplitTable` as a dict; None when the budget cut the grid short),
    ``mismatches`` (counts whose output left the single pass's tolerance: never picked)."""
    p: dict[str, Any] = SMOKE if smoke else {"geometries": tuple(GEOMETRIES), "spans": SPANS, "batches": BATCHES,
                             "splits": SPLITS}
    cuda = torch.device(device).type == "cuda"
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    t0 = time.perf_counter()
    rows, skipped, mismatches = [], [], []
    for g in p["geometries"]:
        hkv = GEOMETRIES.get(g, (4, 2, 16))[1]
        for span in p["spans"]:
            for b in p["batches"]:
                if time.perf_counter() - t0 > budget_s:
                    skipped.append(f"{g} span={span} B={b}")
                    continue
                x = Inputs(Shape("decode", g, b, span - 1, 1), device, dtype)
                one = x.run(None, 1).float().clone()
                us: dict[str, float] = {}
                for s in p["splits"]:
                    out = x.run(None, s).float()
                    if float((out - one).norm() / one.norm()) > tol:
                        mismatches.append(f"{g} span={span} B={b} splits={s}")
                        continue
                    us[str(s)] = round(_bench(lambda: x.run(None, s), cuda), 2)
                rows.append({"geometry": g, "span": span, "batch": b, "programs": b * hkv, "us": us,
                             "best": int(min(us, key=lambda k: us[k]))})
                del x
    table = None
    if not skipped:
        table = SplitTable.from_rows([(r["span"], r["programs"], r["best"]) for r in rows],
                                     source=f"bench/gpu/splits.py on {device}").to_dict()
    return {"rows": rows, "table": table, "skipped": skipped, "mismatches": mismatches,
            "ok": not mismatches, "seconds": round(time.perf_counter() - t0, 1)}
