"""Where a suite run's time goes, and what scales worst between two runs (issue 50, item 4).

``make test`` writes every test's phases (setup, call, teardown) to ``build/test-times.xml``
(pytest's JUnit XML). This reads one such file and prints the modules by total seconds; given two
(a quiet run, then one on a slower or busier CPU), it prints per module both totals and their
ratio, worst first: the modules that scale worst are where a slower machine loses its time.

    python tests/durations.py build/test-times.xml                 # one run: the heaviest modules
    python tests/durations.py quiet.xml busy.xml --top 25          # two runs: what scales worst

Module seconds are summed over its tests' phases (a module-scoped fixture's start is in its first
test's setup), so they add up to the worker-seconds of the run (about 2x its wall time under
``-n 2``), not to the wall time.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def module_seconds(path: str | Path) -> dict[str, float]:
    """Seconds per test module (``tests/x/test_y.py``) of one JUnit XML file."""
    out: dict[str, float] = defaultdict(float)
    for case in ET.parse(path).getroot().iter("testcase"):
        cls = case.get("classname", "")
        parts = cls.split(".")
        mod = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        out["/".join(parts[:mod + 1]) + ".py"] += float(case.get("time") or 0.0)
    return dict(out)


def table(rows: list[tuple], header: tuple) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), *map(line, rows)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("runs", nargs="+", help="one or two JUnit XML files (pytest --junitxml)")
    ap.add_argument("--top", type=int, default=30, help="modules to print (default 30)")
    args = ap.parse_args(argv)
    if len(args.runs) > 2:
        ap.error("give one run, or two to compare")
    for p in args.runs:
        if not Path(p).is_file():
            ap.error(f"{p}: no such file (make test writes build/test-times.xml)")
    runs = [module_seconds(p) for p in args.runs]
    total = [sum(r.values()) for r in runs]
    if len(runs) == 1:
        rows = sorted(runs[0].items(), key=lambda kv: -kv[1])[:args.top]
        print(table([(m, f"{s:.1f}", f"{100 * s / total[0]:.1f}%") for m, s in rows], ("module", "s", "share")))
        print(f"\n{len(runs[0])} modules, {total[0]:.0f} worker-seconds")
        return 0
    a, b = runs
    common = [m for m in a if m in b]
    rows = sorted(((m, a[m], b[m], b[m] - a[m], b[m] / a[m] if a[m] else float("inf")) for m in common),
                  key=lambda r: -r[3])[:args.top]
    print(table([(m, f"{x:.1f}", f"{y:.1f}", f"{d:+.1f}", f"{q:.2f}x") for m, x, y, d, q in rows],
                ("module (most seconds added first)", "run 1 s", "run 2 s", "added", "ratio")))
    print(f"\nrun 1: {total[0]:.0f} worker-seconds, run 2: {total[1]:.0f} ({total[1] / total[0]:.2f}x); "
          f"modules only in one run: {len(set(a) ^ set(b))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
