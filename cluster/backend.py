"""``RayClusterBackend``: the router's ServingBackend over Ray prefill and decode actors
(the dispatcher routes and admits; this backend streams; cluster/README.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from tandem.cluster.alarms import Died, DiedBeforeServing, Stalled, next_or_alarm
from tandem.cluster.legs import Legs
from tandem.cluster.migration import Migrator
from tandem.cluster.observe import ClusterObservability
from tandem.cluster.stream import Attempt, Failure, Next, RequestStream
from tandem.cluster.supervisor import Supervisor
from tandem.cluster.workers import WorkerPool, WorkerRef
from tandem.core.config import ServeConfig
from tandem.core.messages import GenerateRequest
from tandem.core.types import InvalidRequest, StreamChunk
from tandem.router import metrics as rm
from tandem.router.deferred import DeferredDispatch
from tandem.router.dispatch import Dispatcher, Route
from tandem.router.policies import L3_BLOCK_CREDIT, AdmissionLimits, PolicyConfig

if TYPE_CHECKING:
    from collections.abc import Coroutine


    from tandem.cluster.autoscaler import Autoscaler
    from tandem.cluster.kv_feed import KVEventFeed
    from tandem.cluster.responses import RayResponseStore
    from tandem.cluster.workers import Launching
    from tandem.core.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3


_STALLED = {"decode": Failure.DECODE_STALLED, "prefill": Failure.PREFILL_STALLED,
            "transfer": Failure.TRANSFER_STALLED}


class RayClusterBackend(ClusterObservability):
    """ServingBackend over Ray actors. ``generate``/``abort``/``health`` run on the caller's loop;
    ``metrics_text``/``close`` block."""

    def __init__(self, cfg: ServeConfig, launcher: Launching, tokenizer: Tokenizer, *, started_ray: bool = False,
                 restart: bool = True) -> None:
        self.cfg = cfg
        self.launcher = launcher
        self.started_ray = started_ray
        self.tokenizer = tokenizer
        self.model_name = ""
        self.max_context = 0
        self.speculative: str | None = None
        self.vocab_size = 0
        self.pool = WorkerPool()
        self.router_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        cc = cfg.engine_config.cache
        self.dispatch = Dispatcher(cfg.policy, PolicyConfig(kv_block_size=cc.page_size,
                                                            index_capacity=cc.max_total_tokens,
                                                            rendezvous=launcher.detached,
                                                            # a shared L3 store: a block any worker
                                                            # reported is a (discounted) hit on all
                                                            l3_block_credit=L3_BLOCK_CREDIT if cfg.kv_store != "off" else 0.0),
                                   AdmissionLimits(cfg.admission_max_queue, cfg.admission_max_pending_s))
        self.dispatch.latency.window_s = cfg.planner.window_s
        self.queue = DeferredDispatch(self.dispatch, cfg.dispatch_queue_size, cfg.dispatch_queue_ttl_s,
                                      prefer_sessions=cfg.dispatch_prefer_sessions)
        self.autoscaler: Autoscaler | None = None
        self.feed: KVEventFeed | None = None
        if launcher.kv_events:
            from tandem.cluster.kv_feed import KVEventFeed

            self.feed = KVEventFeed(self.dispatch.state.kv, self.dispatch.lock)
        self.supervisor = Supervisor(self.pool, self.dispatch, launcher, restart=restart, feed=self.feed,
                                     discover=launcher.detached or cfg.planner.enabled,
                                     progress_timeout_s=cfg.progress_timeout_s,
                                     progress_replace_s=cfg.progress_replace_s, router_id=self.router_id,
                                     router_lease_s=cfg.router_lease_s)
        self.streams: dict[str, RequestStream] = {}   # client rid -> its stream (cluster/stream.py)
        self.migrator = Migrator(self.pool, self.dispatch, self._legs, self.supervisor, cfg.migration,
                                 router_id=self.router_id, page_size=cc.page_size)
        self._policy: asyncio.Task[Any] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.response_store: RayResponseStore | None = None

    @property
    def prefills(self) -> list[WorkerRef]:
        return self.pool.prefills

    @property
    def decodes(self) -> list[WorkerRef]:
        return self.pool.decodes

    def _legs(self) -> dict[str, Any]:
        """Worker-side rid -> the current :class:`~tandem.cluster.legs.Legs` of each stream on a decode
        worker now (a fresh map: the Migrator's read-only view of ``streams``)."""
        return {s.legs.req.rid: s.legs for s in list(self.streams.values()) if s.legs is not None}

    @property
    def inflight(self) -> dict[str, WorkerRef]:
        """Worker-side rid -> the decode worker it streams from now, derived from ``streams``."""
        return {rid: legs.worker for rid, legs in self._legs().items()}

    def start(self) -> None:
        """Launch and pair every worker, register them with the dispatcher, start the monitor."""
        infos = self.launcher.bootstrap(self.pool)
        info = infos[-1]
        self.model_name, self.max_context = info["model_name"], int(info["max_context"])
        self.vocab_size = int(info["vocab_size"])
        decode = [i for i in infos if i.get("role") == "decode"] or [info]   # where drafts are made
        self.speculative = decode[0].get("speculative")
        for w, i in zip(self.pool.everyone(), infos):
            self.supervisor.register(w, i)
        if self.launcher.detached:
            from tandem.cluster.responses import RayResponseStore

            self.response_store = RayResponseStore(self.cfg.responses, self.launcher.namespace)
        self.supervisor.start()
        if self.cfg.planner.enabled:
            from tandem.cluster.autoscaler import Autoscaler

            self.autoscaler = Autoscaler(self.cfg.planner, self.pool, self.dispatch, self.launcher,
                                         self.supervisor, mover=self._migrate_off)
            self.autoscaler.start()

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[StreamChunk, None]:
        """Route, then stream from the decode worker. What a failure costs is the request's
        :class:`RequestStream`'s failure table (cluster/stream.py): a worker found dead before anything
        was sent, one re-route without it; one that stops making progress before anything was
        streamed, a re-dispatch from the prompt under a new worker-side id; a decode worker that dies
        or stalls mid-stream, a resume on a live peer after what the client has."""
        self._loop = asyncio.get_running_loop()
        if self._policy is None and self.cfg.migration.active(len(self.pool.decodes)):
            self._policy = asyncio.ensure_future(self.migrator.rebalance(self.cfg.migration))
        t_route = time.time()
        r = await self.queue.route(req)  # waits in the deferred queue; raises Overloaded (-> 429)
        await self.dispatch.wait_ahead(r, self.cfg.transfer_timeout_s)   # a sharer routed first goes first
        if req.trace:
            self._trace_route(req, r, t_route)
        client_rid = req.rid
        dead: WorkerRef | None = None
        excluded: set[int] = set()
        stream = self.streams[client_rid] = RequestStream(
            client_rid, max_failovers=self.cfg.max_failovers, max_attempts=MAX_ATTEMPTS,
            failover_wait_s=self.cfg.failover_wait_s)
        try:
            while True:
                d = self.pool.get(r.decode)
                if d is None and dead is not None and dead.role == "decode":
                    r = await self._await_decode(stream, r, excluded)
                    d = self.pool.get(r.decode)
                if d is None:
                    self.dispatch.release(r)
                    stream.to(Attempt.FAILED)
                    why = "no live decode worker" + (" making progress" if excluded else "")
                    if dead is not None and dead.role == "decode":
                        rm.FAILOVERS.labels("decode", "failed").inc()
                        why = (f"decode worker {dead.name} died before the first token and no live decode "
                               f"worker came within --failover-wait-s {stream.failover_wait_s:g}s to serve it")
                        log.warning("%s: %s", client_rid, why)
                    yield StreamChunk(req.rid, (), "", "abort", len(req.prompt_ids), error=why)
                    return
                try:
                    async for c in self._attempt(req, r, d, stream):
                        yield c
                    return
                except DiedBeforeServing as e:
                    log.warning("%s worker %s died before serving %s; re-routing", e.worker.role,
                                e.worker.name, client_rid)
                    rm.FAILOVERS.labels(e.worker.role, "redispatched").inc()
                    bad = dead = e.worker
                    p = self.pool.get(r.prefill)
                    if dead.role == "decode" and p is not None and p.alive:
                        # its prefill may still hold the KV write to the dead worker: freed there
                        p.api.abort(req.rid, f"decode worker {dead.name} died")
                except Stalled as e:
                    log.warning("%s before %s streamed anything; re-dispatching it from the prompt", e, client_rid)
                    rm.STALL_REDISPATCHES.labels(e.what, "redispatch").inc()
                    bad = e.worker
                stream.rerouted()
                req = dataclasses.replace(req, rid=stream.wire_rid)
                excluded.add(bad.wid)
                r = self.dispatch.reroute(r, excluded)
        finally:
            self.streams.pop(client_rid, None)

    async def _await_decode(self, stream: RequestStream, r: Route, excluded: set[int]) -> Route:
        """``r`` lost its decode worker to a death before serving and no other is live: wait up to
        ``failover_wait_s`` for one (the supervisor's replacement when it was the only one), as a
        mid-stream death does; ``r`` routed there, or ``r`` as it was when none came."""
        stream.to(Attempt.REDISPATCHING)
        if await self.migrator.wait_target(excluded, stream.failover_wait_s) is None:
            return r
        stream.to(Attempt.ROUTED)
        return self.dispatch.reroute(r, excluded)

    async def _attempt(self, req: GenerateRequest, r: Route, d: WorkerRef,
                       stream: RequestStream) -> AsyncGenerator[StreamChunk, None]:
        """Stream ``req`` from ``d`` and each worker it migrates, resumes or fails over to. A failure
        asks ``stream``'s table what comes next: REDISPATCH raises :class:`DiedBeforeServing` or
        :class:`Stalled` (``generate`` routes again), RESUME continues on a peer, FAIL is one error chunk."""
        import ray

        p = self.pool.get(r.prefill)
        legs = stream.legs = Legs.start(self.migrator, req, r, d, p.name if p else None)
        stream.last_token_at = time.monotonic()
        finished, first, rerouted, err = False, True, False, ""
        try:
            try:
                while True:
                    try:
                        c = await next_or_alarm(legs.next_chunk(), self.supervisor.alarms, req.rid,
                                                legs.worker, p if first else None, self.cfg.progress_timeout_s)
                    except (ray.exceptions.RayActorError, Died) as e:
                        c = legs.target_died()
                        if c is None:
                            dead = legs.worker
                            self.supervisor.mark_dead(dead, f"died: {type(e).__name__}")
                            step = stream.on_failure(Failure.DECODE_DIED, dead.name)
                            if step.next is Next.REDISPATCH:
                                finished = rerouted = True
                                raise DiedBeforeServing(dead) from None
                            if step.next is Next.RESUME and await self._failover(stream, legs, dead):
                                continue
                            rm.FAILOVERS.labels("decode", "failed").inc()
                            err = step.why or (f"decode worker {dead.name} died during the request and no live "
                                               f"decode worker came within --failover-wait-s "
                                               f"{stream.failover_wait_s:g}s to resume it")
                            log.warning("%s: %s", req.rid, err)
                            break
                    except Stalled as e:
                        legs.leave_stuck()
                        step = stream.on_failure(_STALLED[e.what], e.worker.name)
                        if step.next is Next.RESUME and e.what == "decode":
                            stream.to(Attempt.RESUMING)
                            if legs.prestop():
                                log.warning("%s; %s resumes on %s", e, req.rid, legs.worker.name)
                                rm.STALL_REDISPATCHES.labels(e.what, "resume").inc()
                                continue
                        if step.next is Next.REDISPATCH:
                            finished = rerouted = True
                            raise
                        rm.STALL_REDISPATCHES.labels(e.what, "failed").inc()
                        err = f"{e.worker.role} worker {e.worker.name} stopped making progress"
                        break
                    if c is None:
                        break
                    if await legs.next_leg(c):
                        stream.to(Attempt.MOVING)
                        continue
                    legs.add(c)
                    finished, lead = c.finish_reason is not None, first
                    if first:
                        self.dispatch.prefill_done(r)
                    first = False
                    self.dispatch.grow(r, len(c.token_ids))
                    if finished and c.error and p is not None:
                        if lead and c.prefill_died:
                            self.supervisor.mark_dead(p, "died (its decode peer's call failed)")
                        else:
                            await self._ping(p, timeout=1.0)
                        if lead and not p.alive and not c.token_ids:
                            if stream.on_failure(Failure.PREFILL_DIED, p.name).next is Next.REDISPATCH:
                                rerouted = True
                                raise DiedBeforeServing(p)
                    if finished:
                        c = dataclasses.replace(c, worker=legs.worker.name)
                        self.dispatch.reused(r, legs.cached)
                    stream.sent_chunk(c, len(legs.ids), legs.last_token_at)
                    yield c
                    if finished:
                        return
                    mv = legs.planned(c)
                    if mv is not None:
                        self._spawn(self.migrator.try_move(mv))
                if not err:
                    err = f"decode worker {legs.worker.name} ended the stream without a finish reason"
            except ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None)
                if first and isinstance(cause, InvalidRequest):
                    raise cause from None
                err = f"decode worker {legs.worker.name} failed: {type(cause or e).__name__}: {str(cause or e)[:300]}"
            except ray.exceptions.RayActorError as e:   # from a migration's call, not the stream itself
                self.supervisor.mark_dead(legs.worker, f"died: {type(e).__name__}")
                if not stream.began and stream.redispatch(Failure.DECODE_DIED, legs.worker.name).next is Next.REDISPATCH:
                    finished = rerouted = True
                    raise DiedBeforeServing(legs.worker) from None
                err = f"decode worker {legs.worker.name} died during the request"
            finished = True
            stream.to(Attempt.FAILED)
            yield StreamChunk(req.rid, (), "", "abort", len(req.prompt_ids), error=err)
        finally:
            legs.close()
            stream.legs = None
            if not rerouted:
                self.dispatch.release(r)
            if not finished:
                legs.worker.api.abort(req.rid, "client went away")
                try:
                    ray.cancel(legs.gen)
                except Exception:
                    pass

    async def _failover(self, stream: RequestStream, legs: Legs, dead: WorkerRef) -> bool:
        """``legs``' decode worker ``dead`` died mid-stream: resume it on a live decode worker after the
        tokens its client has (waiting up to ``failover_wait_s`` for one); whether it resumed. Counted,
        logged once and traced (a ``failover`` span)."""
        t0, at = time.time(), len(legs.ids)
        stream.to(Attempt.RESUMING)
        if not await legs.failover(dead, stream.failover_wait_s):
            return False
        rm.FAILOVERS.labels("decode", "resumed").inc()
        self._report_failover(stream, legs, dead, t0, at)
        return True

    def _migrate_off(self, w: WorkerRef) -> None:
        """The planner drains ``w`` (from its thread): its live requests migrate away on the
        serving loop (none were ever served: nothing to move). Off with ``--migration off``."""
        if self._loop is None or self.cfg.migration.policy == "off" or self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.migrator.drain(w.name), self._loop)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def migrate(self, rid: str, to: str | None = None) -> str:
        """Move running ``rid`` to decode worker ``to`` (default: the least loaded other one);
        returns its name (cluster/migration.py)."""
        return await self.migrator.migrate(self._wire(rid), to)

    def _wire(self, rid: str) -> str:
        """Client request ``rid``'s worker-side id now (its stream's current attempt's)."""
        s = self.streams.get(rid)
        return s.wire_rid if s is not None else rid

    async def drain(self, name: str, stop: bool = False) -> dict[str, Any]:
        """Move every live request off decode worker ``name`` (POST /admin/drain)."""
        return await self.migrator.drain(name, stop=stop)

    async def undrain(self, name: str) -> dict[str, Any]:
        """Decode worker ``name`` back in rotation after a drain without stop (POST /admin/undrain)."""
        return await self.migrator.undrain(name)

    async def abort(self, rid: str) -> None:
        rid = self._wire(rid)
        d = self.inflight.get(rid)
        if d is None or not d.alive:
            return
        try:
            await d.api.abort(rid, "aborted by the client")
        except Exception as e:
            log.info("abort of %s on %s: %s", rid, d.name, e)

    def close(self) -> None:
        """Stop watching and the KV feed; kill every worker unless they outlive this router
        (detached workers: a router that starts later adopts them); shut Ray down if we started it."""
        import ray

        if self.autoscaler is not None:
            self.autoscaler.stop()
        self.supervisor.shutdown(kill=not self.launcher.detached or self.started_ray)
        if self.feed is not None:
            self.feed.close()
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
