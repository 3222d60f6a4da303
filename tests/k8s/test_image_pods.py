"""docker/k8s_pods.py, what `make image-test` runs, reads exactly what k8s/overlays/cpu-dev holds:
the Ray pods' `ray start` (KubeRay's line from rayStartParams), the router's command, ports, probes,
env, user and mounts; and the host-network rewrite changes only addresses and ports. Fast, no podman."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys

import pytest

from k8s_support import ROOT, one, rendered, shell_lines, worker_group

_spec = importlib.util.spec_from_file_location("k8s_pods", ROOT / "docker" / "k8s_pods.py")
k8s_pods = importlib.util.module_from_spec(_spec)
sys.modules["k8s_pods"] = k8s_pods          # dataclasses look their module up there
_spec.loader.exec_module(k8s_pods)

OVERLAY = "cpu-dev"


@pytest.fixture(scope="module")
def pods():
    return k8s_pods.pods(OVERLAY)


@pytest.fixture(scope="module")
def manifests():
    res = rendered(OVERLAY)
    return one(res, "RayCluster", "tandem"), one(res, "Deployment", "tandem-router")


def _ray_start(pod) -> list[str]:
    """The `ray start` argv a Ray pod's container runs, as bash reads it."""
    shell, flag, dashdash, script = pod.command
    assert (shell, flag, dashdash) == ("/bin/bash", "-lc", "--"), "KubeRay runs the Ray container through bash -lc"
    ulimit, start = script.split("; ", 1)
    assert ulimit == k8s_pods.KUBERAY_ULIMIT
    return shlex.split(start)


def test_every_role_and_the_image(pods):
    assert tuple(pods) == k8s_pods.ROLES
    assert {p.image for p in pods.values()} == {"tandem:0.1.0-cpu"}, "make image's tag is the manifests' image"
    assert {p.user for p in pods.values()} == {"1000:1000"}, "the Dockerfile's USER is the manifests' runAsUser"


def test_ray_start_is_kuberays_line_from_the_manifest(pods, manifests):
    from ray.scripts.scripts import cli as ray_cli

    cluster, _ = manifests
    start = ray_cli.commands["start"]
    groups = {"head": cluster["spec"]["headGroupSpec"], **{r: worker_group(cluster, r) for r in ("prefill", "decode")}}
    for role, group in groups.items():
        argv = _ray_start(pods[role])
        assert argv[:2] == ["ray", "start"]
        ctx = start.make_context("start", argv[2:])
        for k, v in group["rayStartParams"].items():       # every rayStartParam, as written
            assert f"--{k}={shlex.split(v)[0]}" in argv, (role, k)
        assert ctx.params["block"] and ctx.params["metrics_export_port"] == 8080
        assert ctx.params["dashboard_agent_listen_port"] == 52365
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert ctx.params["memory"] == k8s_pods.quantity(limits["memory"])
        if role == "head":
            assert ctx.params["head"] and ctx.params["num_cpus"] == 0
            assert ctx.params["dashboard_host"] == "127.0.0.1"
        else:
            assert not ctx.params["head"] and json.loads(ctx.params["resources"]) == {role: 1}
            assert ctx.params["address"] == "tandem-head-svc.tandem.svc.cluster.local:6379"


def test_router_runs_the_manifests_command(pods, manifests):
    _, router = manifests
    c = router["spec"]["template"]["spec"]["containers"][0]
    pod = pods["router"]
    assert pod.command == [*c["command"], *c["args"]]
    assert shell_lines(pod.command[-1])[-1] == "exec tandem serve --config /etc/tandem/serve.yaml"
    assert pod.ports == {"http": 8000}
    assert pod.env["RAY_HEAD_ADDRESS"] == "tandem-head-svc:6379"
    assert pod.env["RAY_AUTH_TOKEN"] == pods["head"].env["RAY_AUTH_TOKEN"] == "secret:tandem/auth_token"
    assert {p.startup.path if p.startup else None for p in [pod]} == {"/health"}
    assert (pod.readiness.kind, pod.readiness.path, pod.readiness.port) == ("http", "/health", "http")
    assert set(pod.mounts) == {"/etc/tandem", "/etc/tandem-keys", "/dev/shm"}
    assert pod.mounts["/etc/tandem-keys"]["secret"]["secretName"] == "tandem-api-keys"
    assert pod.pre_stop == ["/bin/sh", "-c", "sleep 5"] and pod.grace_s == 60


def test_ports_probes_env_of_the_ray_pods(pods, manifests):
    cluster, _ = manifests
    head = pods["head"]
    assert head.ports == {"gcs-server": 6379, "metrics": 8080}
    assert "52365" in head.readiness.command[-1] and "8265" in head.readiness.command[-1]
    for role in ("prefill", "decode"):
        p = pods[role]
        assert p.ports == {} and "52365" in p.readiness.command[-1] and "8265" not in p.readiness.command[-1]
        assert p.pre_stop == ["/bin/sh", "-c", "ray stop"]
        size = worker_group(cluster, role)["template"]["spec"]["volumes"][0]["emptyDir"]["sizeLimit"]
        assert p.shm_bytes == k8s_pods.quantity(size)
    for p in pods.values():
        assert p.env["RAY_USAGE_STATS_ENABLED"] == "0"


def test_host_network_changes_only_addresses_and_ports(pods):
    ports = k8s_pods.HostPorts(metrics=41001, agent=41002, agent_grpc=41003, node_manager=41004,
                               object_manager=41005, runtime_env_agent=41006, min_worker=41100,
                               max_worker=41199, gcs=41007, dashboard=41008)
    head = k8s_pods.on_host_network(pods["head"], "127.0.0.1", ports, "127.0.0.1:41007")
    argv = _ray_start(head)
    assert "--node-ip-address=127.0.0.1" in argv and "--dashboard-agent-listen-port=41002" in argv
    assert "--port=41007" in argv and "--port" not in " ".join(_ray_start(pods["head"])) and head.ports == {"gcs-server": 41007, "metrics": 41001}
    assert "127.0.0.1:41002" in head.readiness.command[-1] and "127.0.0.1:41008" in head.readiness.command[-1]
    added = set(ports.flags("127.0.0.1"))
    remapped = {"--metrics-export-port=41001", "--dashboard-agent-listen-port=41002"}
    assert set(argv) - added - remapped == set(_ray_start(pods["head"])) - {
        "--metrics-export-port=8080", "--dashboard-agent-listen-port=52365"}

    worker_ports = k8s_pods.HostPorts(**{**ports.__dict__, "gcs": None, "dashboard": None})
    dec = k8s_pods.on_host_network(pods["decode"], "127.0.0.3", worker_ports, "127.0.0.1:41007")
    assert "--address=127.0.0.1:41007" in _ray_start(dec)

    router = k8s_pods.on_host_network(pods["router"], "127.0.0.4", worker_ports, "127.0.0.1:41007")
    assert router.env["RAY_HEAD_ADDRESS"] == "127.0.0.1:41007"
    lines = shell_lines(router.command[-1])
    before = shell_lines(pods["router"].command[-1])
    start = next(i for i, ln in enumerate(lines) if ln.startswith("ray start"))
    assert lines[:start] + lines[start + 1:] == before[:start] + before[start + 1:], "only the ray start line changes"
    assert lines[start].startswith(before[start].split(" --", 1)[0]) and lines[start].endswith(before[start].split("ray start ", 1)[1])
    assert "--node-ip-address=127.0.0.4" in lines[start] and "--dashboard-agent-listen-port=41002" in lines[start]


def test_serve_yaml_is_the_overlays(pods):
    import yaml

    cfg = yaml.safe_load(k8s_pods.serve_yaml(OVERLAY))
    assert cfg["port"] == pods["router"].ports["http"]
    assert cfg["api_keys"].startswith("/etc/tandem-keys/")
    assert cfg["ray_address"] == "auto" and cfg["worker_lifetime"] == "cluster"
