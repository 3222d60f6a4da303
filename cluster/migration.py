"""Live migration in the cluster: a running request moves from one decode worker to another.

The router's side; the workers' is decode/worker.py (``freeze``, ``migrate_out``, a resumed
``generate``). :class:`Migrator` (one per backend, on the router's event loop):

    migrate(rid, to=None)  the target: ``to``, else the live, non-draining decode worker with the
                           fewest KV tokens that is not the request's; recorded, then the request is
                           frozen on its worker (its stream there ends "migrated", its KV held)
    next_leg(...)          the backend's stream loop met "migrated": the request continues on the
                           target, resumed from the tokens and text the client already has; the
                           target copies over NIXL only the KV its own cache lacks, from the source
    fall_back(...)         the target failed before its first chunk: the source resumes it (its
                           KV went to the source's cache: a full prefix hit, nothing recomputed)
    drain(name)            no new requests for the worker; every live request on it migrates
                           away; with ``stop``, it is then stopped and relaunched (a rolling
                           restart), else it stays out of rotation (retiring: not relaunched)
    rebalance(cfg)         the ``balance`` policy: every ``cfg.period_s`` one move that
                           router/rebalance.py plans (a full worker sheds a request to an empty one
                           instead of retracting; a skewed pair evens out)

The client's stream never sees "migrated": the legs are spliced, so no token is repeated or
missing (the resumed request starts after what was streamed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from tandem.cluster.workers import DECODE, WorkerPool, WorkerRef
from tandem.core.messages import GenerateRequest, Resume
from tandem.core.types import StreamChunk
from tandem.router.dispatch import Dispatcher, Route
from tandem.router.rebalance import plan_moves

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05


class Migrator:
    def __init__(self, pool: WorkerPool, dispatch: Dispatcher, inflight: dict[str, WorkerRef],
                 supervisor=None):
        self.pool, self.dispatch, self._inflight, self.supervisor = pool, dispatch, inflight, supervisor
        self._moves: dict[str, WorkerRef] = {}   # rid -> where it goes once frozen
        self.routes: dict[str, Route] = {}        # rid -> its route (the backend's stream loop keeps it)
        self.counts = {"migrations": 0, "fallbacks": 0, "refused": 0, "pressure": 0, "skew": 0}

    def target(self, exclude: set[int]) -> WorkerRef | None:
        """The live, non-draining decode worker with the fewest KV tokens, not in ``exclude``."""
        snaps = self.dispatch.snapshots()
        live = [v for v in self.dispatch.view().decode if v.alive and v.worker_id not in exclude
                and not (snaps.get(v.worker_id) is not None and snaps[v.worker_id].draining)]
        if not live:
            return None
        return self.pool.get(min(live, key=lambda v: (v.running_tokens, v.in_flight)).worker_id)

    async def migrate(self, rid: str, to: str | None = None) -> str:
        """Move ``rid`` to ``to`` (a decode worker's name) or the best target; returns its name.
        LookupError: no such request or no target; ValueError: it is not decoding (nothing moved)."""
        d = self._inflight.get(rid)
        if d is None:
            raise LookupError(f"no request {rid} in flight on this router")
        t = self.pool.named(to) if to else self.target({d.wid})
        if t is None or t.role != DECODE or not t.alive or t.wid == d.wid:
            raise LookupError(f"no decode worker to move {rid} to" + (f" (asked for {to!r})" if to else ""))
        self._moves[rid] = t
        try:
            await d.handle.freeze.remote(rid)
        except Exception as e:
            self._moves.pop(rid, None)
            self.counts["refused"] += 1
            cause = getattr(e, "cause", e)
            raise (cause if isinstance(cause, ValueError) else ValueError(str(cause)[:300])) from None
        self.counts["migrations"] += 1
        return t.name

    def next_leg(self, req: GenerateRequest, r: Route, source: WorkerRef, sent: Resume):
        """The request's stream on its new worker (resumed after ``sent``), and that worker."""
        t = self._moves.pop(req.rid, None) or self.target({source.wid}) or source
        return self._start(req, r, t, sent, source.name if t is not source else None), t

    async def fall_back(self, req: GenerateRequest, r: Route, source: WorkerRef, sent: Resume):
        """Back to ``source``: its frozen KV goes to its cache first, then it resumes there."""
        self.counts["fallbacks"] += 1
        await source.handle.release_frozen.remote(req.rid)
        return self._start(req, r, source, sent, None), source

    def _start(self, req, r, t: WorkerRef, sent: Resume, source_name: str | None):
        self.dispatch.move(r, t.wid)
        self._inflight[req.rid] = t
        wire = dataclasses.replace(req, resume=sent).to_wire()
        return t.handle.generate.options(num_returns="streaming").remote(wire, source_name)

    async def drain(self, name: str, stop: bool = False, timeout_s: float = 60.0) -> dict:
        """Take ``name`` out of rotation and move its live requests away; ``stop``: then stop it.
        Returns what moved and what did not (requests that were not decoding yet are retried
        until they are, or until ``timeout_s``)."""
        w = self.pool.named(name)
        if w is None or w.role != DECODE:
            raise LookupError(f"no decode worker named {name!r}")
        await w.handle.drain.remote()
        moved, failed, end = [], {}, time.monotonic() + timeout_s
        while time.monotonic() < end:
            left = [rid for rid, d in list(self._inflight.items()) if d.wid == w.wid and rid not in self._moves]
            arriving = any(t.wid == w.wid for t in list(self._moves.values()))   # moving here right now
            if not left and not arriving and not any(d.wid == w.wid for d in list(self._inflight.values())):
                break
            for rid in left:
                try:
                    moved.append((rid, await self.migrate(rid)))
                    failed.pop(rid, None)
                except (LookupError, ValueError) as e:   # prefilling still, or already ending
                    failed[rid] = str(e)
            await asyncio.sleep(DRAIN_POLL_S)
        still = [rid for rid, d in list(self._inflight.items()) if d.wid == w.wid]
        still += [rid for rid, t in list(self._moves.items()) if t.wid == w.wid]
        if stop and not still:   # a restart: out of the pool now, then relaunched like a dead one
            import ray

            ray.kill(w.handle)
            if self.supervisor is not None:
                self.supervisor.mark_dead(w, "drained and stopped for a restart")
            w.retiring = False
        return {"worker": name, "moved": [{"rid": rid, "to": t} for rid, t in moved],
                "remaining": still, "errors": {k: v for k, v in failed.items() if k in still},
                "stopped": bool(stop and not still)}


    async def rebalance(self, cfg) -> None:
        """Forever (a task on the router's loop): the ``balance`` policy (``cfg``: MigrationConfig)."""
        while True:
            await asyncio.sleep(cfg.period_s)
            try:
                await self.rebalance_once(cfg)
            except Exception:  # noqa: BLE001 - a bad round must not stop the policy
                log.exception("migration policy round failed")

    async def rebalance_once(self, cfg) -> list[str]:
        """One decision and its move; returns the rids moved."""
        snaps = self.dispatch.snapshots()
        exclude = {wid for wid, s in snaps.items() if s.draining}
        running = [(rid, r.decode, r.decode_tokens) for rid, r in list(self.routes.items())
                   if r.decode_open and rid not in self._moves]
        moved = []
        for m in plan_moves(self.dispatch.view().decode, running, high=cfg.high, low=cfg.low,
                            spread=cfg.spread, exclude=exclude):
            t = self.pool.get(m.target)
            try:
                await self.migrate(m.rid, t.name if t is not None else None)
            except (LookupError, ValueError) as e:   # not decoding yet, or it just ended
                log.info("policy move of %s refused: %s", m.rid, e)
                continue
            self.counts[m.why] += 1
            moved.append(m.rid)
        return moved


def resume_of(chunks_ids: list[int], chars: int, last: StreamChunk) -> Resume:
    """What a client holds of a request when its worker's leg ended "migrated"."""
    return Resume(tuple(chunks_ids), chars, last.cached_tokens)
