"""GPU placement from config (issue 36): ``prefill_num_gpus`` / ``decode_num_gpus`` become the Ray
actors' ``num_gpus``. Checked with Ray's logical GPU resources on this CPU node: a fresh Ray in a
child process started with ``num_gpus=1`` (no real GPU needed), simulated workers (they compute
nothing), 1 prefill at 0.5 and 2 decode at 0.25: every actor lands, each holds its share of GPU 0,
and the node's one GPU is used up."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")

from tandem.cluster.launch import role_num_gpus  # noqa: E402
from tandem.cluster.workers import DECODE, PREFILL  # noqa: E402
from tandem.core.config import ServeConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DRIVER = r"""
import json, sys, ray
from tandem.cluster.launch import Launcher, load_tokenizer
from tandem.cluster.workers import DECODE, PREFILL
from tandem.core.config import ServeConfig

cfg = ServeConfig.model_validate(json.loads(sys.argv[1]))
ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
try:
    launcher = Launcher(cfg, tokenizer=load_tokenizer(cfg.engine_config.model))
    workers = [launcher.spawn(PREFILL, 0, "prefill-0")] + [launcher.spawn(DECODE, i, f"decode-{i}") for i in range(2)]
    launcher.info(workers, timeout=120)

    def seen(actor):
        ctx = ray.get_runtime_context()
        import os
        return {"resources": ctx.get_assigned_resources(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES")}

    out = {w.name: ray.get(w.handle.__ray_call__.remote(seen), timeout=60) for w in workers}
    out["options"] = {w.name: {k: v for k, v in launcher._options(w.role, w.name).items() if k in ("num_gpus",)}
                      for w in workers}
    out["gpu_left"] = ray.available_resources().get("GPU", 0.0)
    print("RESULT " + json.dumps(out))
finally:
    ray.shutdown()
"""


def test_role_num_gpus_reads_the_config():
    cfg = ServeConfig(prefill_num_gpus=0.5, decode_num_gpus=0.33)
    assert role_num_gpus(cfg, PREFILL, 8.0) == 0.5 and role_num_gpus(cfg, DECODE, 0.0) == 0.33
    assert role_num_gpus(ServeConfig(), PREFILL) is None and role_num_gpus(ServeConfig(), DECODE) is None
    with pytest.raises(ValueError):
        ServeConfig(decode_num_gpus=-1)


def test_fewer_gpus_than_workers_are_shared_evenly():
    """Unset, a worker on a cluster with a GPU but fewer GPUs than workers takes an even share
    (its pools go to the GPU); with a GPU each, none, a CPU engine or the simulator: placement's."""
    from tandem.core.config import EngineConfig

    one_one, one_two = ServeConfig(prefill=1, decode=1), ServeConfig(prefill=1, decode=2)
    assert role_num_gpus(one_one, PREFILL, 1.0) == role_num_gpus(one_one, DECODE, 1.0) == 0.5
    assert role_num_gpus(one_two, DECODE, 1.0) == 0.33 and role_num_gpus(one_two, DECODE, 2.0) == 0.66
    assert role_num_gpus(one_two, DECODE, 3.0) is None and role_num_gpus(one_two, DECODE, 0.0) is None
    assert role_num_gpus(one_one.model_copy(update={"engine_config": EngineConfig(device="cpu")}), DECODE, 1.0) is None
    assert role_num_gpus(one_one.model_copy(update={"engine": "sim"}), DECODE, 1.0) is None


@pytest.mark.timeout(240)
def test_workers_land_on_logical_gpus_as_configured():
    cfg = ServeConfig(engine="sim", prefill=1, decode=2, prefill_num_gpus=0.5, decode_num_gpus=0.25)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", DRIVER, cfg.model_dump_json()], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=200)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert p.returncode == 0 and line, f"driver failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    got = json.loads(line[len("RESULT "):])
    want = {"prefill-0": 0.5, "decode-0": 0.25, "decode-1": 0.25}
    assert {n: o["num_gpus"] for n, o in got["options"].items()} == want
    for name, share in want.items():
        assert got[name]["resources"].get("GPU") == pytest.approx(share), got[name]
        assert got[name]["gpu_ids"] == ["0"] and got[name]["cuda_visible"] == "0", got[name]
    assert got["gpu_left"] == pytest.approx(0.0)     # the node's one logical GPU is used up
