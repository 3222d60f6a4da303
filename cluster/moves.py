"""One live migration: :class:`Migration`, whose :class:`Phase` moves along :data:`LEGAL` only.

    PRECOPY ──► FROZEN ──► COPYING ──► DONE | FELL_BACK | RECOMPUTED | FAILED | ABORTED
       └──► FAILED | REFUSED           └──► ABORTED
"""

from __future__ import annotations

import dataclasses
import time
from enum import Enum
from typing import Any

from tandem.cluster.workers import WorkerRef
from tandem.router.rebalance import MoveReason


class Phase(Enum):
    PRECOPY = "precopy"
    FROZEN = "frozen"
    COPYING = "copying"
    DONE = "done"
    FELL_BACK = "fell_back"
    RECOMPUTED = "recomputed"
    FAILED = "failed"
    ABORTED = "aborted"
    REFUSED = "refused"


class IllegalTransition(RuntimeError):
    pass


LEGAL: dict[Phase, frozenset[Phase]] = {
    Phase.PRECOPY: frozenset({Phase.FROZEN, Phase.FAILED, Phase.REFUSED}),
    Phase.FROZEN: frozenset({Phase.COPYING, Phase.FAILED, Phase.ABORTED}),
    Phase.COPYING: frozenset({Phase.DONE, Phase.FELL_BACK, Phase.RECOMPUTED, Phase.FAILED, Phase.ABORTED}),
}
TERMINAL = frozenset(Phase) - frozenset(LEGAL)
# The ``outcome`` label of tandem_migrations_total (router/metrics.py MIGRATION_OUTCOMES) per terminal phase.
OUTCOME = {Phase.DONE: "ok", Phase.FELL_BACK: "failed", Phase.RECOMPUTED: "failed", Phase.FAILED: "failed",
           Phase.ABORTED: "aborted"}


@dataclasses.dataclass
class Migration:
    """One request on its way from ``source`` to ``target``. ``froze``: it passed FROZEN (the
    source holds its KV for the copy; a pre-stop never does)."""

    rid: str
    source: WorkerRef
    target: WorkerRef
    reason: MoveReason
    phase: Phase = Phase.PRECOPY
    started: float = dataclasses.field(default_factory=time.monotonic)
    precopied: int = 0
    froze: bool = False

    def __post_init__(self) -> None:
        self.froze = self.froze or self.phase is Phase.FROZEN

    def to(self, phase: Phase) -> None:
        """IllegalTransition, changing nothing, unless ``phase`` is a legal next phase."""
        if phase not in LEGAL.get(self.phase, ()):
            raise IllegalTransition(f"migration of {self.rid}: {self.phase.name} -> {phase.name}")
        self.phase = phase
        self.froze = self.froze or phase is Phase.FROZEN

    @property
    def ended(self) -> bool:
        return self.phase in TERMINAL

    def frozen_source(self, streaming: WorkerRef) -> WorkerRef | None:
        """The source that holds the KV while another worker (``streaming``) copies it, else None."""
        if self.phase is Phase.COPYING and self.froze and self.source is not streaming:
            return self.source
        return None

    def view(self) -> dict[str, Any]:
        return {"rid": self.rid, "from": self.source.name, "to": self.target.name, "reason": self.reason.value,
                "phase": self.phase.value, "precopied_tokens": self.precopied,
                "age_s": round(time.monotonic() - self.started, 3)}
