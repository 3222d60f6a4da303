"""The dependency directions of README.md's layout, checked by walking every import statement.

cluster -> {router, prefill, decode} -> engine -> {cache, transfer} -> core. Prefill and decode
never import each other; cache and transfer never import each other; only the actor shells and
cluster/ import Ray; only transfer/ imports NIXL; core/ imports no torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "core": set(),
    "cache": {"core"},
    "transfer": {"core"},
    "engine": {"core", "cache", "transfer"},
    "router": {"core"},
    "prefill": {"core", "cache", "transfer", "engine"},
    "decode": {"core", "cache", "transfer", "engine"},
    "cluster": {"core", "cache", "transfer", "engine", "router", "prefill", "decode", "bench"},
}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _files(pkg: str):
    return sorted((ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_package_imports_point_one_way(pkg):
    bad = []
    for f in _files(pkg):
        for name in _imports(f):
            parts = name.split(".")
            if parts[0] == "tandem" and len(parts) > 1 and parts[1] in ALLOWED:
                dep = parts[1]
                if dep != pkg and dep not in ALLOWED[pkg]:
                    bad.append(f"{f.relative_to(ROOT)} imports tandem.{dep}")
    assert not bad, "\n".join(bad)


def test_ray_nixl_torch_confined():
    bad = []
    for pkg in ALLOWED:
        for f in _files(pkg):
            rel = f.relative_to(ROOT)
            for name in _imports(f):
                top = name.split(".")[0]
                if top == "ray" and pkg != "cluster" and f.name != "actor.py":
                    bad.append(f"{rel} imports ray (only cluster/ and */actor.py may)")
                if top == "nixl" and pkg != "transfer":
                    bad.append(f"{rel} imports nixl (only transfer/ may)")
                if top == "torch" and pkg == "core":
                    bad.append(f"{rel} imports torch (core/ must not)")
    assert not bad, "\n".join(bad)
