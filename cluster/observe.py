"""The read side of ``RayClusterBackend`` (/health, /metrics, /debug/kv): a suspect worker is left
out of every gather; every other call is bounded by ``PING_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, generate_latest

from tandem.cluster.metrics import merge_expositions
from tandem.cluster.supervisor import PING_TIMEOUT_S
from tandem.cluster.workers import DECODE, PREFILL, WorkerRef
from tandem.core import tracing

if TYPE_CHECKING:
    from collections.abc import Awaitable, Iterable

    from tandem.cluster.autoscaler import Autoscaler
    from tandem.cluster.kv_feed import KVEventFeed
    from tandem.cluster.legs import Legs
    from tandem.cluster.migration import Migrator
    from tandem.cluster.stream import RequestStream
    from tandem.cluster.supervisor import Supervisor
    from tandem.cluster.workers import Launching, WorkerPool
    from tandem.core.config import ServeConfig
    from tandem.core.messages import GenerateRequest
    from tandem.router.deferred import DeferredDispatch
    from tandem.router.dispatch import Dispatcher, Route

log = logging.getLogger(__name__)

HEALTH_PING_S = 1.0


class ClusterObservability:
    """The backend's read side and its reports: spans and log lines of a route and a failover."""

    # RayClusterBackend's, set in its __init__
    cfg: ServeConfig
    launcher: Launching
    model_name: str
    pool: WorkerPool
    dispatch: Dispatcher
    queue: DeferredDispatch
    supervisor: Supervisor
    feed: KVEventFeed | None
    autoscaler: Autoscaler | None
    streams: dict[str, RequestStream]
    migrator: Migrator

    def _trace_route(self, req: GenerateRequest, r: Route, start_s: float) -> None:
        """The routing span: the queue wait and policy time, and the workers chosen."""
        p, d = self.pool.get(r.prefill), self.pool.get(r.decode)
        attrs: dict[str, Any] = {
            "tandem.rid": req.rid, "tandem.tenant": req.tenant, "tandem.policy": self.cfg.policy,
            "tandem.route_wait_s": time.time() - start_s, "tandem.prefill": p.name if p else "",
            "tandem.decode": d.name if d else ""}
        tracing.record("route", req.trace, start_s, **attrs)

    def _report_failover(self, stream: RequestStream, legs: Legs, dead: WorkerRef, t0: float, at: int) -> None:
        """One log line and a ``failover`` span for ``legs``' resume off ``dead`` after ``at`` tokens."""
        context = len(legs.req.prompt_ids) + at
        log.warning("decode worker %s died under %s: resumed on %s after %d streamed tokens (failover %d of "
                    "%d; %s recomputes up to %d tokens of KV, less its cache hit)", dead.name, legs.req.rid,
                    legs.worker.name, at, stream.failovers, stream.max_failovers, legs.worker.name, context - 1)
        if legs.req.trace:
            attrs: dict[str, Any] = {
                "tandem.rid": legs.req.rid, "tandem.dead": dead.name, "tandem.to": legs.worker.name,
                "tandem.resume_at": at, "tandem.kv_source": f"recompute on {legs.worker.name} (its cache first)",
                "tandem.recomputed_tokens_max": context - 1, "tandem.failover": stream.failovers,
                "tandem.wait_s": time.time() - t0}
            tracing.record("failover", legs.req.trace, t0, **attrs)

    async def health(self) -> dict[str, Any]:
        """Per-worker liveness and progress; a suspect worker does not count as serving."""
        everyone = self.pool.everyone()
        alive = await asyncio.gather(*(self._ping(w, HEALTH_PING_S) for w in everyone))
        results = [ok and w.suspect_since is None for w, ok in zip(everyone, alive)]
        snaps = self.dispatch.snapshots()
        nodes = self._node_resources({w.node_id for w in everyone})
        workers = {w.name: {"role": w.role, "alive": up, "node_id": w.node_id,
                            "node_resources": nodes.get(w.node_id, {}),
                            "draining": bool(snaps.get(w.wid) and snaps[w.wid].draining),
                            "suspect": w.suspect_since is not None,
                            "silent_s": round(max(time.monotonic() - w.last_answer, 0.0), 2),
                            **({"error": w.error} if w.error else {})}
                   for w, up in zip(everyone, alive)}
        live_d = [w for w, ok in zip(everyone, results) if ok and w.role == DECODE]
        live_p = [w for w, ok in zip(everyone, results) if ok and w.role == PREFILL]
        degraded = len(live_d) < self.cfg.decode or len(live_p) < self.cfg.prefill
        return {"status": "ok" if live_d else "error", "mode": "disaggregated", "model": self.model_name,
                "degraded": degraded, "prefill_alive": len(live_p), "decode_alive": len(live_d),
                "restarts": self.supervisor.restarts, "namespace": self.launcher.namespace,
                "dispatch_queue": len(self.queue), "workers": workers,
                **({"kv_events": dict(self.feed.counts)} if self.feed is not None else {}),
                **({"planner": self.autoscaler.status()} if self.autoscaler is not None else {})}

    def _node_resources(self, ids: set[str]) -> dict[str, dict[str, float]]:
        """The custom resources (``prefill``, ``decode``, ...) of the Ray nodes ``ids``, cached."""
        cache: dict[str, dict[str, float]] = self.__dict__.setdefault("_nodes", {})
        if not ids <= set(cache):
            import ray

            try:
                for n in ray.nodes():
                    cache[n["NodeID"]] = {k: v for k, v in n.get("Resources", {}).items()
                                          if k in ("prefill", "decode", "CPU", "GPU")}
            except Exception:  # noqa: BLE001
                pass
        return cache

    async def _ping(self, w: WorkerRef, timeout: float = PING_TIMEOUT_S) -> bool:
        if not w.alive:
            return False
        try:
            await asyncio.wait_for(w.api.ping(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
        except Exception as e:
            self.supervisor.mark_dead(w, f"ping failed: {type(e).__name__}")
            return False

    def metrics_text(self) -> bytes:
        import ray

        refs = {w.name: w.api.metrics_text() for w in self._answering()}
        texts = {}
        for name, ref in refs.items():
            try:
                texts[name] = ray.get(ref, timeout=PING_TIMEOUT_S)
            except Exception as e:
                log.info("metrics of %s unavailable: %s", name, e)
        return merge_expositions(texts, generate_latest(REGISTRY))

    def _answering(self) -> list[WorkerRef]:
        """Live workers that are not suspect (a stuck one would hold every gather up)."""
        return [w for w in self.pool.everyone(alive_only=True) if w.suspect_since is None]

    async def _gather(self, calls: Iterable[Awaitable[Any]]) -> list[Any]:
        """Each call's result or its exception; one that takes past ``PING_TIMEOUT_S`` (the
        worker hung since it was last judged) is a TimeoutError."""
        return await asyncio.gather(*(asyncio.wait_for(c, PING_TIMEOUT_S) for c in calls), return_exceptions=True)

    async def stats(self) -> dict[str, dict[str, Any]]:
        """Every answering worker's ``stats()`` (pool accounting, counters), by worker name."""
        live = self._answering()
        out = await self._gather(w.api.stats() for w in live)
        return {w.name: s for w, s in zip(live, out) if not isinstance(s, BaseException)}

    def in_flight(self) -> list[dict[str, Any]]:
        """The requests this router streams (GET /debug/kv): rid (worker-side), decode worker,
        tokens streamed, seconds since the last one (or since it was sent there)."""
        now = time.monotonic()
        return [{"rid": s.wire_rid, "worker": s.legs.worker.name, "tokens": s.sent,
                 "silent_s": round(now - s.last_token_at, 3)} for s in list(self.streams.values()) if s.legs is not None]

    def migrations(self) -> list[dict[str, Any]]:
        """Live migrations in flight (GET /debug/kv): rid, from, to, reason, phase, age."""
        return self.migrator.in_flight()

    async def debug_kv(self) -> list[dict[str, Any]]:
        """Every answering worker's KV accounting and invariant verdict (GET /debug/kv)."""
        live = self._answering()
        out = await self._gather(w.api.debug_kv() for w in live)
        return [s if not isinstance(s, BaseException) else
                {"worker": w.name, "role": w.role, "error": f"{type(s).__name__}: {str(s)[:300]}"}
                for w, s in zip(live, out)]

    async def unpin(self, prefix_hash: str, tenant: str | None = None) -> int:
        """End the pins of prefix ``prefix_hash`` on every answering worker (DELETE
        /admin/cache/pins/HASH); the tokens unpinned, summed over them."""
        out = await self._gather(w.api.unpin(prefix_hash, tenant) for w in self._answering())
        return sum(n for n in out if isinstance(n, int))

    async def debug_kill(self, name: str) -> bool:
        """Kill worker ``name``'s actor (POST /debug/kill, with ``debug_endpoints``): the
        supervisor finds it dead, takes it out of rotation and replaces it."""
        import ray

        w = next((w for w in self.pool.everyone(alive_only=True) if w.name == name), None)
        if w is None:
            return False
        ray.kill(w.handle, no_restart=True)
        return True
