"""When to migrate a running request between decode workers: a pure decision over the router's view.

Utilization is the router's own record: the KV tokens charged to a decode worker's running
requests (``WorkerView.running_tokens``, grown per token) over its pool (``capacity_tokens``).
:func:`plan_moves` moves at most one request per call, from the fullest decode worker to the
emptiest, when

- **pressure**: the fullest is at ``high`` or above (its next decode steps would retract) and the
  emptiest at ``low`` or below;
- **rebalance** (skew): their utilizations differ by more than ``spread``.

The request moved is the one on the fullest worker that fits under ``high`` on the target and
leaves the two most even (ties: the larger); one that would not narrow their gap never moves (no
ping-pong). Workers in ``exclude`` (draining,
just moved) are never a target. No I/O, no clock: cluster/migration.py applies the plan.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from tandem.router.view import WorkerView


@dataclass(frozen=True)
class Move:
    rid: str
    source: int     # worker id
    target: int
    why: str        # "pressure" | "rebalance"


def plan_moves(decodes: Sequence[WorkerView], running: Sequence[tuple[str, int, int]], *,
               high: float, low: float, spread: float, exclude: Collection[int] = ()) -> list[Move]:
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
    why = ("pressure" if frac[hot] >= high and frac[cool] <= low else
           "rebalance" if frac[hot] - frac[cool] > spread else "")
    if not why:
        return []
    (hot_t, _), (cool_t, cool_cap) = util[hot], util[cool]
    room = int(cool_cap * high) - cool_t
    fits = [(tokens, rid) for rid, wid, tokens in running   # narrows the gap: tokens < hot - cool
            if wid == hot and 0 < tokens <= room and tokens < hot_t - cool_t]
    if not fits:
        return []
    gap = hot_t - cool_t
    tokens, rid = min(fits, key=lambda f: (abs(gap - 2 * f[0]), -f[0], f[1]))   # the most even result
    return [Move(rid, hot, cool, why)]
