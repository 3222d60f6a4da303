"""The driver's workers: a :class:`WorkerRef` per Ray actor, the :class:`WorkerPool` of them by
role, and where an actor of a role is placed.

The pool is shared by the event loop (the serving backend) and the supervisor's threads; every
read or change of its lists holds ``pool.lock``. Load (requests and tokens in flight) is not
kept here: it is the dispatcher's (router/dispatch.py), keyed by ``WorkerRef.wid``.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from dataclasses import dataclass, field

from tandem.cluster.clients import DecodeClient, PrefillClient, RoleClient

_worker_ids = itertools.count()

PREFILL, DECODE = "prefill", "decode"
WORKER_NAME = re.compile(r"^(prefill|decode)-(\d+)(?:-r(\d+))?$")


def replacement_name(name: str) -> str:
    """The name a relaunch of worker ``name`` takes: ``prefill-0`` -> ``prefill-0-r1`` -> ``-r2``.
    Deterministic, so routers that relaunch the same dead worker create one actor."""
    m = WORKER_NAME.match(name)
    if m is None:
        raise ValueError(f"not a worker name: {name!r}")
    return f"{m[1]}-{m[2]}-r{int(m[3] or 0) + 1}"


@dataclass(eq=False)
class WorkerRef:
    """One actor as the driver sees it."""

    name: str
    role: str            # PREFILL | DECODE
    slot: int            # which of cfg.prefill / cfg.decode it fills (kept across restarts)
    handle: object       # the Ray actor handle
    alive: bool = True
    error: str = ""      # why it was declared dead
    node_id: str = ""    # the Ray node it runs on (from its info())
    retiring: bool = False   # seen draining: when it dies it is not relaunched
    suspect_since: float | None = None   # monotonic time it was found making no progress, or None
    last_answer: float = field(default_factory=time.monotonic)
    # ^ when it last answered its heartbeat (the supervisor's progress clock)
    step_s: float = 0.0   # how long its engine had been in one step, at that answer
    stale: set = field(default_factory=set)   # rids moved off it while suspect: aborted when it is back
    writing: dict = field(default_factory=dict)   # prefill: rid -> seconds its KV write has waited
    wid: int = field(default_factory=lambda: next(_worker_ids))   # the dispatcher's worker id

    @property
    def api(self) -> RoleClient:
        """The verbs every worker answers."""
        return RoleClient(self.handle)

    @property
    def prefill_api(self) -> PrefillClient:
        """A prefill worker's verbs; ValueError for a decode worker."""
        return PrefillClient(self._as(PREFILL))

    @property
    def decode_api(self) -> DecodeClient:
        """A decode worker's verbs; ValueError for a prefill worker."""
        return DecodeClient(self._as(DECODE))

    def _as(self, role: str):
        if self.role != role:
            raise ValueError(f"{self.name} is a {self.role} worker, not a {role} worker")
        return self.handle


class WorkerPool:
    """``prefills`` and ``decodes`` in slot order; a replacement takes its predecessor's place."""

    def __init__(self) -> None:
        self.prefills: list[WorkerRef] = []
        self.decodes: list[WorkerRef] = []
        self.lock = threading.RLock()

    def add(self, w: WorkerRef) -> None:
        with self.lock:
            self._of(w.role).append(w)

    def everyone(self, alive_only: bool = False) -> list[WorkerRef]:
        """A copy: prefill workers, then decode workers."""
        with self.lock:
            return [w for w in self.prefills + self.decodes if w.alive or not alive_only]

    def alive(self, role: str) -> list[WorkerRef]:
        with self.lock:
            return [w for w in self._of(role) if w.alive]

    def get(self, wid: int) -> WorkerRef | None:
        with self.lock:
            return next((w for w in self.prefills + self.decodes if w.wid == wid), None)

    def named(self, name: str) -> WorkerRef | None:
        with self.lock:
            return next((w for w in self.prefills + self.decodes if w.name == name), None)

    def remove(self, w: WorkerRef) -> bool:
        """``w`` leaves the pool (retired, or a duplicate); False when it was not in it."""
        with self.lock:
            ws = self._of(w.role)
            if w not in ws:
                return False
            ws.remove(w)
            return True

    def replace(self, old: WorkerRef, new: WorkerRef) -> bool:
        """``new`` takes ``old``'s place; False when ``old`` is no longer in the pool."""
        with self.lock:
            ws = self._of(old.role)
            if old not in ws:
                return False
            ws[ws.index(old)] = new
            return True

    def _of(self, role: str) -> list[WorkerRef]:
        if role not in (PREFILL, DECODE):
            raise ValueError(f"role must be {PREFILL!r} or {DECODE!r}, got {role!r}")
        return self.prefills if role == PREFILL else self.decodes


def placement(n_workers: int, role: str, *, sim: bool = False, role_resource: bool = False) -> dict:
    """Ray ``.options()`` for one actor of ``role`` among ``n_workers``: a GPU each when the
    cluster has one per worker, else an even share of the CPUs (torch threads follow). On a
    KubeRay cluster each worker group offers a custom resource named after its role
    (k8s/base/raycluster.yaml): when it is there the actor asks for it, to land on its group.
    ``role_resource`` (the planner's autoscaling): always ask for it, and one CPU, so a missing
    node is a resource demand the Ray autoscaler answers. ``sim``: a simulated worker, which
    computes nothing (a tenth of a CPU)."""
    import ray

    res = ray.cluster_resources()
    if role_resource:
        return {"num_gpus": 0, "num_cpus": 0.1 if sim else 1, "resources": {role: 1}}
    if sim:
        opts = {"num_gpus": 0, "num_cpus": 0.1}
    elif res.get("GPU", 0) >= n_workers:
        opts = {"num_gpus": 1, "num_cpus": 1}
    else:
        share = res.get("CPU", 1.0) / max(n_workers, 1)
        opts = {"num_gpus": 0, "num_cpus": max(0.1, min(share, 64.0))}
    if res.get(role, 0) >= 1:
        opts["resources"] = {role: 1}
    return opts
