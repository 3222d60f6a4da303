"""Live migration in the cluster: a running request moves from one decode worker to another.

The router's side; the workers' is decode/worker.py (``freeze``, ``migrate_out``, a resumed
``generate``). :class:`Migrator` (one per backend, on the router's event loop), one
:class:`Move` per request in flight (GET /debug/kv lists them):

    migrate(rid, to, reason)  the target: ``to``, else the live, non-draining decode worker with
                           the fewest KV tokens that is not the request's. Pre-copy (``precopy``):
                           while the source keeps decoding, the target takes the request's KV into
                           its own cache: a one-token warm request (``{rid}~precopy``: greedy, no
                           grammar, never streamed to a client nor routed) of the prompt plus the
                           tokens generated so far (``precopy_generated``; cut to whole pages, the
                           cache shares nothing less) through the prefill worker that holds the
                           prompt (it computes only the generated part, then hands the pages to
                           the target as any prefill does), or computed on the target where there
                           is none. A second round (``{rid}~precopy2``) when the source generated
                           ``precopy_again_pages`` more whole pages meanwhile. Then the stop: the
                           request is frozen on its worker (its stream there ends "migrated", its
                           KV held)
    next_leg(...)          the backend's stream loop met "migrated": the request continues on the
                           target, resumed from the tokens and text the client already has; the
                           target matches its own cache first (the pre-copied pages) and copies
                           over NIXL only the KV it lacks, from the source (the tail generated
                           since the last round)
    fall_back(...)         the target failed or died before its first chunk: the source resumes
                           it (its KV went to the source's cache: a full prefix hit)
    recompute(...)         the source died mid-copy: the target recomputes what it lacks
    prestop(...)           the source stopped making progress (cluster/supervisor.py's deadline):
                           the request resumes on a peer, which recomputes its KV
    finish(rid, outcome)   the move ended: ok | failed | aborted (the metric's labels)
    drain(name)            no new requests for the worker; every live request on it migrates
                           away; with ``stop``, it is then stopped and relaunched (a rolling
                           restart), else it stays out of rotation (retiring: not relaunched)
                           until ``undrain(name)``
    rebalance(cfg)         the ``balance`` policy: every ``cfg.period_s`` one move that
                           router/rebalance.py plans (pressure or rebalance)

Fail closed: until the stop, a failed pre-copy leaves the request where it is (a pre-copy round
that fails or outlasts ``precopy_timeout_s``, all rounds together, only leaves more for the stop
to copy; what it did compute stays in the target's cache, evictable); after it, the
request continues on the target, on the source, or recomputed, and a client that went away
frees both sides. The client's stream never sees "migrated": the legs are spliced, so no token
is repeated or missing (the resumed request starts after what was streamed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from tandem.cluster.workers import DECODE, WorkerPool, WorkerRef
from tandem.core import tracing
from tandem.core.config import MigrationConfig
from tandem.core.messages import GenerateRequest, Resume
from tandem.core.types import SamplingParams, StreamChunk
from tandem.router import metrics as rm
from tandem.router.dispatch import Dispatcher, Route
from tandem.router.rebalance import plan_moves

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05


@dataclasses.dataclass
class Move:
    """One request on its way from ``source`` to ``target``. ``phase``: precopy (the source still
    decodes), frozen (its stream there ended), copying (the new leg started)."""

    rid: str
    source: WorkerRef
    target: WorkerRef
    reason: str
    started: float = dataclasses.field(default_factory=time.monotonic)
    phase: str = "precopy"
    precopied: int = 0       # tokens (prompt, then generated) the target took into its cache before the stop

    def view(self) -> dict:
        return {"rid": self.rid, "from": self.source.name, "to": self.target.name, "reason": self.reason,
                "phase": self.phase, "precopied_tokens": self.precopied,
                "age_s": round(time.monotonic() - self.started, 3)}


class Migrator:
    def __init__(self, pool: WorkerPool, dispatch: Dispatcher, inflight: dict[str, WorkerRef],
                 supervisor=None, cfg: MigrationConfig | None = None, router_id: str | None = None,
                 page_size: int = 16):
        """``router_id``: named on every leg it starts (the workers' lease on this router);
        ``page_size``: the workers' KV page (a pre-copy takes whole pages)."""
        self.pool, self.dispatch, self._inflight, self.supervisor = pool, dispatch, inflight, supervisor
        self.router_id = router_id
        self.page_size = page_size
        self.cfg = cfg or MigrationConfig()
        self.moves: dict[str, Move] = {}
        self.live: dict[str, tuple[GenerateRequest, Route]] = {}   # rid -> (request, route): the backend's
        self.generated: dict[str, list[int]] = {}   # rid -> the token ids its client has (the backend's list)
        # precopies: moves with a pre-copy that landed; precopy_rounds: rounds that landed;
        # precopied_tokens: their tokens (the last landed round's, per move)
        self.counts = {"migrations": 0, "fallbacks": 0, "recomputed": 0, "refused": 0,
                       "precopies": 0, "precopy_rounds": 0, "precopied_tokens": 0,
                       "pressure": 0, "rebalance": 0, "prestop": 0}

    def target(self, exclude: set[int]) -> WorkerRef | None:
        """The live, non-draining decode worker with the fewest KV tokens, not in ``exclude``."""
        snaps = self.dispatch.snapshots()
        live = [v for v in self.dispatch.view().decode if v.alive and v.worker_id not in exclude
                and not (snaps.get(v.worker_id) is not None and snaps[v.worker_id].draining)]
        if not live:
            return None
        return self.pool.get(min(live, key=lambda v: (v.running_tokens, v.in_flight)).worker_id)

    async def migrate(self, rid: str, to: str | None = None, reason: str = "admin") -> str:
        """Move ``rid`` to ``to`` (a decode worker's name) or the best target; returns its name.
        LookupError: no such request or no target; ValueError: it is not decoding, already
        moving, or the target failed during the pre-copy (nothing moved: it decodes on)."""
        d = self._inflight.get(rid)
        if d is None:
            raise LookupError(f"no request {rid} in flight on this router")
        if rid in self.moves:
            raise ValueError(f"request {rid} is already moving to {self.moves[rid].target.name}")
        t = self.pool.named(to) if to else self.target({d.wid})
        if t is None or t.role != DECODE or not t.alive or t.wid == d.wid:
            raise LookupError(f"no decode worker to move {rid} to" + (f" (asked for {to!r})" if to else ""))
        m = self.moves[rid] = Move(rid, d, t, reason)
        try:
            if self.cfg.precopy:
                await self._precopy(m)
            if self._inflight.get(rid) is not d:
                raise ValueError(f"request {rid} ended or moved during its pre-copy")
            await d.handle.freeze.remote(rid)
        except Exception as e:
            import ray

            if isinstance(e, ray.exceptions.RayActorError):   # the target died during the pre-copy
                if self.supervisor is not None:
                    self.supervisor.mark_dead(t, "died during a migration's pre-copy")
                self.finish(rid, "failed")
                raise ValueError(f"decode worker {t.name} died during the pre-copy of {rid}; "
                                 f"it decodes on {d.name}") from None
            self.moves.pop(rid, None)
            self.counts["refused"] += 1
            cause = getattr(e, "cause", e)
            raise (cause if isinstance(cause, (ValueError, LookupError)) else ValueError(str(cause)[:300])) from None
        m.phase = "frozen"
        self.counts["migrations"] += 1
        return t.name

    async def _precopy(self, m: Move) -> None:
        """The request's KV into the target's cache while the source keeps decoding (see the
        module's docstring): round 1 takes :meth:`warm_ids` now; round 2 the same again if the
        source generated ``precopy_again_pages`` more whole pages meanwhile. All rounds within
        ``precopy_timeout_s``; a round that fails or times out ends the pre-copy and only makes the
        stop copy more (RayActorError: the target died, and the move is given up)."""
        req, r = self.live.get(m.rid, (None, None))
        if req is None:
            return
        end = time.monotonic() + self.cfg.precopy_timeout_s
        ids = self.warm_ids(req.prompt_ids, self.generated.get(m.rid, ()))
        if len(ids) < self.cfg.precopy_min_tokens or not await self._warm(m, req, r, ids, "precopy", end):
            return
        if not self.cfg.precopy_generated or not self.cfg.precopy_again_pages:
            return
        again = self.warm_ids(req.prompt_ids, self.generated.get(m.rid, ()))
        if len(again) - len(ids) >= self.cfg.precopy_again_pages * self.page_size:
            await self._warm(m, req, r, again, "precopy2", end)

    def warm_ids(self, prompt: tuple[int, ...], out) -> tuple[int, ...]:
        """What a pre-copy round takes: the prompt, and with ``precopy_generated`` the generated
        tokens ``out`` (what the client has) up to the last whole page of the two together."""
        n = (len(prompt) + len(out)) // self.page_size * self.page_size
        if not self.cfg.precopy_generated or n <= len(prompt):
            return tuple(prompt)
        return tuple(prompt) + tuple(out[:n - len(prompt)])

    async def _warm(self, m: Move, req: GenerateRequest, r: Route, ids: tuple[int, ...], tag: str,
                    end: float) -> bool:
        """One pre-copy round: a one-token request of ``ids`` on the target (``{rid}~{tag}``: greedy,
        no grammar or seed, the request's session for its cache's eviction order), through the
        route's prefill worker while it lives. Whether it landed by ``end``."""
        import ray

        left = end - time.monotonic()
        if left <= 0:
            return False
        p = self.pool.get(r.prefill)
        warm = GenerateRequest(f"{m.rid}~{tag}", ids, SamplingParams(max_tokens=1, ignore_eos=True),
                               session_id=req.session_id, tenant=req.tenant, cache_salt=req.cache_salt,
                               trace=req.trace)
        gen = m.target.handle.generate.options(num_returns="streaming").remote(
            warm.to_wire(), p.name if p is not None and p.alive else None, self.router_id)

        async def consume() -> StreamChunk | None:
            last = None
            async for ref in gen:
                last = await ref
            return last

        try:
            last = await asyncio.wait_for(consume(), left)
        except ray.exceptions.RayActorError:
            raise
        except Exception as e:  # noqa: BLE001 - a slow or failed pre-copy: the stop copies the rest
            log.info("pre-copy %s of %s to %s gave up: %s", tag, m.rid, m.target.name, type(e).__name__)
            try:
                ray.cancel(gen)
            except Exception:  # already ended
                pass
            return False
        if last is None or last.error:
            return False
        if not m.precopied:
            self.counts["precopies"] += 1
        self.counts["precopy_rounds"] += 1
        self.counts["precopied_tokens"] += len(ids) - m.precopied
        m.precopied = len(ids)
        return True

    async def next_leg(self, req: GenerateRequest, r: Route, source: WorkerRef, sent: Resume):
        """The request's stream on its new worker (resumed after ``sent``), and that worker."""
        m = self.moves.get(req.rid)
        if m is None:   # frozen by another router's move: the best peer
            m = self.moves[req.rid] = Move(req.rid, source, source, "admin")
        t = m.target if m.target.alive and m.target is not source else self.target({source.wid})
        m.target, m.phase = t or source, "copying"
        if t is None:   # no peer left: it resumes where it was, from its own cache
            await source.handle.release_frozen.remote(req.rid)
            return self._start(req, r, source, sent, None), source
        return self._start(req, r, t, sent, source.name), t

    async def fall_back(self, req: GenerateRequest, r: Route, source: WorkerRef, sent: Resume):
        """Back to ``source``: its frozen KV goes to its cache first, then it resumes there."""
        self.counts["fallbacks"] += 1
        await source.handle.release_frozen.remote(req.rid)
        return self._start(req, r, source, sent, None), source

    def recompute(self, req: GenerateRequest, r: Route, target: WorkerRef, sent: Resume):
        """The source died mid-copy: ``target`` recomputes the KV it lacks (its cache first)."""
        self.counts["recomputed"] += 1
        return self._start(req, r, target, sent, None), target

    def prestop(self, req: GenerateRequest, r: Route, stuck: WorkerRef, sent: Resume):
        """``stuck`` (a decode worker making no progress) cannot hand over its KV: the request
        resumes on the best peer after what the client has (``sent``), which recomputes the KV
        (its own cache first). (stream, worker), or None when no peer is in rotation."""
        t = self.target({stuck.wid})
        if t is None:
            return None
        self.moves.pop(req.rid, None)   # a move that was under way is over: its source is stuck
        m = self.moves[req.rid] = Move(req.rid, stuck, t, "prestop", phase="copying")
        self.counts["prestop"] += 1
        return self._start(req, r, t, sent, None), m.target

    def finish(self, rid: str, outcome: str, downtime_s: float | None = None) -> None:
        """``rid``'s move ended (``outcome``: router/metrics.py MIGRATION_OUTCOMES); ``downtime_s``:
        the client-visible stop."""
        m = self.moves.pop(rid, None)
        if m is None:
            return
        rm.MIGRATIONS.labels(m.reason, outcome).inc()
        if downtime_s is not None:
            rm.MIGRATION_DOWNTIME.observe(downtime_s)
        req = self.live.get(rid, (None, None))[0]
        if req is not None and req.trace:   # the move's span, in the request's trace
            tracing.record("migration", req.trace, time.time() - (time.monotonic() - m.started), **{
                "tandem.rid": rid, "tandem.from": m.source.name, "tandem.to": m.target.name,
                "tandem.reason": m.reason, "tandem.outcome": outcome, "tandem.downtime_s": downtime_s,
                "tandem.precopied_tokens": m.precopied})

    def in_flight(self) -> list[dict]:
        return [m.view() for m in list(self.moves.values())]

    def _start(self, req, r, t: WorkerRef, sent: Resume, source_name: str | None):
        self.dispatch.move(r, t.wid)
        self._inflight[req.rid] = t
        wire = dataclasses.replace(req, resume=sent).to_wire()
        return t.handle.generate.options(num_returns="streaming").remote(wire, source_name, self.router_id)

    async def drain(self, name: str, stop: bool = False, timeout_s: float = 60.0) -> dict:
        """Take ``name`` out of rotation and move its live requests away; ``stop``: then stop it.
        Done when every move from it has streamed on its target (nothing is copied from it any
        more). Returns what moved and what did not (requests that were not decoding yet are
        retried until they are, or until ``timeout_s``)."""
        w = self.pool.named(name)
        if w is None or w.role != DECODE:
            raise LookupError(f"no decode worker named {name!r}")
        await w.handle.drain.remote()
        moved, failed, end = [], {}, time.monotonic() + timeout_s
        while time.monotonic() < end:
            left = [rid for rid, d in list(self._inflight.items()) if d.wid == w.wid and rid not in self.moves]
            moving = any(w.wid in (m.target.wid, m.source.wid) for m in list(self.moves.values()))
            if not left and not moving and not any(d.wid == w.wid for d in list(self._inflight.values())):
                break   # nothing runs here, arrives here, or is still being copied from here
            results = await asyncio.gather(*(self.migrate(rid, reason="drain") for rid in left),
                                           return_exceptions=True)
            for rid, res in zip(left, results):
                if isinstance(res, (LookupError, ValueError)):   # prefilling still, or already ending
                    failed[rid] = str(res)
                elif isinstance(res, BaseException):
                    raise res
                else:
                    moved.append((rid, res))
                    failed.pop(rid, None)
            await asyncio.sleep(DRAIN_POLL_S)
        still = [rid for rid, d in list(self._inflight.items()) if d.wid == w.wid]
        still += [rid for rid, m in list(self.moves.items()) if m.target.wid == w.wid]
        if stop and not still:   # a restart: out of the pool now, then relaunched like a dead one
            import ray

            ray.kill(w.handle)
            if self.supervisor is not None:
                self.supervisor.mark_dead(w, "drained and stopped for a restart")
            w.retiring = False
        return {"worker": name, "moved": [{"rid": rid, "to": t} for rid, t in moved],
                "remaining": still, "errors": {k: v for k, v in failed.items() if k in still},
                "stopped": bool(stop and not still)}

    async def undrain(self, name: str) -> dict:
        """``name`` takes new requests again (and is relaunched if it dies): a drain's undo."""
        w = self.pool.named(name)
        if w is None or w.role != DECODE or not w.alive:
            raise LookupError(f"no live decode worker named {name!r}")
        await w.handle.undrain.remote()
        w.retiring = False
        return {"worker": name, "draining": False}

    async def rebalance(self, cfg: MigrationConfig) -> None:
        """Forever (a task on the router's loop): the ``balance`` policy."""
        while True:
            await asyncio.sleep(cfg.period_s)
            try:
                await self.rebalance_once(cfg)
            except Exception:  # noqa: BLE001 - a bad round must not stop the policy
                log.exception("migration policy round failed")

    async def rebalance_once(self, cfg: MigrationConfig) -> list[str]:
        """One decision and its move; returns the rids moved."""
        snaps = self.dispatch.snapshots()
        exclude = {wid for wid, s in snaps.items() if s.draining}
        running = [(rid, r.decode, r.decode_tokens) for rid, (_, r) in list(self.live.items())
                   if r.decode_open and rid not in self.moves]
        moved = []
        for m in plan_moves(self.dispatch.view().decode, running, high=cfg.high, low=cfg.low,
                            spread=cfg.spread, exclude=exclude):
            t = self.pool.get(m.target)
            try:
                await self.migrate(m.rid, t.name if t is not None else None, reason=m.why)
            except (LookupError, ValueError) as e:   # not decoding yet, or it just ended
                log.info("policy move of %s refused: %s", m.rid, e)
                continue
            self.counts[m.why] += 1
            moved.append(m.rid)
        return moved

    async def force(self, rid: str) -> None:
        """The ``debug_migrate_every`` lever: move ``rid`` to another decode worker, if it can."""
        try:
            await self.migrate(rid, reason="forced")
        except (LookupError, ValueError) as e:
            log.debug("forced move of %s refused: %s", rid, e)


def resume_of(chunks_ids: list[int], chars: int, last: StreamChunk) -> Resume:
    """What a client holds of a request when its worker's leg ended "migrated"."""
    return Resume(tuple(chunks_ids), chars, last.cached_tokens)
