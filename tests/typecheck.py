"""The type check of `make test-quick` and `make test` (issue 49): mypy over the product packages.

mypy names a module by its path, and the product's folders become ``tandem.<package>`` only through
pyproject's package-dir (setuptools' editable finder, an import hook mypy does not run). So this
script links build/typecheck/tandem/ to the real folders (one link per package-dir entry, read from
pyproject.toml), runs mypy there with pyproject's [tool.mypy] (mypy_path points at the links), and
prints every error at its real path (``core/types.py:12``, not the link's).

The folders named in [tool.tandem.typecheck] baseline are checked but not yet clean: their errors
are counted against the recorded number; more fails the check, fewer asks to lower the number.

Usage: .venv/bin/python tests/typecheck.py [--show-baselined]
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"
LINE = re.compile(r"^(?P<path>[^:\s]+\.py):\d+(?::\d+)?: (?P<kind>error|note):")


def link_tree(package_dir: dict[str, str], root: Path = ROOT, tree: Path = TREE) -> dict[str, str]:
    """Make ``tree``/tandem/ the package ``package_dir`` maps (links to the folders under ``root``,
    and to the import root's own modules); returns each link's path -> the real one, relative to
    ``root`` (a folder's with a trailing slash)."""
    top = tree / "tandem"
    top.mkdir(parents=True, exist_ok=True)
    wanted: dict[str, Path] = {}
    for name, folder in package_dir.items():
        if name == "tandem":
            wanted.update({f.name: f for f in (root / folder).iterdir() if f.suffix == ".py"})
        else:
            wanted[name.split(".", 1)[1]] = root / folder
    for entry in top.iterdir():         # what is no longer wanted, or points elsewhere, goes
        target = wanted.get(entry.name)
        if entry.is_symlink() and target is not None and os.readlink(entry) == os.path.relpath(target, top):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    links = {}
    for name, target in wanted.items():
        if not (top / name).is_symlink():
            (top / name).symlink_to(os.path.relpath(target, top))
        slash = "/" if target.is_dir() else ""
        links[os.path.relpath(top / name, root) + slash] = os.path.relpath(target, root) + slash
    return links


@dataclass
class Verdict:
    shown: list[str] = field(default_factory=list)      # mypy's lines outside the baseline, real paths
    errors: int = 0                                     # errors outside the baseline
    counted: dict[str, int] = field(default_factory=dict)   # baselined folder -> its errors now


def judge(output: str, links: dict[str, str], baseline: dict[str, int], show_baselined: bool = False) -> Verdict:
    """mypy's ``output`` at real paths, split into what fails the check and what the baseline counts."""
    v = Verdict(counted=dict.fromkeys(baseline, 0))
    for line in output.splitlines():
        m = LINE.match(line)
        if m is None:
            continue                    # mypy's own summary; the caller prints ours
        path = next((real + m["path"][len(link):] for link, real in links.items()
                     if m["path"].startswith(link)), m["path"])
        owner = next((prefix for prefix in baseline if path.startswith(prefix)), None)
        if m["kind"] == "error":
            if owner is None:
                v.errors += 1
            else:
                v.counted[owner] += 1
        if owner is None or show_baselined:
            v.shown.append(path + line[len(m["path"]):])
    return v


def main(argv: list[str]) -> int:
    with open(ROOT / "pyproject.toml", "rb") as f:
        config = tomllib.load(f)
    links = link_tree(config["tool"]["setuptools"]["package-dir"])
    baseline: dict[str, int] = config["tool"]["tandem"]["typecheck"]["baseline"]
    start = time.monotonic()
    # a child process: mypy's command line skips the interpreter's teardown of its ~2 GB of
    # objects, which from mypy.api takes as long again as the check
    run = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    took = time.monotonic() - start
    if run.stderr.strip() or run.returncode not in (0, 1):
        print(run.stdout + run.stderr, end="")
        print(f"typecheck: mypy failed to run (exit {run.returncode})")
        return 2
    v = judge(run.stdout, links, baseline, "--show-baselined" in argv)
    print("\n".join(v.shown), end="\n" if v.shown else "")
    worse = False
    for prefix, n in v.counted.items():
        if n > baseline[prefix]:
            worse = True
            print(f"typecheck: {prefix} has {n} errors, its baseline {baseline[prefix]} "
                  f"(--show-baselined prints them; fix the new ones)")
        elif n < baseline[prefix]:
            print(f"typecheck: {prefix} has {n} errors, fewer than its baseline {baseline[prefix]}: "
                  f"lower it to {n} in pyproject.toml [tool.tandem.typecheck]")
    summary = ", ".join(f"{p} {n}" for p, n in v.counted.items())
    print(f"typecheck: {v.errors} errors outside the baseline ({summary} baselined) in {took:.1f} s")
    return 1 if v.errors or worse else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
