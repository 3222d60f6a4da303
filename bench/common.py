"""What the benchmark scripts share: a parser with their common flags, timing, medians, and the
JSON report each one writes (by default bench/out/NAME.json).

    from tandem.bench.common import bench_parser, medians, write_report

    def main(argv=None) -> int:
        ap = bench_parser(__doc__, "kv_digest", repeats=5, threads=1)   # --repeats, --threads, --out
        ap.add_argument("--sizes", default="256,1024,2048")
        args = ap.parse_args(argv)
        ...
        write_report(args.out, rows)      # makes the folder, writes the JSON, prints "wrote PATH"

Standard library only: bench/gpu_check.py runs on the device machine's bare install. Percentiles
stay in their scripts: each one's definition is part of the figures it has published.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent / "out"      # bench/out/ (git-ignored)


def default_out(name: str) -> str:
    """bench/out/NAME.json, whatever the working directory."""
    return str(OUT_DIR / f"{name}.json")


def bench_parser(doc: str | None, name: str | None = None, *, full_doc: bool = False,
                 repeats: int | None = None, threads: int | None = None,
                 seed: int | None = None) -> argparse.ArgumentParser:
    """A script's parser. Its description is ``doc``'s first paragraph, or all of ``doc`` as written
    with ``full_doc``. ``name`` adds ``--out`` (default :func:`default_out`); ``repeats``,
    ``threads`` and ``seed`` each add that flag with that default."""
    doc = (doc or "").strip()
    ap = argparse.ArgumentParser(
        description=doc if full_doc else doc.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter if full_doc else argparse.HelpFormatter)
    if repeats is not None:
        ap.add_argument("--repeats", type=int, default=repeats,
                        help=f"rounds of each measurement (default {repeats})")
    if threads is not None:
        ap.add_argument("--threads", type=int, default=threads, help=f"torch threads (default {threads})")
    if seed is not None:
        ap.add_argument("--seed", type=int, default=seed, help=f"seed of every random draw (default {seed})")
    if name is not None:
        ap.add_argument("--out", default=default_out(name),
                        help=f"where the JSON report goes (default bench/out/{name}.json)")
    return ap


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes (wall clock)."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn``, in seconds."""
    return min(timed(fn) for _ in range(repeats))


def medians(rows: Iterable[Mapping], keys: Iterable[str] | None = None) -> dict:
    """``{key: the median of row[key] over rows}`` for each of ``keys`` (default: the first row's)."""
    rows = list(rows)
    keys = list(rows[0]) if keys is None else list(keys)
    return {k: statistics.median(r[k] for r in rows) for k in keys}


def write_report(path: str | Path, payload, *, indent: int = 1, default: Callable | None = None) -> Path:
    """Write ``payload`` as JSON to ``path`` (making its folder), print where, return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=indent, default=default))
    print(f"wrote {path}", flush=True)
    return path
