"""Disaggregated serving on Ray: launch prefill and decode actors, wire their NIXL agents, serve.

``launch_disaggregated(cfg) -> RayClusterBackend`` (the router's ServingBackend):

1. ``ray.init`` (a fresh local instance, or ``cfg.ray_address``); actors get ``num_gpus=1`` each
   when the cluster has a GPU per worker, else an even share of the CPUs (torch threads follow).
2. ``cfg.prefill`` PrefillActors and ``cfg.decode`` DecodeActors with ``cfg.engine_config``
   (decode's KV pool is ``cfg.decode_max_total_tokens`` when set).
3. Bootstrap: every pair exchanges :class:`Handshake` bytes through Ray calls (NIXL metadata and
   the KV region's layout); each decode actor also gets the prefill actor's handle.
4. Per request: ``cfg.policy`` (router/policies.py: session, cache_aware, least_load,
   round_robin, ...) picks a prefill and a decode worker from the driver's own dispatch records
   (requests and tokens in flight per worker); the decode actor's streaming ``generate`` drives
   everything else.

Admission: when every live prefill worker is past ``cfg.admission_max_queue`` requests (or
``admission_max_pending_s``), ``generate`` raises :class:`Overloaded` (the front door's 429).
A decode worker found dead before its first chunk costs one re-route; a prefill worker that dies
before its write is replaced by another one by the decode worker itself (same reserved pages).
KV events (``cfg.kv_events``, default with the kv_events policy): prefill workers publish their
cache's events over ZMQ; cluster/kv_feed.py applies them to the router's exact block index.

Health: a monitor thread pings every worker each ``MONITOR_PERIOD_S``; a dead worker is taken
out of rotation at once, its peers forget its NIXL agent, and (``restart=True``) a replacement
with a fresh name is launched and bootstrapped. With no live prefill worker, decode prefills
locally (counted on /metrics as ``tandem_decode_prefill_total{path="local"}``; /health says
``degraded``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from prometheus_client import REGISTRY, generate_latest

from tandem.cluster.metrics import merge_expositions
from tandem.core.config import EngineConfig, ServeConfig
from tandem.core.messages import GenerateRequest
from tandem.core.types import InvalidRequest, Overloaded, StreamChunk, TandemError
from tandem.router import metrics as rm
from tandem.router.policies import AdmissionLimits, PolicyConfig, RouterState, admit, choose, retry_after_s
from tandem.router.view import ClusterView, RouteRequest, WorkerView

log = logging.getLogger(__name__)

MONITOR_PERIOD_S = 1.0
PING_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 600.0


_worker_ids = itertools.count()


@dataclass(eq=False)
class WorkerRef:
    """One actor as the driver sees it. ``in_flight`` / ``tokens`` are the driver's own dispatch
    records (what the routing policy sees as load): prefill counts requests not yet past their
    first token and their prompt tokens; decode counts unfinished requests and their KV tokens."""

    name: str
    role: str            # "prefill" | "decode"
    slot: int            # which of cfg.prefill / cfg.decode it fills (kept across restarts)
    handle: object
    alive: bool = True
    error: str = ""
    wid: int = field(default_factory=lambda: next(_worker_ids))   # the policies' worker id
    in_flight: int = 0
    tokens: int = 0


def load_tokenizer(model: str):
    """The model's tokenizer without its weights (the driver tokenizes; workers hold weights)."""
    from tandem.core.tokenizer import Tokenizer
    from tandem.engine.loader import smollm2_path

    path = smollm2_path() if model == "smollm2" else os.path.expanduser(model)
    if os.path.isdir(path):
        return Tokenizer.from_hf_dir(path)
    return Tokenizer.from_gguf(path)


def decode_engine_config(cfg: ServeConfig) -> EngineConfig:
    ec = cfg.engine_config
    if cfg.decode_max_total_tokens is None:
        return ec
    d = ec.model_dump()
    d["cache"]["max_total_tokens"] = cfg.decode_max_total_tokens
    return EngineConfig.model_validate(d)


def launch_disaggregated(cfg: ServeConfig, *, restart: bool = True, loaded=None,
                         share_weights: bool | None = None) -> "RayClusterBackend":
    """Start (or join) Ray, launch and bootstrap the workers; returns the serving backend.

    ``loaded``: a LoadedModel (CPU) to hand every worker through the object store instead of
    each loading the model itself. ``share_weights`` (default: when Ray runs here, without GPUs,
    with more than one worker) makes the driver load the model once for that purpose.
    """
    import ray

    started = False
    if not ray.is_initialized():
        if cfg.ray_address:
            ray.init(address=cfg.ray_address, include_dashboard=False, log_to_driver=True)
        else:
            ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False,
                     log_to_driver=True)
            started = True
    if loaded is None and share_weights is None:
        share_weights = (started and cfg.prefill + cfg.decode > 1 and cfg.engine_config.device != "cuda"
                         and not ray.cluster_resources().get("GPU", 0))
    if loaded is None and share_weights:
        from tandem.engine.loader import load_model

        ec = cfg.engine_config
        loaded = load_model(ec.model, device="cpu", dtype=ec.dtype, sliding_window=ec.sliding_window,
                            context_length=ec.context_length)
    weights = ray.put(loaded) if loaded is not None else None
    del loaded
    backend = RayClusterBackend(cfg, started_ray=started, restart=restart, weights=weights)
    try:
        backend.start()
    except BaseException:
        backend.close()
        raise
    return backend


class RayClusterBackend:
    """ServingBackend over Ray actors. ``generate``/``abort``/``health`` run on the caller's
    asyncio loop; ``metrics_text``/``close`` block (the front door calls metrics off the loop)."""

    def __init__(self, cfg: ServeConfig, *, started_ray: bool = False, restart: bool = True,
                 weights=None):
        self.cfg = cfg
        self.weights = weights     # ObjectRef of a shared LoadedModel, or None (workers load it)
        self.started_ray = started_ray
        self.restart = restart
        self.tokenizer = load_tokenizer(cfg.engine_config.model)
        self.model_name = ""
        self.max_context = 0
        self.vocab_size = 0
        self.prefills: list[WorkerRef] = []
        self.decodes: list[WorkerRef] = []
        self._lock = threading.RLock()       # guards the worker lists (monitor thread vs. loop)
        cc = cfg.engine_config.cache   # the approximate prefix index holds at most a cache's worth
        self._router = RouterState(PolicyConfig(kv_block_size=cc.page_size, index_capacity=cc.max_total_tokens))
        self.limits = AdmissionLimits(cfg.admission_max_queue, cfg.admission_max_pending_s)
        self.kv_events = cfg.kv_events if cfg.kv_events is not None else cfg.policy == "kv_events"
        self._feed = None      # cluster/kv_feed.KVEventFeed when kv_events
        self._capacity = {"prefill": cfg.engine_config.cache.max_total_tokens,
                          "decode": decode_engine_config(cfg).cache.max_total_tokens}
        self._incarnation = itertools.count(1)
        self._inflight: dict[str, WorkerRef] = {}   # rid -> its decode worker
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._restarting: set[tuple[str, int]] = set()
        self._pair_lock = threading.Lock()
        self.restarts = 0

    # ------------------------------------------------------------------ launch
    def _resources(self) -> dict:
        import ray

        n = self.cfg.prefill + self.cfg.decode
        res = ray.cluster_resources()
        if res.get("GPU", 0) >= n:
            return {"num_gpus": 1, "num_cpus": 1}
        share = res.get("CPU", 1.0) / max(n, 1)
        return {"num_gpus": 0, "num_cpus": max(0.1, min(share, 64.0))}

    def _spawn(self, role: str, slot: int, name: str) -> WorkerRef:
        from tandem.decode.actor import DecodeActor
        from tandem.prefill.actor import PrefillActor

        opts = self._resources()
        import ray

        # On a KubeRay cluster each worker group offers a custom resource named after its role
        # (k8s/base/raycluster.yaml): ask for it so prefill and decode actors land on their group.
        if ray.cluster_resources().get(role, 0) >= 1:
            opts = {**opts, "resources": {role: 1}}
        if role == "prefill":
            h = PrefillActor.options(**opts).remote(
                name, self.cfg.engine_config.model_dump(), self.cfg.transfer_timeout_s, self.weights,
                self.kv_events)
        else:
            h = DecodeActor.options(**opts).remote(
                name, decode_engine_config(self.cfg).model_dump(), self.cfg.transfer_timeout_s,
                self.cfg.local_prefill_threshold, self.weights)
        return WorkerRef(name, role, slot, h)

    def start(self) -> None:
        import ray

        self.prefills = [self._spawn("prefill", i, f"prefill-{i}") for i in range(self.cfg.prefill)]
        self.decodes = [self._spawn("decode", i, f"decode-{i}") for i in range(self.cfg.decode)]
        everyone = self.prefills + self.decodes
        try:
            infos = ray.get([w.handle.info.remote() for w in everyone], timeout=STARTUP_TIMEOUT_S)
        except ray.exceptions.RayTaskError as e:
            raise TandemError(f"a worker failed to start: {e.cause if hasattr(e, 'cause') else e}") from None
        info = infos[-1]
        self.model_name, self.max_context = info["model_name"], int(info["max_context"])
        self.vocab_size = int(info["vocab_size"])
        pages = {i["page_size"] for i in infos}
        if len(pages) != 1:
            raise TandemError(f"workers disagree on page_size: {sorted(pages)}")
        for p in self.prefills:
            for d in self.decodes:
                self._pair(p, d)
        if self.kv_events:
            from tandem.cluster.kv_feed import KVEventFeed

            self._feed = KVEventFeed(self._router.kv, self._lock)
            for w, i in zip(everyone, infos):
                if i.get("kv_events"):
                    self._feed.add(w.wid, i["kv_events"])
        for w in everyone:
            rm.WORKER_LOAD.labels(w.name, w.role).set(0)
        self._monitor = threading.Thread(target=self._watch, name="tandem-monitor", daemon=True)
        self._monitor.start()

    def _pair(self, p: WorkerRef, d: WorkerRef) -> None:
        """Exchange handshakes: prefill learns where to WRITE, decode whom to expect (and ask)."""
        import ray

        hp, hd = ray.get([p.handle.handshake.remote(), d.handle.handshake.remote()], timeout=60)
        ray.get([p.handle.add_peer.remote(hd), d.handle.add_prefill.remote(hp, p.handle)], timeout=60)

    # ------------------------------------------------------------------ routing
    def _alive(self, role: str) -> list[WorkerRef]:
        with self._lock:
            return [w for w in (self.prefills if role == "prefill" else self.decodes) if w.alive]

    def _route(self, req: GenerateRequest, exclude: WorkerRef | None = None
               ) -> tuple[WorkerRef | None, WorkerRef | None]:
        """(decode, prefill) by ``cfg.policy`` (router/policies.py) over the driver's records.
        No live prefill worker: (least-loaded decode, None) and decode prefills locally. Raises
        :class:`Overloaded` when every live prefill worker is past ``self.limits``."""
        t0 = time.perf_counter()
        try:
            return self._route_locked(req, exclude)
        finally:
            rm.ROUTING_DECISION.observe(time.perf_counter() - t0)

    def _route_locked(self, req: GenerateRequest, exclude: WorkerRef | None):
        with self._lock:
            everyone = self.prefills + self.decodes
            view = ClusterView.of(
                [WorkerView(w.wid, w.role, w.alive, queue_len=w.in_flight if w.role == "prefill" else 0,
                            in_flight=w.in_flight, running_tokens=w.tokens,
                            capacity_tokens=self._capacity[w.role]) for w in everyone],
                now=time.monotonic())
            rr = RouteRequest(req.rid, req.prompt_ids, len(req.prompt_ids), session_id=req.session_id,
                              max_tokens=req.params.max_tokens)
            if view.alive_prefill() and not admit(view, self.limits):
                wait = retry_after_s(view, self.limits)
                raise Overloaded(f"all {len(view.alive_prefill())} prefill workers are at their admission "
                                 f"limits (queue {self.limits.max_queue}, {self.limits.max_pending_s:g}s "
                                 f"predicted wait); retry in {wait}s", wait)
            dec = choose(view, rr, self._router, self.cfg.policy)
            by_id = {w.wid: w for w in everyone if w.alive and w is not exclude}
            d, p = by_id.get(dec.decode_worker), by_id.get(dec.prefill_worker)
            if d is None:
                live = [w for w in self.decodes if w.alive and w is not exclude]
                d = min(live, key=lambda w: (w.tokens, w.in_flight)) if live else None
            return d, p

    def _charge(self, w: WorkerRef | None, requests: int, tokens: int) -> None:
        if w is not None:
            with self._lock:
                w.in_flight += requests
                w.tokens += tokens
                if requests:
                    rm.WORKER_LOAD.labels(w.name, w.role).set(w.in_flight)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        """Route, then stream from the decode worker. A decode worker found dead before it sent
        anything (killed, not yet noticed by the monitor) costs one re-route to another."""
        n = len(req.prompt_ids)
        d, p = self._route(req)     # raises Overloaded (-> 429) before anything is charged
        for attempt in range(2):
            if d is None:
                yield StreamChunk(req.rid, (), "", "abort", n, error="no live decode worker")
                return
            died_early = []
            async for c in self._attempt(req, d, p, died_early, retry=attempt == 0):
                yield c
            if not died_early:
                return
            log.warning("decode worker %s died before serving %s; re-routing", d.name, req.rid)
            d, p = self._route(req, exclude=d)

    async def _attempt(self, req: GenerateRequest, d: WorkerRef, p: WorkerRef | None,
                       died_early: list, retry: bool) -> AsyncIterator[StreamChunk]:
        import ray

        n = len(req.prompt_ids)
        self._charge(d, 1, n)
        self._charge(p, 1, n)
        held = {"decode": n, "prefill": p}    # what to give back when the request ends
        gen = d.handle.generate.options(num_returns="streaming").remote(req.to_wire(), p.name if p else None)
        self._inflight[req.rid] = d
        finished, first = False, True
        try:
            try:
                async for ref in gen:
                    c = await ref
                    finished = c.finish_reason is not None
                    if first and held["prefill"] is not None:   # past its first token: prefill is done
                        self._charge(held["prefill"], -1, -n)
                        held["prefill"] = None
                    first = False
                    self._charge(d, 0, len(c.token_ids))
                    held["decode"] += len(c.token_ids)
                    if finished and c.error and p is not None:
                        await self._ping(p, timeout=1.0)  # a dead prefill leaves rotation now
                    if finished:
                        c = dataclasses.replace(c, worker=d.name)
                    yield c
                    if finished:
                        return
            except ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None)
                if first and isinstance(cause, InvalidRequest):
                    raise cause from None
                err = f"decode worker {d.name} failed: {type(cause or e).__name__}: {str(cause or e)[:300]}"
            except ray.exceptions.RayActorError as e:
                self._mark_dead(d, f"died: {type(e).__name__}")
                if first and retry:
                    finished = True      # nothing to abort: the caller re-routes
                    died_early.append(d)
                    return
                err = f"decode worker {d.name} died during the request"
            else:
                err = f"decode worker {d.name} ended the stream without a finish reason"
            finished = True
            yield StreamChunk(req.rid, (), "", "abort", n, error=err)
        finally:
            self._inflight.pop(req.rid, None)
            self._charge(d, -1, -held["decode"])
            if held["prefill"] is not None:
                self._charge(held["prefill"], -1, -n)
            if not finished:  # the caller went away: stop the request on its decode worker
                d.handle.abort.remote(req.rid, "client went away")
                try:
                    ray.cancel(gen)
                except Exception:  # already finished or the worker is gone
                    pass

    async def abort(self, rid: str) -> None:
        d = self._inflight.get(rid)
        if d is None or not d.alive:
            return
        try:
            await d.handle.abort.remote(rid, "aborted by the client")
        except Exception as e:  # a dead worker has nothing left to abort
            log.info("abort of %s on %s: %s", rid, d.name, e)

    # ------------------------------------------------------------------ health
    async def health(self) -> dict:
        with self._lock:
            everyone = list(self.prefills + self.decodes)
        results = await asyncio.gather(*(self._ping(w) for w in everyone))
        workers = {w.name: {"role": w.role, "alive": ok, **({"error": w.error} if w.error else {})}
                   for w, ok in zip(everyone, results)}
        live_d = [w for w, ok in zip(everyone, results) if ok and w.role == "decode"]
        live_p = [w for w, ok in zip(everyone, results) if ok and w.role == "prefill"]
        degraded = len(live_d) < self.cfg.decode or len(live_p) < self.cfg.prefill
        return {"status": "ok" if live_d else "error", "mode": "disaggregated", "model": self.model_name,
                "degraded": degraded, "prefill_alive": len(live_p), "decode_alive": len(live_d),
                "restarts": self.restarts, "workers": workers}

    async def _ping(self, w: WorkerRef, timeout: float = PING_TIMEOUT_S) -> bool:
        if not w.alive:
            return False
        try:
            await asyncio.wait_for(w.handle.ping.remote(), timeout)
            return True
        except asyncio.TimeoutError:
            return False   # busy or hung: reported, not declared dead
        except Exception as e:
            self._mark_dead(w, f"ping failed: {type(e).__name__}")
            return False

    def _mark_dead(self, w: WorkerRef, why: str) -> None:
        """Out of rotation now; peers forget its agent (in the monitor thread, off the loop)."""
        with self._lock:
            if not w.alive:
                return
            w.alive, w.error = False, why
            self._router.forget_worker(w.wid)
        if self._feed is not None:
            self._feed.remove(w.wid)
        log.warning("%s worker %s is dead (%s)", w.role, w.name, why)
        threading.Thread(target=self._forget, args=(w,), daemon=True).start()

    def _forget(self, w: WorkerRef) -> None:
        import ray

        peers = self._alive("decode" if w.role == "prefill" else "prefill")
        calls = [(p.handle.remove_prefill if w.role == "prefill" else p.handle.remove_peer).remote(w.name)
                 for p in peers]
        try:
            ray.get(calls, timeout=30)
        except Exception as e:  # a peer died too: the monitor finds it
            log.info("forgetting %s: %s", w.name, e)
        try:
            ray.kill(w.handle)
        except Exception:
            pass

    def _watch(self) -> None:
        """Monitor thread: find dead workers between requests; relaunch them when asked to."""
        import ray

        while not self._stop.wait(MONITOR_PERIOD_S):
            with self._lock:
                everyone = [w for w in self.prefills + self.decodes if w.alive]
            try:
                refs = {w: w.handle.ping.remote() for w in everyone}
            except BaseException:  # noqa: BLE001 - Ray shut down under us
                return
            for w, ref in refs.items():
                try:
                    ray.get(ref, timeout=PING_TIMEOUT_S)
                except ray.exceptions.GetTimeoutError:
                    pass
                except Exception as e:
                    if self._stop.is_set():
                        return
                    self._mark_dead(w, f"ping failed: {type(e).__name__}")
            if self.restart and not self._stop.is_set():
                self._replace_dead()

    def _replace_dead(self) -> None:
        """Relaunch each dead worker in its own thread (model loads overlap)."""
        with self._lock:
            dead = [w for w in self.prefills + self.decodes
                    if not w.alive and (w.role, w.slot) not in self._restarting]
            self._restarting |= {(w.role, w.slot) for w in dead}
        for w in dead:
            threading.Thread(target=self._replace, args=(w,), name=f"tandem-restart-{w.name}",
                             daemon=True).start()

    def _replace(self, w: WorkerRef) -> None:
        import ray

        name = f"{w.role}-{w.slot}-r{next(self._incarnation)}"
        new = None
        try:
            new = self._spawn(w.role, w.slot, name)
            info = ray.get(new.handle.info.remote(), timeout=STARTUP_TIMEOUT_S)   # loads overlap
            with self._pair_lock:   # pair and register as one step, so two relaunches meet
                for other in self._alive("decode" if w.role == "prefill" else "prefill"):
                    if w.role == "prefill":
                        self._pair(new, other)
                    else:
                        self._pair(other, new)
                with self._lock:
                    ws = self.prefills if w.role == "prefill" else self.decodes
                    stale = self._stop.is_set() or w not in ws
                    if not stale:
                        ws[ws.index(w)] = new
                        self.restarts += 1
                        if self._feed is not None and info.get("kv_events"):
                            self._feed.add(new.wid, info["kv_events"])
                        try:
                            rm.WORKER_LOAD.remove(w.name, w.role)
                        except KeyError:
                            pass
                        rm.WORKER_LOAD.labels(new.name, new.role).set(0)
                    self._restarting.discard((w.role, w.slot))
        except BaseException as e:  # noqa: BLE001 - also Ray's SystemExit at shutdown; retried next round
            if not self._stop.is_set():
                log.error("relaunching %s failed: %s", w.name, e)
            with self._lock:
                self._restarting.discard((w.role, w.slot))
            if new is not None and ray.is_initialized():   # ray.kill would start a new Ray
                try:
                    ray.kill(new.handle)
                except BaseException:  # noqa: BLE001 - Ray is already down
                    pass
            return
        if stale:   # closing meanwhile: do not leave the new actor behind
            if ray.is_initialized():
                ray.kill(new.handle)
            return
        log.warning("%s replaced by %s", w.name, name)

    # ------------------------------------------------------------------ observability
    def metrics_text(self) -> bytes:
        import ray

        with self._lock:
            live = [w for w in self.prefills + self.decodes if w.alive]
        refs = {w.name: w.handle.metrics_text.remote() for w in live}
        texts = {}
        for name, ref in refs.items():
            try:
                texts[name] = ray.get(ref, timeout=PING_TIMEOUT_S)
            except Exception as e:
                log.info("metrics of %s unavailable: %s", name, e)
        return merge_expositions(texts, generate_latest(REGISTRY))

    async def stats(self) -> dict[str, dict]:
        """Every live worker's ``stats()`` (pool accounting, counters), by worker name."""
        with self._lock:
            live = [w for w in self.prefills + self.decodes if w.alive]
        out = await asyncio.gather(*(w.handle.stats.remote() for w in live), return_exceptions=True)
        return {w.name: s for w, s in zip(live, out) if not isinstance(s, BaseException)}

    def close(self) -> None:
        import ray

        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=PING_TIMEOUT_S + MONITOR_PERIOD_S)
        if self._feed is not None:
            self._feed.close()
        with self._lock:
            everyone = self.prefills + self.decodes
        for w in everyone:
            try:
                ray.kill(w.handle)
            except Exception:
                pass
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
