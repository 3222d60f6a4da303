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
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"
ERROR = re.compile(r"^(?P<path>[^:\s]+\.py):\d+(?::\d+)?: (?P<kind>error|note):")


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def link_tree(package_dir: dict[str, str]) -> dict[str, str]:
    """Build TREE/tandem/ as links to the folders of ``package_dir``; return link prefix -> real prefix."""
    top = TREE / "tandem"
    top.mkdir(parents=True, exist_ok=True)
    wanted: dict[str, Path] = {}
    for name, folder in package_dir.items():
        if name == "tandem":  # the import root's own files, linked one by one beside the packages
            for entry in (ROOT / folder).iterdir():
                if entry.suffix == ".py":
                    wanted[entry.name] = entry
        else:
            wanted[name.split(".", 1)[1]] = ROOT / folder
    for entry in top.iterdir():  # a package or file that is gone (or moved) loses its link
        if entry.name not in wanted or os.readlink(entry) != os.path.relpath(wanted[entry.name], top):
            entry.unlink()
    for name, target in wanted.items():
        if not (top / name).is_symlink():
            (top / name).symlink_to(os.path.relpath(target, top))
    shown = {}
    for name, target in wanted.items():
        rel = os.path.relpath(target, ROOT)
        shown[f"{os.path.relpath(top / name, ROOT)}{'/' if target.is_dir() else ''}"] = (
            f"{rel}/" if target.is_dir() else rel)
    return shown


def real_path(path: str, links: dict[str, str]) -> str:
    for link, real in links.items():
        if path == link or path.startswith(link):
            return real + path[len(link):]
    return path


def main(argv: list[str]) -> int:
    from mypy import api

    show_baselined = "--show-baselined" in argv
    config = _pyproject()
    links = link_tree(config["tool"]["setuptools"]["package-dir"])
    baseline: dict[str, int] = config["tool"]["tandem"]["typecheck"]["baseline"]
    os.chdir(ROOT)
    start = time.monotonic()
    stdout, stderr, status = api.run([])
    took = time.monotonic() - start
    if stderr.strip() or status not in (0, 1):
        print(stdout + stderr, end="")
        print(f"typecheck: mypy failed to run (exit {status})")
        return 2
    counted = dict.fromkeys(baseline, 0)
    errors = 0
    hidden = False
    for line in stdout.splitlines():
        m = ERROR.match(line)
        if m is None:
            continue  # mypy's own summary; ours follows
        path = real_path(m["path"], links)
        line = path + line[len(m["path"]):]
        owner = next((prefix for prefix in baseline if path.startswith(prefix)), None)
        if m["kind"] == "error":
            if owner is None:
                errors += 1
            else:
                counted[owner] += 1
        hidden = owner is not None and not show_baselined
        if not hidden:
            print(line)
    worse = {p: (n, baseline[p]) for p, n in counted.items() if n > baseline[p]}
    better = {p: (n, baseline[p]) for p, n in counted.items() if n < baseline[p]}
    for prefix, (n, allowed) in worse.items():
        print(f"typecheck: {prefix} has {n} errors, its baseline {allowed} "
              f"(--show-baselined prints them; fix the new ones)")
    for prefix, (n, allowed) in better.items():
        print(f"typecheck: {prefix} has {n} errors, fewer than its baseline {allowed}: "
              f"lower [tool.tandem.typecheck] baseline in pyproject.toml to {n}")
    summary = ", ".join(f"{p} {n}" for p, n in counted.items())
    print(f"typecheck: {errors} errors outside the baseline ({summary} baselined) in {took:.1f} s")
    return 1 if errors or worse else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
