"""The soak's sampler: every process's RSS, open file descriptors and threads, and the cluster's
KV accounting, over time; and the verdict "flat".
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlparse

# Ray titles an actor's process ray::Class when idle, ray::NAME:Class.method while it runs one
ACTOR_TITLE = re.compile(r"^ray::(?:[\w.-]+:)?(?:Sim)?(Prefill|Decode)Actor\b")


@dataclass(frozen=True)
class Bounds:
    """Growth allowed after warm-up, per process (last sample minus the first after warm-up)."""

    rss_mb: float = 96.0
    fds: int = 16
    threads: int = 8


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def proc_stats(pid: int) -> dict | None:
    """``{"rss_mb", "fds", "threads"}`` of ``pid``; None when it is gone or unreadable."""
    try:
        import psutil
    except ImportError:
        return _proc_status(pid)
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            return {"rss_mb": p.memory_info().rss / 2**20, "fds": p.num_fds(), "threads": p.num_threads()}
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _proc_status(pid: int) -> dict | None:
    """:func:`proc_stats` from /proc, without psutil."""
    try:
        status = open(f"/proc/{pid}/status").read()
        rss, threads = re.search(r"VmRSS:\s+(\d+)", status), re.search(r"Threads:\s+(\d+)", status)
        if rss is None or threads is None:
            return None
        return {"rss_mb": int(rss.group(1)) / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
                "threads": int(threads.group(1))}
    except OSError:
        return None


def _listener(port: int) -> int | None:
    """The pid listening on TCP ``port`` of this machine (None: none of ours found)."""
    try:
        import psutil
    except ImportError:
        return None
    for p in psutil.process_iter(["pid"]):
        try:
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
                    return p.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return None


def actor_pids(roots: list[int]) -> dict[str, list[int]]:
    """``{"prefill": [pid, ...], "decode": [...]}``: the Tandem actor processes under ``roots``
    (needs psutil; without it, none)."""
    out: dict[str, list[int]] = {"prefill": [], "decode": []}
    try:
        import psutil
    except ImportError:
        return out
    seen = set()
    for root in roots:
        kids = []
        for _ in range(3):
            try:
                kids = psutil.Process(root).children(recursive=True)
                break
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                if not psutil.pid_exists(root):
                    break
        for p in kids:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            m = ACTOR_TITLE.match(_title(p.pid))
            if m:
                out[m.group(1).lower()].append(p.pid)
    return {k: sorted(v) for k, v in out.items()}


def actor_named(name: str, pids: list[int]) -> int | None:
    """The one of ``pids`` whose title names actor ``name`` now (busy actors show their name)."""
    return next((p for p in pids if _title(p).startswith(f"ray::{name}:")), None)


def local_processes(urls: list[str], roots: Sequence[int] = ()) -> dict[str, int]:
    """``{label: pid}`` of the routers at ``urls`` and the Tandem actors under them and ``roots``."""
    out = {}
    for i, u in enumerate(urls):
        port = urlparse(u).port
        pid = _listener(port) if port else None
        if pid is not None:
            out[f"router-{i}"] = pid
    for role, pids in actor_pids([*out.values(), *roots]).items():
        for pid in pids:
            out[f"{role}@{pid}"] = pid
    return out


def sample_all(urls: list[str], roots: Sequence[int] = ()) -> dict[str, dict | None]:
    """``{label: proc_stats}`` of :func:`local_processes` (blocking: psutil walks every process)."""
    return {label: proc_stats(pid) for label, pid in local_processes(urls, roots).items()}


KV_KEYS = ("running", "waiting", "request_tokens", "locked_tokens", "leaked_tokens", "live_transfers")


def kv_totals(workers: list[dict]) -> dict:
    """The sum over GET /debug/kv's rows of :data:`KV_KEYS`, the tokens in use
    (total - available - evictable) and the workers that answered / did not."""
    out = dict.fromkeys(KV_KEYS, 0)
    out |= {"used_tokens": 0, "workers": 0, "unreachable": 0}
    for w in workers:
        if "error" in w:
            out["unreachable"] += 1
            continue
        out["workers"] += 1
        for k in KV_KEYS:
            out[k] += int(w.get(k, 0) or 0)
        if "total_tokens" in w:
            out["used_tokens"] += int(w["total_tokens"]) - int(w.get("available_tokens", 0)) \
                - int(w.get("evictable_tokens", 0))
    return out


@dataclass
class Series:
    """Samples over a run: ``procs[label]`` is a list of (t, stats); ``kv`` a list of (t, totals)."""

    procs: dict[str, list[tuple[float, dict]]] = field(default_factory=dict)
    kv: list[tuple[float, dict]] = field(default_factory=list)

    def add(self, t: float, procs: dict[str, dict | None], kv: dict | None) -> None:
        for label, s in procs.items():
            if s is not None:
                self.procs.setdefault(label, []).append((t, s))
        if kv is not None:
            self.kv.append((t, kv))

    def to_json(self) -> dict:
        return {"procs": {k: [[t, s] for t, s in v] for k, v in self.procs.items()},
                "kv": [[t, s] for t, s in self.kv]}


def growth(series: Series, warmup_s: float) -> dict[str, dict]:
    """Per process: first and last value after ``warmup_s`` and their difference, per metric
    (processes with fewer than two samples after warm-up are left out)."""
    out = {}
    for label, rows in series.procs.items():
        rows = [(t, s) for t, s in rows if t >= warmup_s]
        if len(rows) < 2:
            continue
        first, last = rows[0][1], rows[-1][1]
        out[label] = {k: {"first": first[k], "last": last[k], "growth": last[k] - first[k],
                          "max": max(s[k] for _, s in rows)} for k in ("rss_mb", "fds", "threads")}
    return out


def flat(series: Series, warmup_s: float, bounds: Bounds = Bounds()) -> list[str]:
    """Why the run is not flat (empty: flat)."""
    why = []
    lim = {"rss_mb": bounds.rss_mb, "fds": bounds.fds, "threads": bounds.threads}
    for label, g in growth(series, warmup_s).items():
        for k, v in g.items():
            if v["growth"] > lim[k]:
                why.append(f"{label}: {k} grew {v['growth']:.0f} (from {v['first']:.0f} to {v['last']:.0f}; "
                           f"bound {lim[k]:g})")
    return why


def format_table(series: Series, warmup_s: float) -> str:
    """One row per process (RSS MB, fds, threads: first after warm-up -> last), then the KV
    accounting's first and last sample."""
    g = growth(series, warmup_s)
    lines = [f"  {'process':<14} {'samples':>7}  {'RSS MB':>17}  {'fds':>11}  {'threads':>11}"]
    for label in sorted(series.procs):
        n = len(series.procs[label])
        if label not in g:
            lines.append(f"  {label:<14} {n:>7}  (fewer than two samples after warm-up)")
            continue
        c = g[label]
        cell = lambda k, f: f"{c[k]['first']:{f}} -> {c[k]['last']:{f}}"  # noqa: E731
        lines.append(f"  {label:<14} {n:>7}  {cell('rss_mb', '7.0f'):>17}  {cell('fds', '4d'):>11}  "
                     f"{cell('threads', '4d'):>11}")
    if series.kv:
        for name, (t, kv) in (("first", series.kv[0]), ("last", series.kv[-1])):
            lines.append(f"  KV {name} (t={t:.0f}s): " + ", ".join(f"{k} {v}" for k, v in kv.items()))
    return "\n".join(lines)


def plot(series: Series, path, title: str = "soak") -> None:
    """RSS, fds and threads per process, and the KV tokens in use, against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(18, 4))
    for label, rows in sorted(series.procs.items()):
        t = [r[0] for r in rows]
        for a, k in zip(ax[:3], ("rss_mb", "fds", "threads")):
            a.plot(t, [r[1][k] for r in rows], ".-", label=label)
    for a, k in zip(ax, ("RSS (MiB)", "open fds", "threads", "KV tokens")):
        a.set(xlabel="seconds", ylabel=k)
    if series.kv:
        t = [r[0] for r in series.kv]
        for k in ("used_tokens", "request_tokens", "leaked_tokens"):
            ax[3].plot(t, [r[1][k] for r in series.kv], ".-", label=k)
        ax[3].legend(fontsize=7)
    ax[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
