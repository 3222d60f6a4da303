"""The router's side of live migration: :class:`Migrator` carries out planners' MoveRequests and
owns every Migration; each request's Legs belong to its RequestStream, in the backend's ``streams``,
which the Migrator only reads (cluster/README.md has the trail).

Fail closed: before the stop a failed pre-copy leaves the request where it is; after it the request
continues on the target, the source or recomputed. The client never sees "migrated": no token is
repeated or missing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tandem.cluster.legs import Legs
from tandem.cluster.moves import Migration, Phase, OUTCOME
from tandem.cluster.workers import DECODE, WorkerPool, WorkerRef
from tandem.core import tracing
from tandem.core.config import MigrationConfig
from tandem.core.messages import GenerateRequest, Resume
from tandem.core.types import SamplingParams, StreamChunk
from tandem.router import metrics as rm
from tandem.router.dispatch import Dispatcher, Route
from tandem.router.rebalance import PERIODIC, MoveReason, MoveRequest, plan_drain

if TYPE_CHECKING:
    from ray import ObjectRefGenerator

    from tandem.cluster.legs import Leg
    from tandem.cluster.supervisor import Supervisor

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05
FAILOVER_POLL_S = 0.1   # how often a request whose worker died looks for a live one


class Migrator:
    def __init__(self, pool: WorkerPool, dispatch: Dispatcher, legs: Callable[[], dict[str, Legs]],
                 supervisor: Supervisor | None = None, cfg: MigrationConfig | None = None,
                 router_id: str | None = None, page_size: int = 16) -> None:
        """``legs``: the backend's streams as a fresh worker-side rid -> current :class:`Legs` map on each
        call (a snapshot: the Migrator reads where a request is, it never files one; the backend's
        ``streams`` own that); ``router_id``: the workers' lease on this router; ``page_size``: a
        pre-copy takes whole pages."""
        self.pool, self.dispatch, self._legs, self.supervisor = pool, dispatch, legs, supervisor
        self.router_id = router_id
        self.page_size = page_size
        self.cfg = cfg or MigrationConfig()
        self.moves: dict[str, Migration] = {}
        self.counts = {"migrations": 0, "fallbacks": 0, "recomputed": 0, "refused": 0, "failovers": 0,
                       "precopies": 0, "precopy_rounds": 0, "precopied_tokens": 0,
                       **{r.value: 0 for r in MoveReason}}

    @property
    def live(self) -> dict[str, tuple[GenerateRequest, Route]]:
        """rid -> (request, route) of every request the backend streams."""
        return {rid: (s.req, s.route) for rid, s in self._legs().items()}

    def where(self) -> dict[str, WorkerRef]:
        """Worker-side rid -> the decode worker it streams from now (derived from the backend's streams)."""
        return {rid: s.worker for rid, s in self._legs().items()}

    def close(self, legs: Legs) -> None:
        """``legs``' request ended: a move it was in the middle of frees the source's held KV (ABORTED)."""
        rid = legs.req.rid
        m = self.moves.get(rid)
        if m is not None and m.phase in (Phase.FROZEN, Phase.COPYING):
            if m.source.alive:
                m.source.decode_api.release_frozen(rid)
            self.end(m, Phase.ABORTED)

    def target(self, exclude: set[int]) -> WorkerRef | None:
        """The live, non-draining decode worker with the fewest KV tokens, not in ``exclude``."""
        snaps = self.dispatch.snapshots()
        live = [v for v in self.dispatch.view().decode if v.alive and v.worker_id not in exclude
                and not (snaps.get(v.worker_id) is not None and snaps[v.worker_id].draining)]
        if not live:
            return None
        return self.pool.get(min(live, key=lambda v: (v.running_tokens, v.in_flight)).worker_id)

    async def wait_target(self, exclude: set[int], wait_s: float) -> WorkerRef | None:
        """:meth:`target`, waiting up to ``wait_s`` for one to be in rotation (the supervisor's
        replacement of a dead worker); None when none came in time."""
        end = time.monotonic() + wait_s
        t = self.target(exclude)
        while t is None and time.monotonic() < end:
            await asyncio.sleep(FAILOVER_POLL_S)
            t = self.target(exclude)
        return t

    async def move(self, mv: MoveRequest) -> str:
        """Carry out a planner's ``mv`` (:meth:`migrate` to its target, else the best one)."""
        t = self.pool.get(mv.target) if mv.target is not None else None
        return await self.migrate(mv.rid, t.name if t is not None else None, reason=mv.reason)

    async def try_move(self, mv: MoveRequest) -> bool:
        """:meth:`move`, a refusal logged instead of raised; whether it moved."""
        try:
            await self.move(mv)
        except (LookupError, ValueError) as e:
            log.info("%s move of %s refused: %s", mv.reason.value, mv.rid, e)
            return False
        return True

    async def migrate(self, rid: str, to: str | None = None, reason: MoveReason = MoveReason.ADMIN) -> str:
        """Move ``rid`` to ``to`` or the best target; returns its name. LookupError: no such request or
        target; ValueError: not decoding, already moving, or the target failed in the pre-copy."""
        d = self.where().get(rid)
        if d is None:
            raise LookupError(f"no request {rid} in flight on this router")
        if rid in self.moves:
            raise ValueError(f"request {rid} is already moving to {self.moves[rid].target.name}")
        t = self.pool.named(to) if to else self.target({d.wid})
        if t is None or t.role != DECODE or not t.alive or t.wid == d.wid:
            raise LookupError(f"no decode worker to move {rid} to" + (f" (asked for {to!r})" if to else ""))
        m = self.moves[rid] = Migration(rid, d, t, MoveReason(reason))
        try:
            if self.cfg.precopy:
                await self._precopy(m)
            if self.where().get(rid) is not d:
                raise ValueError(f"request {rid} ended or moved during its pre-copy")
            await d.decode_api.freeze(rid)
        except Exception as e:
            import ray

            if isinstance(e, ray.exceptions.RayActorError):
                if self.supervisor is not None:
                    self.supervisor.mark_dead(t, "died during a migration's pre-copy")
                self.end(m, Phase.FAILED)
                raise ValueError(f"decode worker {t.name} died during the pre-copy of {rid}; "
                                 f"it decodes on {d.name}") from None
            self.end(m, Phase.REFUSED)
            self.counts["refused"] += 1
            cause = getattr(e, "cause", e)
            raise (cause if isinstance(cause, (ValueError, LookupError)) else ValueError(str(cause)[:300])) from None
        if m.phase is Phase.PRECOPY:
            m.to(Phase.FROZEN)
        self.counts["migrations"] += 1
        self.counts[m.reason.value] += 1
        return t.name

    async def _precopy(self, m: Migration) -> None:
        """Pre-copy rounds within ``precopy_timeout_s``; a failed round only leaves more for the stop.
        RayActorError: the target died."""
        s = self._legs().get(m.rid)
        if s is None:
            return
        req, r = s.req, s.route
        end = time.monotonic() + self.cfg.precopy_timeout_s
        ids = self.warm_ids(req.prompt_ids, s.ids)
        if len(ids) < self.cfg.precopy_min_tokens or not await self._warm(m, req, r, ids, "precopy", end):
            return
        if not self.cfg.precopy_generated or not self.cfg.precopy_again_pages:
            return
        again = self.warm_ids(req.prompt_ids, s.ids)
        if len(again) - len(ids) >= self.cfg.precopy_again_pages * self.page_size:
            await self._warm(m, req, r, again, "precopy2", end)

    def warm_ids(self, prompt: tuple[int, ...], out: Sequence[int]) -> tuple[int, ...]:
        """What a pre-copy round takes: the prompt, and with ``precopy_generated`` the generated
        tokens ``out`` (what the client has) up to the last whole page of the two together."""
        n = (len(prompt) + len(out)) // self.page_size * self.page_size
        if not self.cfg.precopy_generated or n <= len(prompt):
            return tuple(prompt)
        return tuple(prompt) + tuple(out[:n - len(prompt)])

    async def _warm(self, m: Migration, req: GenerateRequest, r: Route, ids: tuple[int, ...], tag: str,
                    end: float) -> bool:
        """One pre-copy round (a one-token request ``{rid}~{tag}.{hex}`` on the target); whether it landed by ``end``."""
        import ray

        left = end - time.monotonic()
        if left <= 0:
            return False
        p = self.pool.get(r.prefill)
        # a fresh id per round: a request moves many times, and an earlier round's warm request
        # (or its reply push, ``...#stored``) may still be held on the target or the prefill worker
        warm = GenerateRequest(f"{m.rid}~{tag}.{secrets.token_hex(4)}", ids, SamplingParams(max_tokens=1, ignore_eos=True),
                               session_id=req.session_id, tenant=req.tenant, cache_salt=req.cache_salt,
                               trace=req.trace, pins=req.pins, pin_cap=req.pin_cap)   # the target pins at once
        gen = m.target.decode_api.generate(
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
        except Exception as e:  # noqa: BLE001
            log.info("pre-copy %s of %s to %s gave up: %s", tag, m.rid, m.target.name, type(e).__name__)
            try:
                ray.cancel(gen)
            except Exception:
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

    async def next_leg(self, legs: Legs, sent: Resume) -> Leg:
        """``legs``' leg ended "migrated": (the stream of its next leg, resumed after ``sent``,
        and that worker). The move's target, else the best peer, else the source itself."""
        rid, source = legs.req.rid, legs.worker
        m = self.moves.get(rid)
        if m is None or m.phase is Phase.COPYING:
            if m is not None:
                self.end(m, Phase.FAILED, record=False)
            m = self.moves[rid] = Migration(rid, source, source, MoveReason.ADMIN, Phase.FROZEN)
        elif m.phase is Phase.PRECOPY:
            m.to(Phase.FROZEN)
        t = m.target if m.target.alive and m.target is not source else self.target({source.wid})
        m.target = t or source
        m.to(Phase.COPYING)
        if t is None:
            await source.decode_api.release_frozen(rid)
            return self._start(legs, source, sent, None), source
        return self._start(legs, t, sent, source.name), t

    async def fall_back(self, legs: Legs, m: Migration, sent: Resume) -> Leg:
        """``m``'s target failed before its first chunk: back to its source, whose frozen KV goes
        to its cache first (a full prefix hit). (stream, worker)."""
        self.counts["fallbacks"] += 1
        await m.source.decode_api.release_frozen(m.rid)
        out = self._start(legs, m.source, sent, None), m.source
        self.end(m, Phase.FELL_BACK)
        return out

    def recompute(self, legs: Legs, m: Migration, sent: Resume) -> Leg:
        """``m``'s source died mid-copy: its target (``legs.worker``) recomputes the KV it lacks."""
        self.counts["recomputed"] += 1
        out = self._start(legs, legs.worker, sent, None), legs.worker
        self.end(m, Phase.RECOMPUTED)
        return out

    def prestop(self, legs: Legs, stuck: WorkerRef) -> Leg | None:
        """Resume the request off ``stuck`` on the best peer, which recomputes its KV. (stream, worker),
        or None when no peer is in rotation."""
        t = self.target({stuck.wid})
        if t is None:
            return None
        old = self.moves.get(legs.req.rid)
        if old is not None:
            self.end(old, Phase.FAILED, record=False)
        self.moves[legs.req.rid] = Migration(legs.req.rid, stuck, t, MoveReason.PRESTOP, Phase.COPYING)
        self.counts[MoveReason.PRESTOP.value] += 1
        return self._start(legs, t, legs.sent(), None), t

    async def failover(self, legs: Legs, dead: WorkerRef, wait_s: float) -> Leg | None:
        """``legs``' decode worker ``dead`` died: the request resumes after what its client has on the
        best live decode worker, which recomputes the KV (its own cache first, then a local prefill),
        waiting up to ``wait_s`` for one to be in rotation (the supervisor's replacement, when ``dead``
        was the only one). (stream, worker), or None when none came in time."""
        t = await self.wait_target({dead.wid}, wait_s)
        if t is None:
            return None
        old = self.moves.get(legs.req.rid)
        if old is not None:
            self.end(old, Phase.FAILED, record=False)
        self.counts["failovers"] += 1
        return self._start(legs, t, legs.sent(), None), t

    def end(self, m: Migration, phase: Phase, downtime_s: float | None = None, record: bool = True) -> None:
        """``m`` ends in terminal ``phase`` (a no-op when it already ended); ``record``: count its
        outcome (:data:`OUTCOME`) in tandem_migrations_total; ``downtime_s``: the client-visible stop."""
        if m.ended:
            return
        m.to(phase)
        if self.moves.get(m.rid) is m:
            del self.moves[m.rid]
        outcome = OUTCOME.get(phase)
        if record and outcome is not None:
            rm.MIGRATIONS.labels(m.reason.value, outcome).inc()
            if downtime_s is not None:
                rm.MIGRATION_DOWNTIME.observe(downtime_s)
        legs = self._legs().get(m.rid)
        if legs is not None and legs.req.trace:
            attrs: dict[str, Any] = {
                "tandem.rid": m.rid, "tandem.from": m.source.name, "tandem.to": m.target.name,
                "tandem.reason": m.reason.value, "tandem.outcome": outcome or phase.value,
                "tandem.downtime_s": downtime_s, "tandem.precopied_tokens": m.precopied}
            tracing.record("migration", legs.req.trace, time.time() - (time.monotonic() - m.started), **attrs)

    def in_flight(self) -> list[dict[str, Any]]:
        return [m.view() for m in list(self.moves.values())]

    def _start(self, legs: Legs, t: WorkerRef, sent: Resume, source_name: str | None) -> ObjectRefGenerator:
        """The request's next leg on ``t``, resumed after ``sent``; ``source_name``: the decode
        worker its KV is copied from (None: ``t`` recomputes what its cache lacks)."""
        self.dispatch.move(legs.route, t.wid)
        wire = dataclasses.replace(legs.req, resume=sent).to_wire()
        return t.decode_api.generate(wire, source_name, self.router_id)

    async def drain(self, name: str, stop: bool = False, timeout_s: float = 60.0) -> dict[str, Any]:
        """Take ``name`` out of rotation and move its requests away (``stop``: then stop it), within
        ``timeout_s``. Returns what moved and what did not."""
        w = self.pool.named(name)
        if w is None or w.role != DECODE:
            raise LookupError(f"no decode worker named {name!r}")
        await w.api.drain()
        moved, failed, end = [], {}, time.monotonic() + timeout_s
        while time.monotonic() < end:
            where = self.where()
            left = [mv.rid for mv in plan_drain(w.wid, [(rid, d.wid) for rid, d in where.items()], self.moves)]
            moving = any(w.wid in (m.target.wid, m.source.wid) for m in list(self.moves.values()))
            if not left and not moving and not any(d.wid == w.wid for d in where.values()):
                break
            results = await asyncio.gather(*(self.migrate(rid, reason=MoveReason.DRAIN) for rid in left),
                                           return_exceptions=True)
            for rid, res in zip(left, results):
                if isinstance(res, (LookupError, ValueError)):
                    failed[rid] = str(res)
                elif isinstance(res, BaseException):
                    raise res
                else:
                    moved.append((rid, res))
                    failed.pop(rid, None)
            await asyncio.sleep(DRAIN_POLL_S)
        still = [rid for rid, d in self.where().items() if d.wid == w.wid]
        still += [rid for rid, m in list(self.moves.items()) if m.target.wid == w.wid]
        if stop and not still:
            import ray

            ray.kill(w.handle)
            if self.supervisor is not None:
                self.supervisor.mark_dead(w, "drained and stopped for a restart")
            w.retiring = False
        return {"worker": name, "moved": [{"rid": rid, "to": t} for rid, t in moved],
                "remaining": still, "errors": {k: v for k, v in failed.items() if k in still},
                "stopped": bool(stop and not still)}

    async def undrain(self, name: str) -> dict[str, Any]:
        """``name`` takes new requests again (and is relaunched if it dies): a drain's undo."""
        w = self.pool.named(name)
        if w is None or w.role != DECODE or not w.alive:
            raise LookupError(f"no live decode worker named {name!r}")
        await w.api.undrain()
        w.retiring = False
        return {"worker": name, "draining": False}

    async def rebalance(self, cfg: MigrationConfig) -> None:
        """Forever (a task on the router's loop): the periodic planners every ``cfg.period_s``."""
        while True:
            await asyncio.sleep(cfg.period_s)
            try:
                await self.rebalance_once(cfg)
            except Exception:  # noqa: BLE001
                log.exception("migration policy round failed")

    async def rebalance_once(self, cfg: MigrationConfig) -> list[str]:
        """One round of every planner in router/rebalance.py's PERIODIC and their moves; the rids moved."""
        snaps = self.dispatch.snapshots()
        exclude = {wid for wid, s in snaps.items() if s.draining}
        running = [(rid, s.route.decode, s.route.decode_tokens) for rid, s in self._legs().items()
                   if s.route.decode_open and rid not in self.moves]
        moved = []
        for plan in PERIODIC:
            for mv in plan(self.dispatch.view().decode, running, cfg, exclude):
                if await self.try_move(mv):
                    moved.append(mv.rid)
        return moved

