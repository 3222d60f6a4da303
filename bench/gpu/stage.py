"""Carry a folder of wheels to the GPU machine in parts, and install them there offline.

A device call carries at most 64 MiB, and Ray's (79 MB) and nixl-cu13's (59 MB) wheels are each
larger, so the folder travels as a tar cut into chunks, one chunk per part folder:

    here:  python bench/gpu/stage.py split .gpu/cluster_whl .gpu/cluster        # part_00/, part_01/, ...
    GPU:   python3 bench/gpu/stage.py keep .gpu/cluster/part_00 /tmp/tandem_stage   (one device call per part)
           python3 bench/gpu/stage.py join /tmp/tandem_stage /tmp/tandem_whl      (after the last part)
           python3 -m pip install --no-index --no-deps --find-links /tmp/tandem_whl --target DIR /tmp/tandem_whl/*.whl

Every part folder holds its chunk (``chunk``) and the same ``MANIFEST.json``: each chunk's size and
sha256, the whole tar's, and each wheel's. ``keep`` verifies a chunk before it copies it into the
store (the GPU machine keeps /tmp while it is warm); ``join`` refuses a store with a chunk missing
or wrong, reassembles, verifies the tar, unpacks it and verifies every wheel. Standard library
only: the GPU machine runs it before anything is installed.

``closure`` (here, in the venv): the pinned ``name==version`` of every package Tandem's runtime
imports need (``--engine``: the Engine's alone), walked through the installed metadata for the GPU
machine's Python, less what its image already has.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile

MANIFEST = "MANIFEST.json"
CHUNK = "chunk"
LIMIT_MIB = 45          # a part's chunk: with the working tree beside it, under one call's 64 MiB (as the GGUF halves)

# What the GPU machine's image already has (as read off the H200 run of 674cf90): torch and its dependencies,
# triton, transformers and its own, numpy, pyyaml, jinja2, tokenizers, safetensors, msgpack,
# pytest. nixl-cu12: the image is CUDA 13 (nixl picks nixl-cu13).
IMAGE_HAS = frozenset({
    "torch", "triton", "numpy", "pyyaml", "jinja2", "markupsafe", "tokenizers", "safetensors", "msgpack",
    "filelock", "fsspec", "sympy", "mpmath", "networkx", "setuptools", "huggingface-hub", "hf-xet",
    "transformers", "pytest", "nixl-cu12",
})
# What the Engine (and bench/gpu_check.py) imports beyond the image: .gpu/whl, installed by bench/gpu_check.sh
ENGINE_ROOTS = ("pydantic", "gguf", "llguidance")
# Tandem's runtime imports (pyproject's dependencies) that the Engine and the cluster need
ROOTS = ("gguf", "pydantic", "pyzmq", "ray", "nixl", "fastapi", "uvicorn", "prometheus-client", "httpx",
         "tqdm", "llguidance", "jsonschema", "msgpack", "tokenizers", "safetensors", "jinja2", "pyyaml", "numpy")


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def closure(roots=ROOTS, exclude=IMAGE_HAS, python: str = "3.12") -> list[str]:
    """``name==version`` (sorted) of ``roots`` and everything they require, as installed in this
    environment, for a Linux x86_64 CPython ``python``, without ``exclude``. A root that is not
    installed here raises (the staging would silently lack it)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    env = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    seen: dict[str, str] = {}

    def walk(name: str, required: bool) -> None:
        key = _norm(name)
        if key in seen or key in exclude:
            return
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            if required:
                raise ValueError(f"{name} is not installed here: cannot pin it for the GPU machine") from None
            return
        seen[key] = dist.version
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate(env):
                walk(req.name, True)

    for r in roots:
        walk(r, True)
    return [f"{k}=={v}" for k, v in sorted(seen.items())]


def split(src: str, out: str, limit_mib: float = LIMIT_MIB) -> dict:
    """Tar the wheels of ``src`` and cut the tar into ``out/part_NN/chunk`` of at most
    ``limit_mib`` MiB, each part with the manifest. Returns the manifest."""
    wheels = sorted(f for f in os.listdir(src) if f.endswith(".whl"))
    if not wheels:
        raise ValueError(f"no wheels in {src}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for w in wheels:
            tar.add(os.path.join(src, w), arcname=w)
    data = buf.getvalue()
    limit = int(limit_mib * (1 << 20))
    chunks = [data[i:i + limit] for i in range(0, len(data), limit)]
    manifest = {"tar_bytes": len(data), "tar_sha256": hashlib.sha256(data).hexdigest(),
                "chunks": [{"bytes": len(c), "sha256": hashlib.sha256(c).hexdigest()} for c in chunks],
                "wheels": {w: sha256(os.path.join(src, w)) for w in wheels}}
    shutil.rmtree(out, ignore_errors=True)
    for i, c in enumerate(chunks):
        d = os.path.join(out, f"part_{i:02d}")
        os.makedirs(d)
        with open(os.path.join(d, CHUNK), "wb") as f:
            f.write(c)
        with open(os.path.join(d, MANIFEST), "w") as mf:
            json.dump({**manifest, "index": i}, mf, indent=1)
    return manifest


def _manifest(folder: str) -> dict:
    with open(os.path.join(folder, MANIFEST)) as f:
        return json.load(f)


def keep(part: str, store: str) -> str:
    """Verify ``part``'s chunk against its manifest and copy both into ``store`` (as
    ``chunk_NN``); returns the stored chunk's path. Raises ValueError on a bad chunk."""
    m = _manifest(part)
    i, want = m["index"], m["chunks"][m["index"]]
    src = os.path.join(part, CHUNK)
    if os.path.getsize(src) != want["bytes"] or sha256(src) != want["sha256"]:
        raise ValueError(f"{src}: chunk {i} does not match its manifest")
    os.makedirs(store, exist_ok=True)
    dst = os.path.join(store, f"{CHUNK}_{i:02d}")
    shutil.copyfile(src, dst)
    with open(os.path.join(store, MANIFEST), "w") as f:
        json.dump(m, f, indent=1)
    return dst


def missing(store: str) -> list[int]:
    """Indices of the chunks ``store`` still lacks (all of them when it has no manifest)."""
    if not os.path.isfile(os.path.join(store, MANIFEST)):
        return [0]
    m = _manifest(store)
    return [i for i, c in enumerate(m["chunks"])
            if not os.path.isfile(p := os.path.join(store, f"{CHUNK}_{i:02d}")) or os.path.getsize(p) != c["bytes"]]


def join(store: str, dest: str) -> list[str]:
    """Reassemble the tar from ``store``'s chunks, verify it, unpack the wheels into ``dest`` and
    verify each; returns their paths. Raises ValueError naming what is missing or wrong."""
    gone = missing(store)
    if gone:
        raise ValueError(f"{store}: chunks {gone} missing (stage every part first)")
    m = _manifest(store)
    h, parts = hashlib.sha256(), []
    for i, c in enumerate(m["chunks"]):
        with open(os.path.join(store, f"{CHUNK}_{i:02d}"), "rb") as f:
            b = f.read()
        if hashlib.sha256(b).hexdigest() != c["sha256"]:
            raise ValueError(f"{store}: chunk {i} is corrupt")
        h.update(b)
        parts.append(b)
    if h.hexdigest() != m["tar_sha256"]:
        raise ValueError(f"{store}: the reassembled tar does not match the manifest")
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(b"".join(parts)), mode="r") as tar:
        for member in tar.getmembers():
            if not member.isfile() or os.path.basename(member.name) != member.name:
                raise ValueError(f"unexpected entry {member.name!r} in the staged tar")
            data = tar.extractfile(member)
            assert data is not None, "a regular file (checked above)"
            with open(os.path.join(dest, member.name), "wb") as f:
                f.write(data.read())
    out = []
    for w, want in m["wheels"].items():
        p = os.path.join(dest, w)
        if sha256(p) != want:
            raise ValueError(f"{p}: sha256 differs from the manifest")
        out.append(p)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="wheel folder -> part folders")
    s.add_argument("src")
    s.add_argument("out")
    s.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    k = sub.add_parser("keep", help="verify one part and copy it into the store")
    k.add_argument("part")
    k.add_argument("store")
    j = sub.add_parser("join", help="store -> verified wheels")
    j.add_argument("store")
    j.add_argument("dest")
    c = sub.add_parser("closure", help="pinned packages to download for the GPU machine")
    c.add_argument("--python", default="3.12")
    c.add_argument("--engine", action="store_true", help="only what the Engine needs (ENGINE_ROOTS)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "split":
            m = split(args.src, args.out, args.limit_mib)
            print(f"{len(m['wheels'])} wheels, {m['tar_bytes'] / 2**20:.1f} MiB in {len(m['chunks'])} parts")
        elif args.cmd == "keep":
            print(f"kept {keep(args.part, args.store)}; still missing: {missing(args.store)}")
        elif args.cmd == "join":
            print(f"{len(join(args.store, args.dest))} wheels verified in {args.dest}")
        else:
            print("\n".join(closure(ENGINE_ROOTS if args.engine else ROOTS, python=args.python)))
    except ValueError as e:
        print(f"stage.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
