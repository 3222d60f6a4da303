"""The planner's hands: sizes the prefill and decode worker groups from router/planner.py's plans
(one leader router at a time, by a Ray lease; cluster/README.md).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from typing import TYPE_CHECKING, Any

from tandem.cluster.workers import DECODE, PREFILL, WORKER_NAME, WorkerPool, WorkerRef
from tandem.core.config import PlannerConfig
from tandem.router.planner import Observation, Plan, Planner

if TYPE_CHECKING:
    from collections.abc import Callable

    from ray.actor import ActorHandle

    from tandem.cluster.supervisor import Supervisor
    from tandem.cluster.workers import Launching
    from tandem.router.dispatch import Dispatcher

log = logging.getLogger(__name__)

LEASE_NAME = "tandem-planner-lease"
SPAWN_TIMEOUT_S = 300.0
MIN_DRAIN_S = 2.5


def _lease_class() -> Any:
    """The planner's lease actor class (:class:`~tandem.core.actors.PlannerLeaseAPI`), defined on first use."""
    import ray

    @ray.remote(num_cpus=0)
    class PlannerLease:
        def __init__(self) -> None:
            self.holder: str | None = None
            self.until = 0.0

        def acquire(self, who: str, ttl_s: float) -> bool:
            now = time.monotonic()
            if self.holder in (None, who) or now >= self.until:
                self.holder, self.until = who, now + ttl_s
                return True
            return False

        def release(self, who: str) -> None:
            if self.holder == who:
                self.holder = None

    return PlannerLease


class Autoscaler:
    def __init__(self, cfg: PlannerConfig, pool: WorkerPool, dispatch: Dispatcher, launcher: Launching,
                 supervisor: Supervisor, mover: Callable[[WorkerRef], None] | None = None) -> None:
        """``mover(w)``: moves a draining decode worker's live requests away (live migration; the
        backend's), so a scale-down does not wait for them to finish; None: it waits."""
        self.cfg, self.pool, self.dispatch, self.launcher, self.supervisor = cfg, pool, dispatch, launcher, supervisor
        self.mover = mover
        self.planner = Planner(cfg)
        self.me = uuid.uuid4().hex[:8]
        self.leader = False
        self.last: Plan | None = None
        self.history: deque[Any] = deque(maxlen=64)
        self._spawning: dict[str, tuple[WorkerRef, float]] = {}
        self._draining: dict[int, tuple[WorkerRef, float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lease: ActorHandle[Any] | None = None   # the PlannerLeaseAPI actor

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tandem-planner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.period_s + 5)
        if self._lease is not None and self.leader:
            try:
                self._lease.release.remote(self.me)
            except Exception:  # noqa: BLE001
                pass

    def status(self) -> dict[str, Any]:
        return {"leader": self.leader, "plan": None if self.last is None else
                {"prefill": self.last.prefill, "decode": self.last.decode, "reason": self.last.reason},
                "spawning": sorted(self._spawning), "draining": sorted(w.name for w, _ in self._draining.values()),
                "history": [list(h) for h in self.history]}

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.period_s):
            try:
                self._round()
            except BaseException as e:  # noqa: BLE001
                if self._stop.is_set():
                    return
                log.warning("planner round failed: %s", e)

    def _acquire(self) -> bool:
        import ray

        if self._lease is None:
            self._lease = _lease_class().options(name=LEASE_NAME, namespace=self.launcher.namespace,
                                                 lifetime="detached", get_if_exists=True).remote()
        return bool(ray.get(self._lease.acquire.remote(self.me, 3 * self.cfg.period_s), timeout=10))

    def _round(self) -> None:
        self.leader = self._acquire()
        if not self.leader:
            return
        self._settle()
        counts = self.dispatch.counts()
        c = self.cfg
        snaps = self.dispatch.snapshots()
        queue = sum(s.waiting for wid, s in snaps.items()
                    if (w := self.pool.get(wid)) is not None and w.role == PREFILL and w.alive)
        obs = Observation(counts[PREFILL], counts[DECODE], len(self._spawning) + len(self._draining),
                          self.dispatch.latency.percentile("ttft", c.percentile),
                          self.dispatch.latency.percentile("itl", c.percentile), queue)
        plan = self.planner.plan(obs, time.monotonic())
        self.last = plan
        self._request(plan)
        if (plan.prefill, plan.decode) == (obs.prefill, obs.decode):
            return
        self.history.append((round(time.time(), 3), plan.prefill, plan.decode, plan.reason))
        log.warning("planner: %s -> prefill %d, decode %d", plan.reason, plan.prefill, plan.decode)
        for role, want, have in ((PREFILL, plan.prefill, obs.prefill), (DECODE, plan.decode, obs.decode)):
            for _ in range(want - have):
                self._spawn(role)
            for _ in range(have - want):
                self._drain_one(role)

    def _request(self, plan: Plan) -> None:
        try:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[{PREFILL: 1}] * plan.prefill + [{DECODE: 1}] * plan.decode)
        except Exception as e:  # noqa: BLE001
            log.info("request_resources: %s", e)

    def _spawn(self, role: str) -> None:
        taken = {w.name for w in self.launcher.discover()} | {w.name for w in self.pool.everyone()}
        slots = [int(m[2]) for n in taken if (m := WORKER_NAME.match(n)) and m[1] == role]
        slot = max(slots, default=-1) + 1
        w = self.launcher.spawn(role, slot, f"{role}-{slot}")
        self._spawning[w.name] = (w, time.monotonic())

    def _drain_one(self, role: str) -> None:
        view = self.dispatch.view()
        ws = view.prefill if role == PREFILL else view.decode
        draining = {wid for wid in self._draining}
        live = [v for v in ws if v.alive and v.worker_id not in draining]
        if len(live) <= 1:
            return
        v = min(live, key=lambda v: (v.in_flight, v.running_tokens, -v.worker_id))
        w = self.pool.get(v.worker_id)
        if w is None:
            return
        w.api.drain()
        w.retiring = True
        self._draining[w.wid] = (w, time.monotonic())
        if role == DECODE and self.mover is not None:
            self.mover(w)

    def _settle(self) -> None:
        """New workers that joined rotation leave ``_spawning``; drained ones that are idle stop."""
        import ray

        now = time.monotonic()
        for name, (w, t0) in list(self._spawning.items()):
            if self.pool.named(name) is not None:
                del self._spawning[name]
            elif now - t0 > SPAWN_TIMEOUT_S:
                log.warning("planner: %s never started; given up", name)
                ray.kill(w.handle)
                del self._spawning[name]
        snaps = self.dispatch.snapshots()
        view = {v.worker_id: v for v in self.dispatch.view().prefill + self.dispatch.view().decode}
        for wid, (w, t0) in list(self._draining.items()):
            s, v = snaps.get(wid), view.get(wid)
            idle = (s is not None and s.draining and s.running == 0 and s.waiting == 0
                    and (v is None or v.in_flight == 0))
            if (idle and now - t0 >= MIN_DRAIN_S) or now - t0 > self.cfg.drain_timeout_s or not w.alive:
                try:
                    ray.kill(w.handle, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
                self.supervisor.mark_dead(w, "drained by the planner")
                del self._draining[wid]
                log.warning("planner: %s drained and stopped", w.name)
