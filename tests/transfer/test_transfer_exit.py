"""A process with a NIXL agent exits cleanly where RDMA libraries are installed (issue 26).

With Debian's libibverbs1 + ibverbs-providers present, UCX's ib_efa module loads the system
libnl-route-3 beside the wheel's vendored copy and the process died with SIGSEGV in _dl_fini.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl")

from tandem.transfer.ucx_env import DEFAULT_UCX_MODULES, configure_ucx_modules  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import torch
from tandem.transfer.agent import KVTransferAgent, Region
a = KVTransferAgent("x", [Region.of("kv", torch.zeros(2, 4, 8, 16), page_size=4)])
maps = open("/proc/self/maps").read()
print("SYSTEM_LIBNL" if "/libnl-route-3.so" in maps else "VENDORED_ONLY", flush=True)
a.close()
"""


def test_configure_ucx_modules_keeps_the_users_setting():
    env: dict[str, str] = {}
    assert configure_ucx_modules(env) == DEFAULT_UCX_MODULES == env["UCX_MODULES"]
    env = {"UCX_MODULES": "all"}
    assert configure_ucx_modules(env) == "all"


def test_an_agent_process_exits_zero():
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout[-1000:]}\n{p.stderr[-1000:]}"
    assert "VENDORED_ONLY" in p.stdout
