"""One local Ray instance for every module of tests/disagg that runs a real cluster (each module
launches and closes its own actors on it; starting Ray once saves seconds per module), and one
driver tokenizer per model for the package's launches."""

from __future__ import annotations

import functools

import pytest


@pytest.fixture(scope="package")
def ray_local():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="package", autouse=True)
def one_driver_tokenizer():
    """``launch_disaggregated`` builds the driver's tokenizer from the GGUF on every launch (3-4 s:
    gguf's reader walks SmolLM2's 49k tokens and merges in Python), and this package launches about
    ten clusters. The tokenizer is a pure function of the model file and immutable once built, so
    the launches here share one per model; test_launch_config.py checks the unshared function
    (imported before this patch) against the workers' tokenizer."""
    try:
        from tandem.cluster import launch
    except ImportError:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "load_tokenizer", functools.lru_cache(maxsize=None)(launch.load_tokenizer))
        yield
