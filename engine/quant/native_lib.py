"""Build and load the AVX512 kernels (``avx512_kernels.c``) as typed torch ops
``torch.ops.tandem.*`` (``native_ops.cpp``)."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem.engine.quant.cpu import cpu_flags

HERE = Path(__file__).parent
SOURCE = HERE / "avx512_kernels.c"
SOURCES = (SOURCE, HERE / "avx512_kernels.h", HERE / "native_ops.cpp")
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "f16c", "fma")
CFLAGS = ["-O3", "-std=c11", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
          "-mavx512dq", "-mavx512vnni", "-mavx512bf16", "-mf16c", "-mfma"]
CXXFLAGS = ["-O2", "-std=c++20", "-fPIC", "-w"]
BUILD_TIMEOUT_S = 600


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tandem" / "kernels"


def kernel_ops():
    """``torch.ops.tandem`` with the kernels' operators loaded, or None where they cannot run here
    (see :func:`kernel_unavailable`)."""
    return _load()[0]


def kernel_unavailable() -> str | None:
    """None when :func:`kernel_ops` loaded, else why not (one line)."""
    return _load()[1]


def describe() -> str:
    """One line for logs and the test session header: whether the native kernels run here, and
    whether this process built them (and how long that took) or found them cached."""
    ops, why = _load()
    if ops is None:
        return f"native AVX512-BF16 kernels: off ({why})"
    how = f"built now in {_BUILT_S[0]:.1f} s" if _BUILT_S else f"cached in {cache_dir()}"
    return f"native AVX512-BF16 kernels: on (torch.ops.tandem, {how})"


_BUILT_S: list[float] = []


@functools.lru_cache(maxsize=1)
def _load():
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the AVX512 kernels are built for Linux x86-64 (this is {sys.platform} {platform.machine()})"
    missing = [f for f in REQUIRED_FLAGS if f not in cpu_flags()]
    if missing:
        return None, f"the CPU lacks {', '.join(missing)} (the AVX512 kernels need AVX512 BF16 and VNNI)"
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cc is None or cxx is None:
        return None, f"no {'C' if cc is None else 'C++'} compiler ({'gcc' if cc is None else 'g++'}) to build the AVX512 kernels"
    key = b"".join(p.read_bytes() for p in SOURCES) + " ".join([cc, cxx, *CFLAGS, *CXXFLAGS]).encode()
    digest = hashlib.sha256(key + torch.__version__.encode()).hexdigest()[:16]
    out = cache_dir() / f"tandem_ops-{digest}.so"
    try:
        if not out.exists():
            t0 = time.perf_counter()
            _build(cc, cxx, out)
            _BUILT_S[:] = [time.perf_counter() - t0]
        if not hasattr(torch.ops.tandem, "linear_"):
            torch.ops.load_library(str(out))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        first = next((ln for ln in lines if "error" in ln), lines[0])
        return None, f"building the AVX512 kernels failed: {first.strip()[:200]}"
    return torch.ops.tandem, None


def _run(*cmds: list[str]) -> None:
    procs: list[subprocess.Popen] = []
    try:
        for c in cmds:
            procs.append(subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    except OSError:
        for p in procs:
            p.kill()
            p.communicate()
        raise
    errors = []
    for c, p in zip(cmds, procs):
        try:
            _, err = p.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise
        if p.returncode != 0:
            errors.append(err or f"{c[0]} exited with {p.returncode}")
    if errors:
        raise OSError("\n".join(errors))


def _build(cc: str, cxx: str, out: Path) -> None:
    from torch.utils.cpp_extension import include_paths

    out.parent.mkdir(parents=True, exist_ok=True)
    torch_lib = Path(torch.__file__).parent / "lib"
    gomp = ["-l:libgomp.so.1"] if (torch_lib / "libgomp.so.1").exists() else ["-fopenmp"]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        c_obj, cxx_obj, so = (os.path.join(tmp, n) for n in ("kernels.o", "ops.o", "tandem_ops.so"))
        _run([cc, *CFLAGS, "-c", str(SOURCE), "-o", c_obj],
             [cxx, *CXXFLAGS, abi, *(f"-I{p}" for p in include_paths()), "-c", str(HERE / "native_ops.cpp"),
              "-o", cxx_obj])
        _run([cxx, "-shared", cxx_obj, c_obj, "-o", so, f"-L{torch_lib}", "-lc10", "-ltorch_cpu", *gomp,
              f"-Wl,-rpath,{torch_lib}", "-lm"])
        os.replace(so, out)
