"""A real multi-node Ray cluster on one machine, every node on 127.0.0.1 (a development cluster).
:meth:`RayNodes.close` kills only the process groups it started; it never runs ``ray stop``.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from tandem.core.ports import free_port, free_ports

BOOT = ("import sys, ray._private.services as s; s.get_node_ip_address = lambda address=None: '127.0.0.1'; "
        "from ray.scripts.scripts import main; sys.argv[0] = 'ray'; sys.exit(main())")
STARTED = "Ray runtime started"


@dataclass
class Node:
    proc: subprocess.Popen[bytes]
    log: str
    resources: dict[str, Any]
    manager_port: int = 0


def fake_cluster_config(max_prefill: int = 3, max_decode: int = 2) -> dict[str, Any]:
    """Ray's fake multi-node provider config with ``prefill`` and ``decode`` node types."""
    node: dict[str, Any] = {"node_config": {}}
    return {
        "cluster_name": "tandem-fake", "max_workers": max_prefill + max_decode, "upscaling_speed": 10.0,
        "idle_timeout_minutes": 0.1, "docker": {}, "auth": {"ssh_user": "ubuntu"}, "file_mounts": {},
        "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [],
        "rsync_filter": [], "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        "head_node_type": "ray.head.default",
        "available_node_types": {
            "ray.head.default": {**node, "resources": {}, "max_workers": 0},
            "prefill": {**node, "resources": {"CPU": 1, "prefill": 1}, "min_workers": 1, "max_workers": max_prefill},
            "decode": {**node, "resources": {"CPU": 1, "decode": 1}, "min_workers": 1, "max_workers": max_decode},
        },
    }


class RayNodes:
    def __init__(self, token_auth: bool = True, env: dict[str, Any] | None = None, head_cpus: int = 0,
                 autoscaling_config: dict[str, Any] | None = None, startup_timeout_s: float = 60.0):
        self.dir = tempfile.mkdtemp(prefix="tandem-ray-")
        self.token = secrets.token_hex(16) if token_auth else None
        self.timeout = startup_timeout_s
        self.env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **(env or {}))
        if token_auth:
            self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)
        else:
            self.env["RAY_AUTH_MODE"] = "disabled"
        self.nodes: list[Node] = []
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        head = ["--head", f"--port={self.port}", f"--num-cpus={head_cpus}", "--include-dashboard=false",
                f"--temp-dir={self.dir}/t"]
        extra = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        if autoscaling_config is not None:
            cfg = dict(autoscaling_config)
            # use_node_id_as_ip: every node here is 127.0.0.1, so the autoscaler's load metrics
            # must key nodes by id (the provider names them by id) or no node ever counts as
            # running, hence none as idle; the head takes the provider's fixed head id.
            cfg.setdefault("provider", {}).update(type="fake_multinode", gcs_address=self.address,
                                                use_node_id_as_ip=True, disable_node_updaters=True,
                                                disable_launch_config_check=True)
            path = os.path.join(self.dir, "autoscaling.json")
            with open(path, "w") as f:
                json.dump(cfg, f)
            head.append(f"--autoscaling-config={path}")
            from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

            extra.update(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1",
                         RAY_OVERRIDE_NODE_ID_FOR_TESTING=FAKE_HEAD_NODE_ID)
        self._start(head, extra, {})

    def _ports(self) -> tuple[int, list[str]]:
        """A node's port flags, every port distinct and not the head's GCS port (Ray refuses a
        node whose components share one); (its node manager's port, the flags)."""
        ports = free_ports(6)
        while self.port in ports:
            ports = free_ports(6)
        manager, obj, listen, grpc, metrics, env_agent = ports
        return manager, [f"--node-manager-port={manager}", f"--object-manager-port={obj}",
                         f"--dashboard-agent-listen-port={listen}", f"--dashboard-agent-grpc-port={grpc}",
                         f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={env_agent}"]

    def _start(self, args: list[str], extra: dict[str, Any], resources: dict[str, Any]) -> Node:
        log = os.path.join(self.dir, f"node-{len(self.nodes)}.log")
        manager, ports = self._ports()
        cmd = [sys.executable, "-c", BOOT, "start", "--block", "--disable-usage-stats",
               "--object-store-memory=80000000", *ports, *args]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, env={**self.env, **extra}, start_new_session=True,
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        node = Node(proc, log, resources, manager)
        self.nodes.append(node)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            text = open(log).read()
            if STARTED in text:
                return node
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"ray node did not start ({log}):\n{open(log).read()[-3000:]}")

    def add_node(self, resources: dict[str, Any], num_cpus: int = 1, env: dict[str, Any] | None = None) -> Node:
        """A worker node offering ``resources`` (KubeRay's groups: ``{"prefill": 1}``)."""
        return self._start([f"--address={self.address}", f"--num-cpus={num_cpus}",
                            f"--resources={json.dumps(resources)}"], env or {}, resources)

    def client_env(self, **extra: str) -> dict[str, Any]:
        """The environment of a driver of this cluster (its token, loopback addressing)."""
        return {**self.env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **extra}

    def stop_node(self, node: Node) -> None:
        """A node failure: SIGKILL to its whole process group (raylet, agents) and to every
        process under it (the raylet starts its workers in process groups of their own)."""
        try:
            import psutil

            tree = psutil.Process(node.proc.pid).children(recursive=True)
        except Exception:  # noqa: BLE001
            tree = []
        try:
            os.killpg(node.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in tree:
            try:
                p.kill()
            except Exception:  # noqa: BLE001
                pass
        node.proc.wait(timeout=30)

    def close(self) -> None:
        for node in reversed(self.nodes):
            self.stop_node(node)
        self.nodes.clear()
        self._reap()

    def _reap(self, marks: tuple[str, ...] | None = None) -> None:
        """Processes left behind outside a node's group (workers in their own sessions, the fake
        provider's nodes): those whose command line names this cluster's directory (or ``marks``)."""
        try:
            import psutil
        except ImportError:
            return
        marks = marks or (self.dir,)
        for p in psutil.process_iter(["cmdline"]):
            try:
                line = " ".join(p.info["cmdline"] or ())
                if any(m in line for m in marks):
                    p.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass

    def __enter__(self) -> "RayNodes":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Router:
    """A ``tandem serve`` process (a router: the HTTP front door and a Ray driver)."""

    proc: subprocess.Popen[bytes]
    url: str
    log: str

    def kill(self) -> None:
        """SIGKILL: a crash, no shutdown path at all."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                self.kill()


def start_router(config: dict[str, Any], env: dict[str, Any], workdir: str, timeout_s: float = 300.0,
                 extra_args: tuple[str, ...] = ()) -> Router:
    """``tandem serve --config <config as YAML>`` on a free port of 127.0.0.1; returns once its
    /health answers 200 (every worker up), or raises with the log's tail."""
    import httpx
    import yaml

    port = free_port()
    cfg = {**config, "host": "127.0.0.1", "port": port}
    path = os.path.join(workdir, f"serve-{port}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    log = os.path.join(workdir, f"router-{port}.log")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "--log-level", "WARNING", "serve",
                                 "--config", path, *extra_args], env=env, start_new_session=True,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    r = Router(proc, url, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return r
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    r.kill()
    raise RuntimeError(f"router did not come up ({log}):\n{open(log).read()[-4000:]}")
