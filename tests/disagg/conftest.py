"""One local Ray instance for every module of tests/disagg that runs a real cluster (each module
launches and closes its own actors on it; starting Ray once saves seconds per module). The
driver's tokenizer is built once per model by cluster/launch.py ``load_tokenizer`` itself."""

from __future__ import annotations

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
