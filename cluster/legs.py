"""One request's stream across decode workers: :class:`Legs`. It turns a leg's end into the next
leg; it never changes a :class:`Migration`'s phase itself (the Migrator does).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from tandem.cluster.moves import Migration, Phase
from tandem.cluster.workers import WorkerRef
from tandem.core.messages import GenerateRequest, Resume
from tandem.core.types import StreamChunk
from tandem.router.dispatch import Route
from tandem.router.rebalance import MoveRequest, plan_forced

if TYPE_CHECKING:
    from ray import ObjectRefGenerator

    from tandem.cluster.supervisor import Supervisor
    from tandem.core.config import MigrationConfig

Leg = tuple["ObjectRefGenerator", WorkerRef]   # a leg's streaming ``generate`` and its decode worker

log = logging.getLogger(__name__)


class LegMover(Protocol):
    """What :class:`Legs` asks of the Migrator (cluster/migration.py, which imports this module):
    each verb starts the next leg, or ends a move."""

    @property
    def router_id(self) -> str | None: ...
    @property
    def moves(self) -> dict[str, Migration]: ...
    @property
    def supervisor(self) -> Supervisor | None: ...
    @property
    def cfg(self) -> MigrationConfig: ...

    async def next_leg(self, legs: Legs, sent: Resume) -> Leg: ...
    async def fall_back(self, legs: Legs, m: Migration, sent: Resume) -> Leg: ...
    def recompute(self, legs: Legs, m: Migration, sent: Resume) -> Leg: ...
    def prestop(self, legs: Legs, stuck: WorkerRef) -> Leg | None: ...
    async def failover(self, legs: Legs, dead: WorkerRef, wait_s: float) -> Leg | None: ...
    def end(self, m: Migration, phase: Phase, downtime_s: float | None = None, record: bool = True) -> None: ...
    def close(self, legs: Legs) -> None: ...


class Legs:
    """``migrator``: the Migrator that moves it (its ``moves``, ``next_leg``, ``fall_back``,
    ``recompute``, ``prestop``, ``end``); ``gen``: the streaming ``generate`` of the current leg."""

    def __init__(self, migrator: LegMover, req: GenerateRequest, route: Route, worker: WorkerRef,
                 gen: ObjectRefGenerator) -> None:
        self.migrator, self.req, self.route, self.worker, self.gen = migrator, req, route, worker, gen
        self.ids: list[int] = []
        self.chars, self.cached = 0, 0
        self.last_token_at = time.monotonic()
        self.leg_tokens = 0

    @classmethod
    def start(cls, migrator: LegMover, req: GenerateRequest, route: Route, worker: WorkerRef,
              prefill: str | None) -> Legs:
        """``req``'s first leg on decode worker ``worker`` (``prefill``: its prefill worker's name)."""
        return cls(migrator, req, route, worker, worker.decode_api.generate(req.to_wire(), prefill, migrator.router_id))

    def sent(self, last: StreamChunk | None = None) -> Resume:
        return Resume(tuple(self.ids), self.chars, last.cached_tokens if last is not None else self.cached)

    def _move(self) -> Migration | None:
        return self.migrator.moves.get(self.req.rid)

    def _frozen_source(self) -> tuple[Migration, WorkerRef] | None:
        """The move copying this request's KV off a frozen source, and that source; None when none."""
        m = self._move()
        src = m.frozen_source(self.worker) if m is not None else None
        return None if m is None or src is None else (m, src)

    def target_died(self) -> StreamChunk | None:
        """The current leg's worker died. Mid-copy from a live source: it is marked dead and an
        empty abort chunk returned (:meth:`next_leg` then falls back); else None (not a move's to handle)."""
        frozen = self._frozen_source()
        if frozen is None or not frozen[1].alive:
            return None
        if self.migrator.supervisor is not None:
            self.migrator.supervisor.mark_dead(self.worker, "died during a migration")
        return StreamChunk(self.req.rid, (), "", "abort", len(self.req.prompt_ids),
                           error=f"decode worker {self.worker.name} died during a migration")

    async def next_leg(self, c: StreamChunk) -> bool:
        """Whether ``c`` ended the current leg and another one streams now ("migrated", or a move's
        target failing: back to the source, or recomputed)."""
        if c.finish_reason == "migrated":
            self.leg_tokens = 0
            self.gen, self.worker = await self.migrator.next_leg(self, self.sent(c))
            return True
        frozen = self._frozen_source()
        if frozen is None or c.finish_reason != "abort" or c.token_ids:
            return False
        m, src = frozen
        if src.alive:
            log.warning("%s failed on %s after a migration (%s); back to %s",
                        self.req.rid, self.worker.name, c.error, src.name)
            self.gen, self.worker = await self.migrator.fall_back(self, m, self.sent(c))
        else:
            log.warning("%s: the source %s died mid-migration; %s recomputes",
                        self.req.rid, src.name, self.worker.name)
            self.gen, self.worker = self.migrator.recompute(self, m, self.sent(c))
        return True

    def prestop(self) -> bool:
        """The current worker is stuck: whether the request resumes on a peer (the next leg)."""
        moved = self.migrator.prestop(self, self.worker)
        if moved is None:
            return False
        self.gen, self.worker = moved
        return True

    async def failover(self, dead: WorkerRef, wait_s: float) -> bool:
        """The current worker ``dead`` died: whether the request resumes on a live decode worker
        (waiting up to ``wait_s`` for one), the next leg."""
        moved = await self.migrator.failover(self, dead, wait_s)
        if moved is None:
            return False
        self.leg_tokens = 0
        self.gen, self.worker = moved
        return True

    def add(self, c: StreamChunk) -> None:
        """``c`` goes to the client: a move whose new leg streams is over (DONE; FAILED for an
        error without tokens); what the client has grows."""
        if c.token_ids or c.finish_reason is not None:
            now = time.monotonic()
            m = self._move()
            if m is not None and m.phase is Phase.COPYING:
                ok = bool(c.token_ids) or not c.error
                self.migrator.end(m, Phase.DONE if ok else Phase.FAILED, now - self.last_token_at)
            self.last_token_at = now
        self.ids += c.token_ids
        self.chars += len(c.text)
        self.cached = c.cached_tokens or self.cached

    def planned(self, c: StreamChunk) -> MoveRequest | None:
        """After ``c`` reached the client: a move the stream's own planners ask for (the forced lever)."""
        self.leg_tokens += len(c.token_ids)
        if self.req.rid in self.migrator.moves:
            return None
        mv = plan_forced(self.req.rid, self.worker.wid, self.leg_tokens, self.migrator.cfg)
        if mv is not None:
            self.leg_tokens = 0
        return mv

    async def next_chunk(self) -> StreamChunk | None:
        """The current leg's next chunk; None when its stream ended."""
        try:
            ref = await self.gen.__anext__()
        except StopAsyncIteration:
            return None
        chunk: StreamChunk = await ref
        return chunk

    def leave_stuck(self) -> None:
        """The current leg's decode worker stopped making progress: its stream is cancelled and an
        abort sent there (the request moves on)."""
        import ray

        self.worker.stale.add(self.req.rid)
        self.worker.api.abort(self.req.rid, "moved to another worker: this attempt stopped making progress")
        try:
            ray.cancel(self.gen)
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        self.migrator.close(self)
