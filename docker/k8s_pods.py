"""The containers an overlay of k8s/ runs, read out of the rendered manifests: what docker/image_test.py
starts with podman (one source of truth: the YAML, not a copy of it), and what tests/k8s/test_image_pods.py
checks against the manifests.

For the Ray pods, the command is the one KubeRay writes into the container (`/bin/bash -lc --` with
`ulimit -n 65536; ray start ...`: the rayStartParams as `--key=value` shell words plus KubeRay's
defaults --block, --metrics-export-port=8080, --dashboard-agent-listen-port=52365, --memory=<limit>,
and --address=<head Service>:6379 on workers). For the router, the manifest's command and args as they
are. ``on_host_network`` then makes the one change running every pod on one host network needs: each
Ray node a loopback IP of its own (127.0.0.x) and distinct ports, the head Service name replaced by
that address; the same port map rewrites the probes.
"""

from __future__ import annotations

import copy
import re
import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "k8s"))
from kustomize_lite import render  # noqa: E402  (tests/k8s/kustomize_lite.py: the renderer the tests use)

HEAD_SVC = "tandem-head-svc"      # KubeRay names the head Service <RayCluster>-head-svc
GCS_PORT = 6379
# KubeRay's defaults for the ports it adds to `ray start` (ray-operator/controllers/ray/common/pod.go)
KUBERAY_METRICS_PORT = 8080
KUBERAY_AGENT_PORT = 52365
RAY_DASHBOARD_PORT = 8265         # Ray's default; the head probe reads the dashboard here
KUBERAY_ULIMIT = "ulimit -n 65536"
ROLES = ("head", "prefill", "decode", "router")


@dataclass
class Probe:
    kind: str                      # "exec" or "http"
    command: list[str] | None = None
    path: str | None = None
    port: int | None = None
    initial_delay_s: int = 0
    period_s: int = 10
    timeout_s: int = 1
    failure_threshold: int = 3


@dataclass
class Pod:
    """One container of one pod, as its manifest runs it."""

    role: str
    image: str
    command: list[str]
    env: dict[str, str]                      # literal values; secretKeyRef ones as "secret:<name>/<key>"
    ports: dict[str, int]                    # containerPort by name
    user: str                                # runAsUser:runAsGroup
    fs_group: int | None
    mounts: dict[str, dict[str, Any]]        # mountPath -> the volume (configMap, secret, emptyDir)
    cpu_limit: str
    memory_limit_bytes: int
    shm_bytes: int | None
    readiness: Probe | None
    liveness: Probe | None
    startup: Probe | None
    pre_stop: list[str] | None
    grace_s: int
    ray_start: list[str] = field(default_factory=list)   # the `ray start` argv (Ray pods)
    node_ip: str | None = None                            # set by on_host_network


def quantity(q: str | int | float) -> float:
    """A Kubernetes quantity as a number (bytes for memory, cores for cpu)."""
    s = str(q)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "m": 1e-3}
    for u, f in units.items():
        if s.endswith(u):
            return float(s[: -len(u)]) * f
    return float(s)


def _probe(p: dict[str, Any] | None) -> Probe | None:
    if not p:
        return None
    common = dict(initial_delay_s=p.get("initialDelaySeconds", 0), period_s=p.get("periodSeconds", 10),
                  timeout_s=p.get("timeoutSeconds", 1), failure_threshold=p.get("failureThreshold", 3))
    if "exec" in p:
        return Probe("exec", command=list(p["exec"]["command"]), **common)
    if "httpGet" in p:
        return Probe("http", path=p["httpGet"]["path"], port=p["httpGet"]["port"], **common)
    raise ValueError(f"unsupported probe {p}")


def _env(c: dict[str, Any]) -> dict[str, str]:
    out = {}
    for e in c.get("env", []):
        if "value" in e:
            out[e["name"]] = str(e["value"])
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            out[e["name"]] = f"secret:{ref['name']}/{ref['key']}"
    return out


def _pod(role: str, spec: dict[str, Any], c: dict[str, Any]) -> Pod:
    sc = spec.get("securityContext", {})
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}
    shm = next((v for p, v in mounts.items() if p == "/dev/shm"), None)
    ports = {p["name"]: int(p["containerPort"]) for p in c.get("ports", [])}
    pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    return Pod(
        role=role, image=c["image"], command=[*c.get("command", []), *c.get("args", [])], env=_env(c),
        ports=ports, user=f"{sc.get('runAsUser', 0)}:{sc.get('runAsGroup', sc.get('runAsUser', 0))}",
        fs_group=sc.get("fsGroup"), mounts=mounts, cpu_limit=str(c["resources"]["limits"]["cpu"]),
        memory_limit_bytes=int(quantity(c["resources"]["limits"]["memory"])),
        shm_bytes=int(quantity(shm["emptyDir"]["sizeLimit"])) if shm else None,
        readiness=_probe(c.get("readinessProbe")), liveness=_probe(c.get("livenessProbe")),
        startup=_probe(c.get("startupProbe")), pre_stop=list(pre) if pre else None,
        grace_s=int(spec.get("terminationGracePeriodSeconds", 30)))


def kuberay_params(params: dict[str, str], pod: Pod, head: bool, namespace: str) -> dict[str, str]:
    """rayStartParams plus what KubeRay adds when they are missing."""
    out = dict(params)
    if head:
        out.setdefault("dashboard-host", "0.0.0.0")
    else:
        out.setdefault("address", f"{HEAD_SVC}.{namespace}.svc.cluster.local:{GCS_PORT}")
    out.setdefault("metrics-export-port", str(KUBERAY_METRICS_PORT))
    out.setdefault("dashboard-agent-listen-port", str(KUBERAY_AGENT_PORT))
    out.setdefault("num-cpus", str(int(quantity(pod.cpu_limit))))
    out.setdefault("memory", str(pod.memory_limit_bytes))
    out.setdefault("block", "true")
    return out


def ray_start_line(params: dict[str, str], head: bool) -> str:
    """KubeRay's `ray start` line: `--key=value` shell words (values are written into the bash command
    as they are: the quoted JSON of `resources` loses one level of quotes when bash reads it)."""
    words = ["ray start"] + (["--head"] if head else [])
    for k, v in params.items():
        words.append(f"--{k}" if v == "true" and k == "block" else f"--{k}={v}")
    return " ".join(words)


def pods(overlay: str = "cpu-dev", namespace: str = "tandem") -> dict[str, Pod]:
    """head, prefill, decode and router, read from k8s/overlays/<overlay>."""
    resources = render(ROOT / "k8s" / "overlays" / overlay)
    cluster = next(r for r in resources if r["kind"] == "RayCluster")
    router = next(r for r in resources if r["kind"] == "Deployment" and r["metadata"]["name"] == "tandem-router")
    out: dict[str, Pod] = {}
    groups = [("head", cluster["spec"]["headGroupSpec"], True)]
    groups += [(g["groupName"], g, False) for g in cluster["spec"]["workerGroupSpecs"]]
    for role, group, head in groups:
        spec = group["template"]["spec"]
        pod = _pod(role, spec, spec["containers"][0])   # KubeRay: the Ray container is the first
        params = kuberay_params(group["rayStartParams"], pod, head, namespace)
        line = ray_start_line(params, head)
        pod.command = ["/bin/bash", "-lc", "--", f"{KUBERAY_ULIMIT}; {line}"]
        pod.ray_start = shlex.split(line)
        pod.env.setdefault("RAY_AUTH_MODE", "token")      # KubeRay, authOptions.mode: token
        pod.env.setdefault("RAY_AUTH_TOKEN", f"secret:{cluster['metadata']['name']}/auth_token")
        out[role] = pod
    spec = router["spec"]["template"]["spec"]
    c = next(c for c in spec["containers"] if c["name"] == "router")
    out["router"] = _pod("router", spec, c)
    return out


def serve_yaml(overlay: str = "cpu-dev") -> str:
    resources = render(ROOT / "k8s" / "overlays" / overlay)
    cm = next(r for r in resources if r["kind"] == "ConfigMap" and r["metadata"]["name"] == "tandem-serve-config")
    return cm["data"]["serve.yaml"]


# --- one host network ------------------------------------------------------------------------

@dataclass
class HostPorts:
    """The ports one Ray node takes on the shared host network (KubeRay's in-pod ports in brackets)."""

    metrics: int            # [8080]
    agent: int              # [52365]
    agent_grpc: int
    node_manager: int
    object_manager: int
    runtime_env_agent: int
    min_worker: int
    max_worker: int
    gcs: int | None = None          # head: [6379]
    dashboard: int | None = None    # head: [8265]

    def flags(self, ip: str, all_ports: bool = False) -> list[str]:
        """``all_ports``: also the two KubeRay sets (for a `ray start` line of our own, the router's)."""
        f = [f"--metrics-export-port={self.metrics}", f"--dashboard-agent-listen-port={self.agent}"] if all_ports else []
        f += [f"--node-ip-address={ip}", f"--node-manager-port={self.node_manager}",
             f"--object-manager-port={self.object_manager}", f"--runtime-env-agent-port={self.runtime_env_agent}",
             f"--dashboard-agent-grpc-port={self.agent_grpc}", f"--min-worker-port={self.min_worker}",
             f"--max-worker-port={self.max_worker}"]
        if self.gcs is not None:
            f += [f"--port={self.gcs}", f"--dashboard-port={self.dashboard}"]
        return f

    def remap(self) -> dict[int, int]:
        m = {KUBERAY_METRICS_PORT: self.metrics, KUBERAY_AGENT_PORT: self.agent}
        if self.gcs is not None:
            m.update({GCS_PORT: self.gcs, RAY_DASHBOARD_PORT: self.dashboard})
        return m


def _remap_text(s: str, remap: dict[int, int], head_addr: str | None) -> str:
    if head_addr:
        s = re.sub(rf"{HEAD_SVC}(\.[a-z0-9.-]+)?:{GCS_PORT}\b", head_addr, s)
    for old, new in remap.items():
        s = re.sub(rf"(?<=[:=]){old}\b", str(new), s)
    return s


def on_host_network(pod: Pod, ip: str, ports: HostPorts, head_addr: str) -> Pod:
    """``pod`` as it runs on a shared host network: its Ray node on loopback IP ``ip`` with ``ports``
    (the flags appended to each `ray start`), the head Service replaced by ``head_addr``, the probes'
    ports remapped."""
    p = copy.deepcopy(pod)
    remap = ports.remap()
    extra = " ".join(ports.flags(ip, all_ports=not pod.ray_start))

    def fix(s: str) -> str:
        s = _remap_text(s, remap, head_addr)
        return re.sub(r"(^|\n|;\s*)(\s*ray start )", lambda m: f"{m.group(1)}{m.group(2)}{extra} ", s)

    p.command = [fix(w) for w in p.command]
    p.env = {k: _remap_text(v, remap, head_addr) for k, v in p.env.items()}
    for probe in (p.readiness, p.liveness, p.startup):
        if probe and probe.command:
            probe.command = [_remap_text(w, remap, None) for w in probe.command]
    p.ports = {k: remap.get(v, v) for k, v in p.ports.items()}
    p.node_ip = ip
    return replace(p)
