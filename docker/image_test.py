#!/usr/bin/env python3
"""`make image-test`: the CPU image run the way k8s/overlays/cpu-dev runs it, one container per pod.

A Ray head, a prefill and a decode worker (KubeRay's `ray start` line built from the manifests'
rayStartParams, the manifests' uid, env, /dev/shm size and probes), then the router with the
manifest's own command and the overlay's serve.yaml, the API-keys file mounted where the Secret
would be. Every container shares the host network, each Ray node on a loopback IP of its own with
distinct ports (docker/k8s_pods.py: the only rewrite); the host talks to 127.0.0.1 only.

Then, from the host: a chat request, a streamed one, /metrics and /health; the decode container
SIGKILLed in the middle of a stream and a new one started as KubeRay would recreate the pod: the
router's supervisor relaunches the decode worker there, the stream resumes on it (transparent
failover, the manifests' failover_wait_s) and ends with the text the same request gets without the
kill, and new requests are served; the
pods stopped as Kubernetes stops them (preStop, SIGTERM, the grace period). Last, `tandem serve` on
the host with the same engine settings answers the same greedy prompt: the answers must be equal.
On a failure, the containers' own last log lines are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import k8s_pods  # noqa: E402

ROOT = HERE.parent
PREFIX = "tandem-it"
PROMPT = "What is the capital of France?"
MAX_TOKENS = 24
LONG_TOKENS = 200          # the stream the decode container is killed in the middle of
# Each Ray node's loopback IP (Ray turns 127.0.0.1 itself into the machine's outward address).
IPS = {"head": "127.0.0.11", "prefill": "127.0.0.12", "decode": "127.0.0.13", "router": "127.0.0.14",
       "decode-2": "127.0.0.15"}
T0 = time.monotonic()


class Failed(Exception):
    pass


def say(msg: str) -> None:
    print(f"[image-test {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def engine() -> list[str]:
    if shutil.which("podman"):
        flags = os.environ.get("TANDEM_PODMAN_FLAGS")
        if flags is None:
            flags = "--runtime runc --cgroup-manager=cgroupfs" if shutil.which("runc") else ""
        return ["podman", *shlex.split(flags)]
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return ["docker"]
    print("image-test: no container engine: install podman (Debian/Ubuntu: apt-get install -y podman runc)"
          " or start a docker daemon", file=sys.stderr)
    sys.exit(127)


ENGINE: list[str] = []
ULIMITS = [f for u in os.environ.get("TANDEM_ULIMITS", "nofile=20000:20000 nproc=4096:4096").split()
           for f in ("--ulimit", u)]


def eng(*args: str, check: bool = True, timeout: float | None = 120) -> subprocess.CompletedProcess:
    p = subprocess.run([*ENGINE, *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise Failed(f"{' '.join(ENGINE[:1] + list(args[:3]))} ...: exit {p.returncode}: {p.stderr.strip()[-800:]}")
    return p


# --- ports -----------------------------------------------------------------------------------

_taken: set[int] = set()


def _free(port: int) -> bool:
    if port in _taken:
        return False
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if _free(p):
            _taken.add(p)
            return p


def free_range(n: int) -> tuple[int, int]:
    for _ in range(200):
        lo = random.randrange(42000, 59000 - n)
        if all(_free(p) for p in range(lo, lo + n)):
            _taken.update(range(lo, lo + n))
            return lo, lo + n - 1
    raise Failed("no free range of ports for Ray's workers")


def host_ports(head: bool) -> k8s_pods.HostPorts:
    lo, hi = free_range(64)
    return k8s_pods.HostPorts(
        metrics=free_port(), agent=free_port(), agent_grpc=free_port(), node_manager=free_port(),
        object_manager=free_port(), runtime_env_agent=free_port(), min_worker=lo, max_worker=hi,
        gcs=free_port() if head else None, dashboard=free_port() if head else None)


# --- containers ------------------------------------------------------------------------------

class Cluster:
    def __init__(self, image: str, workdir: Path):
        self.image, self.workdir = image, workdir
        self.pods = k8s_pods.pods("cpu-dev")
        self.names: list[str] = []
        self.running: dict[str, k8s_pods.Pod] = {}
        self.secrets = {"tandem/auth_token": secrets.token_hex(24)}
        self.api_key = "sk-image-test-" + secrets.token_hex(12)
        self.head_ports = host_ports(head=True)
        self.head_addr = f"{IPS['head']}:{self.head_ports.gcs}"
        self.http_port = free_port()

    def files(self) -> dict[str, Path]:
        """The ConfigMap and the Secret as the kubelet would mount them (the key file root-owned,
        group fsGroup, mode 0440: the Secret's defaultMode)."""
        cfg_dir, keys_dir = self.workdir / "serve-config", self.workdir / "api-keys"
        cfg_dir.mkdir(exist_ok=True)
        keys_dir.mkdir(exist_ok=True)
        cfg = yaml.safe_load(k8s_pods.serve_yaml("cpu-dev"))
        cfg["host"], cfg["port"] = "127.0.0.1", self.http_port     # loopback only, a free port
        (cfg_dir / "serve.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        keys = keys_dir / Path(cfg["api_keys"]).name
        keys.write_text(yaml.safe_dump([{"key": self.api_key, "tenant": "image-test", "role": "user"}]))
        fs_group = self.pods["router"].fs_group or 0
        os.chown(keys, 0, fs_group)
        os.chmod(keys, 0o440)
        for d in (cfg_dir, keys_dir, self.workdir):
            os.chmod(d, 0o755)
        return {"/etc/tandem": cfg_dir, "/etc/tandem-keys": keys_dir}

    def start(self, role: str, name: str, ip: str, ports: k8s_pods.HostPorts, mounts: dict[str, Path]) -> k8s_pods.Pod:
        pod = k8s_pods.on_host_network(self.pods[role], ip, ports, self.head_addr)
        if role == "router":
            pod.ports = {"http": self.http_port}
        args = ["run", "-d", "--name", name, "--hostname", name, "--network", "host", "--user", pod.user,
                *ULIMITS, "--memory", str(pod.memory_limit_bytes)]
        if pod.fs_group is not None:
            args += ["--group-add", str(pod.fs_group)]
        if pod.shm_bytes:
            args += ["--shm-size", str(pod.shm_bytes)]
        for k, v in pod.env.items():
            args += ["-e", f"{k}={self.secrets[v[7:]] if v.startswith('secret:') else v}"]
        for path, vol in pod.mounts.items():
            if path == "/dev/shm":
                continue
            if path not in mounts:
                raise Failed(f"{role}: no source for the volume at {path}: {vol}")
            args += ["-v", f"{mounts[path]}:{path}:ro"]
        eng("rm", "-f", name, check=False)
        eng(*args, self.image, *pod.command)
        self.names.append(name)
        self.running[name] = pod
        say(f"started {name} ({role}, {ip}): {' '.join(pod.command)[:220]}")
        return pod

    def alive(self, name: str) -> bool:
        p = eng("inspect", "--format", "{{.State.Running}}", name, check=False)
        return p.stdout.strip() == "true"

    def probe(self, name: str, probe: k8s_pods.Probe) -> bool:
        if probe.kind == "exec":
            try:
                p = eng("exec", name, *probe.command, check=False, timeout=probe.timeout_s + 10)
            except subprocess.TimeoutExpired:
                return False
            return p.returncode == 0
        port = self.running[name].ports[probe.port] if isinstance(probe.port, str) else probe.port
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{probe.path}", timeout=probe.timeout_s) as r:
                return 200 <= r.status < 400
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, name: str, which: str = "readiness", budget_s: float | None = None) -> float:
        """Until the probe passes, no longer than the manifest allows (initial delay + period x
        failures; for the router its startup probe), or ``budget_s``."""
        pod = self.running[name]
        probe = getattr(pod, which)
        limit = budget_s or probe.initial_delay_s + probe.period_s * probe.failure_threshold
        t = time.monotonic()
        while time.monotonic() - t < limit:
            if not self.alive(name):
                raise Failed(f"{name} exited before its {which} probe passed")
            if self.probe(name, probe):
                return time.monotonic() - t
            time.sleep(min(2.0, probe.period_s))
        raise Failed(f"{name}: {which} probe still failing after {limit:.0f} s")

    def logs(self, lines: int = 30) -> None:
        for name in self.names:
            p = eng("logs", "--tail", str(lines), name, check=False)
            print(f"---- {name}: last {lines} log lines ----\n{(p.stdout + p.stderr).rstrip()}", file=sys.stderr)
            if name in self.running and self.running[name].ray_start:
                e = eng("exec", name, "sh", "-c", "tail -n 8 /tmp/ray/session_latest/logs/raylet.err "
                        "/tmp/ray/session_latest/logs/worker-*.err 2>/dev/null | tail -n 40", check=False)
                if e.stdout.strip():
                    print(f"---- {name}: Ray's own logs ----\n{e.stdout.rstrip()}", file=sys.stderr)

    def stop(self, name: str) -> dict:
        """As the kubelet stops a container: the preStop hook, then SIGTERM, SIGKILL once the grace
        period (counted from the hook's start) is over. {"prestop_s", "s" (in all), "exit", "killed"}."""
        pod, t = self.running[name], time.monotonic()
        if pod.pre_stop:
            try:
                eng("exec", name, *pod.pre_stop, check=False, timeout=pod.grace_s)
            except subprocess.TimeoutExpired:
                pass
        hook = time.monotonic() - t
        left = max(1, int(pod.grace_s - hook))
        eng("stop", "-t", str(left), name, check=False, timeout=pod.grace_s + 30)
        code = int(eng("inspect", "--format", "{{.State.ExitCode}}", name, check=False).stdout.strip() or -1)
        if code == 137:
            p = eng("logs", "--tail", "8", name, check=False)
            print(f"---- {name}: SIGKILLed; its last log lines ----\n{(p.stdout + p.stderr).rstrip()}", file=sys.stderr)
        return {"prestop_s": round(hook, 1), "s": round(time.monotonic() - t, 1), "exit": code,
                "killed": code == 137, "grace_s": pod.grace_s}

    def remove_all(self) -> None:
        for name in self.names:
            eng("rm", "-f", "-t", "0", name, check=False)


# --- requests --------------------------------------------------------------------------------

def post(port: int, path: str, body: dict, key: str | None, timeout: float = 120) -> urllib.request.Request:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    return req


def chat(port: int, key: str | None, max_tokens: int = MAX_TOKENS) -> str:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0}
    with urllib.request.urlopen(post(port, "/v1/chat/completions", body, key), timeout=180) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def stream(port: int, key: str | None, max_tokens: int = MAX_TOKENS, on_chunk=None, long: bool = False) -> dict:
    """A streamed chat: {"text", "chunks", "done" ([DONE] seen), "finish", "error"}; ``long``: all
    ``max_tokens`` of them (ignore_eos), a stream that is still going when the decode pod dies."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    if long:
        body["ignore_eos"] = True
    out = {"text": "", "chunks": 0, "done": False, "finish": None, "error": None}
    try:
        with urllib.request.urlopen(post(port, "/v1/chat/completions", body, key), timeout=180) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out["done"] = True
                    break
                ev = json.loads(data)
                if "error" in ev:
                    out["error"] = ev["error"]
                    continue
                ch = ev["choices"][0]
                out["text"] += ch.get("delta", {}).get("content") or ""
                out["finish"] = ch.get("finish_reason") or out["finish"]
                out["chunks"] += 1
                if on_chunk:
                    on_chunk(out["chunks"])
    except Exception as e:  # noqa: BLE001  (the outcome is what we report)
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def host_answer(workdir: Path, cfg_text: str) -> str:
    """`tandem serve` on the host, the overlay's engine settings, a local Ray; its greedy answer."""
    cfg = yaml.safe_load(cfg_text)
    port = free_port()
    # A local Ray offers no {"prefill": 1} / {"decode": 1} nodes for the planner to ask for: it is off
    # (it sizes the groups; it does not touch a request's tokens).
    cfg.update(host="127.0.0.1", port=port, worker_lifetime="router")
    cfg.setdefault("planner", {})["enabled"] = False
    for k in ("api_keys", "ray_address"):
        cfg.pop(k, None)
    path = workdir / "host-serve.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    tandem = Path(sys.executable).parent / "tandem"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    log = open(workdir / "host-serve.log", "w")
    proc = subprocess.Popen([str(tandem), "serve", "--config", str(path)], stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    try:
        t = time.monotonic()
        while time.monotonic() - t < 600:
            if proc.poll() is not None:
                raise Failed(f"host tandem serve exited {proc.returncode}: "
                             f"{(workdir / 'host-serve.log').read_text()[-1500:]}")
            if get_ok(port):
                break
            time.sleep(2)
        else:
            raise Failed("host tandem serve: /health not ok after 600 s")
        return chat(port, None)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def get_ok(port: int) -> bool:
    try:
        return get(port, "/health")[0] == 200
    except OSError:
        return False


# --- the test --------------------------------------------------------------------------------

# Every native library a pod of the image loads (the workers, the router, the kv-store pod's master):
# a shared library the image lacks shows here, not first in a pod that never turns ready.
LOADS = ("import subprocess, sys, nixl, ray, mooncake.store, tandem.engine.engine, tandem.cluster.backend; "
         "m = subprocess.run([sys.prefix + '/bin/mooncake_master', '--help'], capture_output=True); "
         "assert b'rpc_port' in m.stdout + m.stderr, m; print('nixl, ray, mooncake.store, mooncake_master, tandem')")


def run(args) -> dict:
    figures: dict = {}
    if eng("image", "inspect", args.image, check=False).returncode != 0:
        raise Failed(f"no image {args.image}: run `make image` first")
    loads = eng("run", "--rm", "--network", "host", *ULIMITS, args.image, "/opt/tandem/.venv/bin/python", "-c",
                LOADS, check=False, timeout=300)
    if loads.returncode != 0:
        raise Failed(f"the image's Python imports do not load: {(loads.stdout + loads.stderr).strip()[-800:]}")
    say(f"imports load in the image: {loads.stdout.strip()}")
    with tempfile.TemporaryDirectory(prefix="tandem-image-test-") as tmp:
        workdir = Path(tmp)
        c = Cluster(args.image, workdir)
        try:
            mounts = c.files()
            t = time.monotonic()
            c.start("head", f"{PREFIX}-head", IPS["head"], c.head_ports, mounts)
            figures["head_ready_s"] = round(c.wait_ready(f"{PREFIX}-head"), 1)
            say(f"head ready (its readiness probe: raylet + GCS health) in {figures['head_ready_s']} s")
            for role in ("prefill", "decode"):
                c.start(role, f"{PREFIX}-{role}", IPS[role], host_ports(False), mounts)
            for role in ("prefill", "decode"):
                c.wait_ready(f"{PREFIX}-{role}")
            say("prefill and decode ready (their readiness probes: raylet health)")
            router_ports = host_ports(False)
            c.start("router", f"{PREFIX}-router", IPS["router"], router_ports, mounts)
            figures["router_startup_s"] = round(c.wait_ready(f"{PREFIX}-router", "startup"), 1)
            figures["cluster_up_s"] = round(time.monotonic() - t, 1)
            say(f"router's startup probe (/health) passed in {figures['router_startup_s']} s; "
                f"cluster up in {figures['cluster_up_s']} s")
            for name, pod in c.running.items():
                for which in ("readiness", "liveness"):
                    if getattr(pod, which) and not c.probe(name, getattr(pod, which)):
                        raise Failed(f"{name}: {which} probe fails once up")
            port, key = c.http_port, c.api_key

            code, _ = get(port, "/v1/models")
            if code != 401:
                raise Failed(f"/v1/models without the API key answered {code}, not 401: the key file is not in force")
            answer = chat(port, key)
            say(f"chat: {answer!r}")
            s = stream(port, key)
            if not s["done"] or s["error"] or s["text"] != answer:
                raise Failed(f"stream: {s} (the chat said {answer!r})")
            say(f"stream: {s['chunks']} chunks, [DONE], same text")
            code, metrics = get(port, "/metrics")
            if code != 200 or "tandem_requests_total" not in metrics:
                raise Failed(f"/metrics: {code} {metrics[:300]}")
            code, health = get(port, "/health")
            if code != 200:
                raise Failed(f"/health: {code} {health[:300]}")
            say(f"/metrics ({len(metrics.splitlines())} lines, tandem_requests_total present), /health 200: {health[:160]}")
            figures["answer"] = answer

            # The decode pod dies in the middle of a stream; KubeRay recreates it meanwhile. With
            # transparent failover (issue 48) the stream waits for the new worker (the manifests'
            # failover_wait_s) and ends as it would have without the kill: every token, no error.
            decode = f"{PREFIX}-decode"
            new = f"{PREFIX}-decode-2"
            killed = threading.Event()
            started: list = []

            def replace_decode() -> None:
                eng("kill", "--signal", "KILL", decode, check=False)
                eng("rm", "-f", decode, check=False)
                try:
                    c.start("decode", new, IPS["decode-2"], host_ports(False), mounts)
                    started.append(new)
                except Exception as e:  # noqa: BLE001 - reported below
                    started.append(e)

            def kill_after(n: int) -> None:
                if n == 8 and not killed.is_set():
                    killed.set()
                    threading.Thread(target=replace_decode, daemon=True).start()

            t_kill = time.monotonic()
            mid = stream(port, key, LONG_TOKENS, on_chunk=kill_after, long=True)
            figures["mid_stream"] = {k: mid[k] for k in ("chunks", "done", "finish", "error")}
            figures["mid_stream_s"] = round(time.monotonic() - t_kill, 1)
            say(f"decode container SIGKILLed after 8 chunks and replaced; the stream: {figures['mid_stream']}")
            if not killed.is_set():
                raise Failed(f"the long stream ended before its 8th chunk: {figures['mid_stream']}")
            if mid["error"] or not mid["done"] or mid["finish"] != "length" or mid["chunks"] < LONG_TOKENS // 2:
                raise Failed(f"the stream the decode container died in did not complete: {figures['mid_stream']}")
            while not started:
                time.sleep(0.5)
            c.names.remove(decode)
            if not isinstance(started[0], str):
                raise Failed(f"the replacement decode container did not start: {started[0]}")
            c.wait_ready(new)
            say("replacement decode container ready; waiting for the router to serve again")
            t = time.monotonic()
            last = None
            while time.monotonic() - t < args.recovery_s:
                try:
                    again = chat(port, key)
                    break
                except Exception as e:  # noqa: BLE001
                    last = e
                    time.sleep(3)
            else:
                raise Failed(f"no request served {args.recovery_s} s after the new decode container was ready: {last}")
            figures["recovery_s"] = round(time.monotonic() - t_kill, 1)
            if again != answer:
                raise Failed(f"after recovery the answer changed: {again!r} != {answer!r}")
            full = stream(port, key, LONG_TOKENS, long=True)       # the same request, no fault
            if mid["text"] != full["text"]:
                raise Failed(f"the failed-over stream's text differs from the same request's without a fault:\n"
                             f"{mid['text'][:300]!r}\n{full['text'][:300]!r}")
            say(f"the stream completed on the replacement in {figures['mid_stream_s']} s: the same text as "
                f"the same request without the kill")
            code, health = get(port, "/health")
            router_log = eng("logs", f"{PREFIX}-router", check=False)
            replaced = [ln for ln in (router_log.stdout + router_log.stderr).splitlines() if "replaced by" in ln]
            figures["supervisor"] = replaced[-1][-160:] if replaced else None
            say(f"served again {figures['recovery_s']} s after the kill (same answer); /health {code}; "
                f"supervisor: {figures['supervisor']}")
            if not replaced:
                raise Failed("served again, but the router's log has no 'replaced by' line from the supervisor")

            # A clean stop, as Kubernetes deletes the pods: router first, then workers, then the head.
            stops = {}
            for name in [f"{PREFIX}-router", f"{PREFIX}-prefill", new, f"{PREFIX}-head"]:
                stops[name] = c.stop(name)
                say(f"stopped {name}: {stops[name]}")
            figures["stops"] = stops
            killed = [n for n, st in stops.items() if st["killed"]]
            if killed:
                raise Failed(f"SIGKILLed at the end of their grace period (not a clean stop): {killed}")
        except BaseException:
            c.logs()
            raise
        finally:
            c.remove_all()
        if not args.no_host:
            t = time.monotonic()
            host = host_answer(workdir, k8s_pods.serve_yaml("cpu-dev"))
            figures["host_answer_s"] = round(time.monotonic() - t, 1)
            say(f"host `tandem serve` (same engine settings): {host!r}")
            if host != figures["answer"]:
                raise Failed(f"the containers answered {figures['answer']!r}, the host's tandem serve {host!r}")
    return figures


def main() -> int:
    global ENGINE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", default=os.environ.get("TANDEM_IMAGE", "tandem:0.1.0-cpu"))
    ap.add_argument("--recovery-s", type=float, default=300.0)
    ap.add_argument("--no-host", action="store_true", help="skip the host tandem serve comparison")
    ap.add_argument("--host-only", action="store_true", help="only the host tandem serve's answer (debugging)")
    args = ap.parse_args()
    if args.host_only:
        with tempfile.TemporaryDirectory(prefix="tandem-image-test-") as tmp:
            say(f"host `tandem serve`: {host_answer(Path(tmp), k8s_pods.serve_yaml('cpu-dev'))!r}")
        return 0
    ENGINE = engine()
    try:
        figures = run(args)
    except Failed as e:
        say(f"FAILED: {e}")
        return 1
    say(f"PASSED in {time.monotonic() - T0:.0f} s: {json.dumps(figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
