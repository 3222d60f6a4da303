"""bench/gpu/stage.py (issue 36): wheels cut into parts under a size limit, each part kept in
turn, reassembled and verified, then installed offline with pip (``--no-index``). Two small
wheels built here (no downloads): one with random bytes, so the parts are not compressible."""

from __future__ import annotations

import base64
import json
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tandem.bench.gpu import stage


def _wheel(folder, name: str, version: str, code: str, blob: bytes = b"") -> str:
    """A minimal valid wheel: the module, optional data, METADATA, WHEEL and RECORD."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": code.encode(), f"{name}/blob.bin": blob,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for p, b in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b"=").decode()
        record.append(f"{p},sha256={digest},{len(b)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for p, b in files.items():
            z.writestr(p, b)
    return path


@pytest.fixture
def wheels(tmp_path):
    src = tmp_path / "whl"
    src.mkdir()
    _wheel(src, "stagedalpha", "1.0", "VALUE = 'alpha'\n", os.urandom(40_000))
    _wheel(src, "stagedbeta", "2.3", "from stagedalpha import VALUE\nBOTH = VALUE + '+beta'\n")
    return src


def test_split_keep_join_install_offline(wheels, tmp_path):
    parts = tmp_path / "parts"
    m = stage.split(str(wheels), str(parts), limit_mib=16 / 1024)      # 16 KiB parts
    folders = sorted(os.listdir(parts))
    assert len(folders) == len(m["chunks"]) >= 3
    assert all(os.path.getsize(parts / f / stage.CHUNK) <= 16 * 1024 for f in folders)
    assert sum(c["bytes"] for c in m["chunks"]) == m["tar_bytes"]

    store, dest = tmp_path / "store", tmp_path / "dest"
    for i, f in enumerate(folders[:-1]):
        stage.keep(str(parts / f), str(store))
        assert stage.missing(str(store)) == list(range(i + 1, len(folders)))
    with pytest.raises(ValueError, match="missing"):
        stage.join(str(store), str(dest))
    stage.keep(str(parts / folders[-1]), str(store))
    assert stage.missing(str(store)) == []
    got = stage.join(str(store), str(dest))
    assert sorted(os.path.basename(p) for p in got) == sorted(os.listdir(wheels))
    for p in got:
        assert open(p, "rb").read() == open(wheels / os.path.basename(p), "rb").read()

    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                          "--no-compile", "--find-links", str(dest), "--target", str(site), *got],
                         capture_output=True, text=True, timeout=120)
    assert pip.returncode == 0, pip.stderr
    env = dict(os.environ, PYTHONPATH=str(site))
    run = subprocess.run([sys.executable, "-c", "import stagedbeta; print(stagedbeta.BOTH)"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert run.stdout.strip() == "alpha+beta", run.stderr


def test_a_corrupt_or_foreign_chunk_is_refused(wheels, tmp_path):
    parts = tmp_path / "parts"
    stage.split(str(wheels), str(parts), limit_mib=16 / 1024)
    bad = parts / "part_01" / stage.CHUNK
    b = bytearray(bad.read_bytes())
    b[100] ^= 0xFF
    bad.write_bytes(bytes(b))
    with pytest.raises(ValueError, match="chunk 1 does not match"):
        stage.keep(str(parts / "part_01"), str(tmp_path / "store"))
    # a chunk corrupted after it was kept is caught at join
    store = tmp_path / "store2"
    for f in sorted(os.listdir(parts)):
        if f != "part_01":
            stage.keep(str(parts / f), str(store))
    shutil.copyfile(bad, store / "chunk_01")
    with pytest.raises(ValueError, match="chunk 1 is corrupt"):
        stage.join(str(store), str(tmp_path / "dest"))


def test_closure_pins_the_runtime_deps_the_image_lacks():
    pins = dict(p.split("==") for p in stage.closure())
    for need in ("ray", "nixl", "nixl-cu13", "llguidance", "fastapi", "uvicorn", "prometheus-client", "pyzmq",
                 "gguf", "pydantic", "pydantic-core", "jsonschema", "starlette"):
        assert need in pins, need
    assert not set(pins) & stage.IMAGE_HAS
    with pytest.raises(ValueError, match="not installed"):
        stage.closure(roots=("no-such-package-here",))


# Imported when installed, not needed: torch's data pipes try ``import dill``.
OPTIONAL = {"dill"}


def test_every_engine_import_is_staged_or_in_the_gpu_image():
    """What importing the Engine and bench/gpu_check.py's modules loads, by distribution: each is
    in the GPU image or in the Engine's staged closure (issue 35: llguidance was not)."""
    code = ("import json, sys, importlib.metadata as md\n"
            "import tandem.engine.engine, tandem.bench.gpu.correctness, tandem.bench.gpu.throughput, "
            "tandem.bench.gpu.kernels, tandem.bench.gpu.models\n"
            "pd = md.packages_distributions()\n"
            "tops = {m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)\n"
            "print(json.dumps(sorted({d for t in tops for d in pd.get(t, [])})))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=root))
    assert p.returncode == 0, p.stderr
    loaded = {stage._norm(d) for d in json.loads(p.stdout.strip().splitlines()[-1])} - {"tandem"} - OPTIONAL
    staged = {stage._norm(x.split("==")[0]) for x in stage.closure(stage.ENGINE_ROOTS)}
    assert "llguidance" in staged
    assert loaded - staged - stage.IMAGE_HAS == set()
