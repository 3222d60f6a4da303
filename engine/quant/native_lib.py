"""Build and load ``avx512_kernels.c`` (the AVX512 BF16/VNNI GGUF kernels) with the machine's C
compiler.

The shared library is compiled once per source hash into ``$XDG_CACHE_HOME/tandem/kernels``
(``~/.cache/tandem/kernels``), written to a temporary name and renamed into place, so several
worker processes starting at once race harmlessly. It links torch's own OpenMP runtime (the same
``libgomp.so.1`` soname, already loaded by torch), so its threads are torch's threads.

:func:`kernel_lib` returns the loaded library or None; :func:`kernel_unavailable` says why not in one line
(no x86-64 AVX512 BF16/VNNI, no compiler, a failed build), which the startup line repeats. Nothing here
raises: a machine without the kernels runs the torch int4 path instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tandem.engine.quant.cpu import cpu_flags

SOURCE = Path(__file__).with_name("avx512_kernels.c")
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "f16c", "fma")
CFLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp", "-mavx512f", "-mavx512bw",
          "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512bf16", "-mf16c", "-mfma"]

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "tq_linear": ([_I32, _P, _I64, _I64, _P, _I64, _I32, _I32, _P, _F32, _I64, _P, _I64, _I32,
                   _P, _I64, _I32, _P, _I32, _I32], _I32),
    "tq_activations": ([_I32, _P, _I64, _I32, _I64, _I64, _I32, _P, _F32, _P, _P, _I32], _I32),
    "tq_rope": ([_P, _I64, _I64, _I64, _I64, _P, _P, _I64, _I32], None),
    "tq_attention": ([_P, _I64, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _P, _P, _I64,
                      _P, _P, _P, _P, _F32, _I32, _I32], _I32),
    "tq_llama_layer": ([_P, _P, _P, _I64, _P, _P, _I64, _P, _P, _P, _P, _I64, _P, _P, _P, _P,
                        _I32], _I32),
}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tandem" / "kernels"


def kernel_lib() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where it cannot run here (see :func:`kernel_unavailable`)."""
    return _load()[0]


def kernel_unavailable() -> str | None:
    """None when :func:`kernel_lib` loaded, else why not (one line)."""
    return _load()[1]


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the AVX512 kernels are built for Linux x86-64 (this is {sys.platform} {platform.machine()})"
    missing = [f for f in REQUIRED_FLAGS if f not in cpu_flags()]
    if missing:
        return None, f"the CPU lacks {', '.join(missing)} (the AVX512 kernels need AVX512 BF16 and VNNI)"
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None, "no C compiler (gcc) to build the AVX512 kernels"
    src = SOURCE.read_bytes()
    digest = hashlib.sha256(src + " ".join(CFLAGS).encode() + torch.__version__.encode()).hexdigest()[:16]
    out = cache_dir() / f"avx512_kernels-{digest}.so"
    try:
        if not out.exists():
            _build(cc, out)
        lib = ctypes.CDLL(str(out))
    except (OSError, subprocess.SubprocessError) as e:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        first = next((ln for ln in lines if "error" in ln), lines[0])
        return None, f"building the AVX512 kernels failed: {first.strip()[:200]}"
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib, None


def _build(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    torch_lib = Path(torch.__file__).parent / "lib"
    link = []
    if (torch_lib / "libgomp.so.1").exists():   # torch's OpenMP runtime, not a second one
        link = [f"-L{torch_lib}", "-l:libgomp.so.1", f"-Wl,-rpath,{torch_lib}"]
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp, *link, "-lm"],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise OSError(r.stderr or f"{cc} exited with {r.returncode}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
