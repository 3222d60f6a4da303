"""The driver's workers: :class:`WorkerRef` per actor, the :class:`WorkerPool` by role, placement.
Every read or change of the pool's lists holds ``pool.lock``.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tandem.cluster.clients import DecodeClient, PrefillClient, RoleClient

if TYPE_CHECKING:
    from ray.actor import ActorHandle

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
    role: str
    slot: int
    handle: ActorHandle[Any]
    alive: bool = True
    error: str = ""
    node_id: str = ""
    retiring: bool = False
    suspect_since: float | None = None
    last_answer: float = field(default_factory=time.monotonic)
    step_s: float = 0.0
    stale: set[str] = field(default_factory=set)
    writing: dict[str, float] = field(default_factory=dict)   # rid -> seconds its KV write has taken
    wid: int = field(default_factory=lambda: next(_worker_ids))

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

    def _as(self, role: str) -> ActorHandle[Any]:
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


def placement(n_workers: int, role: str, *, sim: bool = False, role_resource: bool = False) -> dict[str, Any]:
    """Ray ``.options()`` for one actor of ``role`` among ``n_workers``: a GPU each when there are
    enough, else an even CPU share; the role's resource when the cluster offers it, always with
    ``role_resource``; ``sim``: a tenth of a CPU."""
    import ray

    res = ray.cluster_resources()
    if role_resource:
        return {"num_gpus": 0, "num_cpus": 0.1 if sim else 1, "resources": {role: 1}}
    opts: dict[str, Any]
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


class Launching(Protocol):
    """What the backend, the supervisor and the planner use of cluster/launch.py's ``Launcher``
    (which imports them, so they name it by this Protocol)."""

    @property
    def namespace(self) -> str: ...
    @property
    def detached(self) -> bool: ...
    @property
    def kv_events(self) -> bool: ...
    @property
    def capacity(self) -> dict[str, int]:
        """Each role's KV tokens per worker."""

    def bootstrap(self, pool: WorkerPool) -> list[dict[str, Any]]:
        """Launch (or adopt) and pair every worker into ``pool``; their ``info()``, in pool order."""

    def spawn(self, role: str, slot: int, name: str) -> WorkerRef: ...
    def discover(self) -> list[WorkerRef]: ...
    def info(self, workers: list[WorkerRef], timeout: float = ...) -> list[dict[str, Any]]: ...
    def answering(self, workers: list[WorkerRef],
                  timeout: float = ...) -> list[tuple[WorkerRef, dict[str, Any]]]: ...
    def pair(self, p: WorkerRef, d: WorkerRef) -> None: ...
    def pair_decodes(self, a: WorkerRef, b: WorkerRef) -> None: ...
