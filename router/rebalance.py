"""When to migrate a running request between decode workers: pure planners over the router's view.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import Enum

from tandem.core.config import MigrationConfig
from tandem.router.view import WorkerView


class MoveReason(str, Enum):
    """Why a request moves; the values are the ``reason`` label of ``tandem_migrations_total``."""

    PRESSURE = "pressure"
    REBALANCE = "rebalance"
    DRAIN = "drain"
    ADMIN = "admin"
    FORCED = "forced"
    PRESTOP = "prestop"


@dataclass(frozen=True)
class MoveRequest:
    """Move ``rid`` off decode worker ``source`` to ``target``."""

    rid: str
    source: int | None
    target: int | None
    reason: MoveReason


def plan_moves(decodes: Sequence[WorkerView], running: Sequence[tuple[str, int, int]], *,
               high: float, low: float, spread: float, exclude: Collection[int] = ()) -> list[MoveRequest]:
    """``running``: ``(rid, decode worker id, KV tokens)`` of every request that could move."""
    util = {w.worker_id: (w.running_tokens, w.capacity_tokens) for w in decodes
            if w.alive and w.capacity_tokens > 0}
    if len(util) < 2:
        return []
    frac = {wid: t / cap for wid, (t, cap) in util.items()}
    hot = max(frac, key=lambda wid: (frac[wid], -wid))
    targets = [wid for wid in frac if wid != hot and wid not in exclude]
    if not targets:
        return []
    cool = min(targets, key=lambda wid: (frac[wid], wid))
    why = (MoveReason.PRESSURE if frac[hot] >= high and frac[cool] <= low else
           MoveReason.REBALANCE if frac[hot] - frac[cool] > spread else None)
    if why is None:
        return []
    (hot_t, _), (cool_t, cool_cap) = util[hot], util[cool]
    room = int(cool_cap * high) - cool_t
    fits = [(tokens, rid) for rid, wid, tokens in running   # narrows the gap: tokens < hot - cool
            if wid == hot and 0 < tokens <= room and tokens < hot_t - cool_t]
    if not fits:
        return []
    gap = hot_t - cool_t
    tokens, rid = min(fits, key=lambda f: (abs(gap - 2 * f[0]), -f[0], f[1]))   # the most even result
    return [MoveRequest(rid, hot, cool, why)]


def plan_balance(decodes: Sequence[WorkerView], running: Sequence[tuple[str, int, int]], cfg: MigrationConfig,
                 exclude: Collection[int]) -> list[MoveRequest]:
    """The ``balance`` policy's round: :func:`plan_moves` with ``cfg``'s thresholds."""
    return plan_moves(decodes, running, high=cfg.high, low=cfg.low, spread=cfg.spread, exclude=exclude)


# The planners the policy runs every ``period_s``, in order: (decodes, running, cfg, exclude) -> moves.
PERIODIC = (plan_balance,)


def plan_drain(worker: int, running: Sequence[tuple[str, int]], moving: Collection[str]) -> list[MoveRequest]:
    """Every request of ``running`` (``(rid, decode worker id)``) on ``worker`` not in ``moving``."""
    return [MoveRequest(rid, wid, None, MoveReason.DRAIN) for rid, wid in running
            if wid == worker and rid not in moving]


def plan_forced(rid: str, worker: int, leg_tokens: int, cfg: MigrationConfig) -> MoveRequest | None:
    """``rid`` moves once it streamed ``cfg.debug_migrate_every`` tokens on ``worker`` (0: never)."""
    every = cfg.debug_migrate_every
    return MoveRequest(rid, worker, None, MoveReason.FORCED) if every and leg_tokens >= every else None
