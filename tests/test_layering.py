"""The dependency directions of README.md's layout, checked by walking every import statement.

cluster -> {router, prefill, decode, sim} -> worker -> {engine, transfer}; engine -> cache ->
core, transfer -> core (engine and transfer never import each other); prefill and decode import
only worker/ and core/: they reach their engine and the transfer layer through worker/ (its
handles, connectors and the KV handoff), and the wire messages and transfer states they read live
in core/ (they cross processes); sim -> {router, cache} (the simulated engine serves through the
router's dispatcher); loadtest -> {engine, router} (it drives a server over HTTP; its oracle runs
a fresh engine behind the real front door); workloads (the vendored traces: paths only) imports
nothing, and sim and loadtest read their default traces from it. Prefill and decode never import
each other; cache and transfer never import each other; nothing of the product imports bench/
(bench drives the product: it may import every room); only tandem/cli.py, the command line's
composition root, sits above cluster/ and the commands beside it (loadtest/, sim/replay/), and
nothing imports it. Only the actor shells, cluster/ and bench's cluster benchmarks import Ray;
only transfer/ imports NIXL; core/ imports no torch. Inside the packages, no two modules import
each other, directly or round a circle (function-level imports count too); KNOWN_CYCLES names the
ones with an owner. Tests never import bench/ (their support lives in tests/support/ or, shared
with bench/, in the product), except bench's own tests in tests/bench/; and bench/ never imports
tests/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = {
    "core": set(),
    "cache": {"core"},
    "transfer": {"core"},
    "engine": {"core", "cache"},
    "worker": {"core", "cache", "transfer", "engine"},
    "router": {"core"},
    "prefill": {"core", "worker"},
    "decode": {"core", "worker"},
    "sim": {"core", "cache", "router", "workloads"},
    "cluster": {"core", "cache", "transfer", "engine", "worker", "router", "prefill", "decode", "sim"},
    "workloads": set(),
    "loadtest": {"core", "engine", "router", "workloads"},
}
ALLOWED = {**PRODUCT, "bench": set(PRODUCT)}
# Circles that exist and have an owner; the cycle test fails on any other (none today).
KNOWN_CYCLES: set[str] = set()
TOP = "tandem"          # tandem/: the package root and the command line's composition root


def _imports(path: Path, module: str | None = None) -> list[str]:
    """Every module ``path`` imports; relative imports resolved when ``module`` is given."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and module is not None:
            base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = base[:len(base) - node.level + 1] + ([node.module] if node.module else [])
            names += [".".join(base)] + [".".join(base + [a.name]) for a in node.names]
    return names


def _files(pkg: str):
    return sorted((ROOT / pkg).rglob("*.py"))


def _module(f: Path) -> str:
    parts = list(f.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([TOP] + parts) if parts[0] != TOP else ".".join(parts)


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_package_imports_point_one_way(pkg):
    bad = []
    for f in _files(pkg):
        for name in _imports(f):
            parts = name.split(".")
            if parts[0] == TOP and len(parts) > 1 and parts[1] in ALLOWED:
                dep = parts[1]
                if dep != pkg and dep not in ALLOWED[pkg]:
                    bad.append(f"{f.relative_to(ROOT)} imports tandem.{dep}")
            if parts[:2] == [TOP, "cli"]:
                bad.append(f"{f.relative_to(ROOT)} imports tandem.cli (the composition root)")
    assert not bad, "\n".join(bad)


def test_every_room_is_checked():
    rooms = {d.name for d in ROOT.iterdir() if (d / "__init__.py").is_file() and d.name not in (TOP, "tests")}
    assert rooms == set(ALLOWED), f"rooms without import rules: {sorted(rooms - set(ALLOWED))}"


def test_no_import_cycles_inside_the_packages():
    files = {_module(f): f for pkg in [*ALLOWED, TOP] for f in _files(pkg)}
    graph = {m: {d for d in _imports(f, m) if d in files and d != m} for m, f in files.items()}
    state: dict[str, int] = {}          # 1 = on the current path, 2 = done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(path[path.index(d):] + [m, d]) if d in path else f"{m} -> {d}")
            elif d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not set(cycles) - KNOWN_CYCLES, "\n".join(sorted(set(cycles) - KNOWN_CYCLES))


# engine/'s two rooms (engine/README.md, "Two rooms"): the scheduling room decides what runs, the
# execution modules run it; scheduling never imports execution
ENGINE_EXECUTION = ("models", "attention", "quant", "model_runner", "forward_batch", "batch_builder",
                    "cuda_graph", "verify_graph", "loader", "layers", "overlap", "sampler", "logprobs")


def test_the_engines_scheduling_room_never_imports_its_execution_room():
    bad = []
    for f in sorted((ROOT / "engine" / "sched").rglob("*.py")):
        for name in _imports(f, _module(f)):
            parts = name.split(".")
            if parts[:2] == [TOP, "engine"] and len(parts) > 2 and parts[2] in ENGINE_EXECUTION:
                bad.append(f"{f.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)
    assert (ROOT / "engine" / "sched" / "scheduler.py").is_file()     # the rule has a room to check


def test_ray_nixl_torch_confined():
    bad = []
    for pkg in ALLOWED:
        for f in _files(pkg):
            rel = f.relative_to(ROOT)
            for name in _imports(f):
                top = name.split(".")[0]
                if top == "ray" and pkg not in ("cluster", "bench") and f.name != "actor.py":
                    bad.append(f"{rel} imports ray (only cluster/, bench/ and */actor.py may)")
                if top == "nixl" and pkg != "transfer":
                    bad.append(f"{rel} imports nixl (only transfer/ may)")
                if top == "torch" and pkg == "core":
                    bad.append(f"{rel} imports torch (core/ must not)")
    assert not bad, "\n".join(bad)


def test_tests_do_not_import_bench_and_bench_does_not_import_tests():
    bad = []
    for f in sorted((ROOT / "tests").rglob("*.py")):
        rel = f.relative_to(ROOT)
        if rel.parts[1] == "bench":            # bench's own tests
            continue
        for name in _imports(f):
            if name.split(".")[:2] == [TOP, "bench"] or name.split(".")[0] == "bench":
                bad.append(f"{rel} imports {name} (test support goes in tests/support/)")
    for f in _files("bench"):
        for name in _imports(f):
            if name.split(".")[0] in ("tests", "support", "conftest"):
                bad.append(f"{f.relative_to(ROOT)} imports {name} (bench/ never imports tests/)")
    assert not bad, "\n".join(bad)
