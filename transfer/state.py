"""The one vocabulary of a KV transfer's state, and a registry with deadlines.

    ALLOCATED ──> BOOTSTRAPPED ──> TRANSFERRING ──> DONE
        │              │                 │
        └──────────────┴─────────────────┴──────> FAILED | ABORTED

ALLOCATED: destination pages are reserved. BOOTSTRAPPED: the peers know each other and the writer
has the page list. TRANSFERRING: writes are posted (NIXL's "PROC"). DONE (NIXL's "DONE"), FAILED
(NIXL's "ERR", an error, a deadline) and ABORTED (a client or router abort) are terminal. The same
enum is a write's poll answer (transfer/agent.py maps NIXL's strings onto it) and a prefill
result's status. Clocks are the caller's: deadlines and ``now`` use one clock
(``time.monotonic()`` by default).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Callable


class TransferState(enum.Enum):
    ALLOCATED = "allocated"
    BOOTSTRAPPED = "bootstrapped"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_S = TransferState
_TERMINAL = frozenset({_S.DONE, _S.FAILED, _S.ABORTED})
LEGAL: dict[TransferState, frozenset[TransferState]] = {
    _S.ALLOCATED: frozenset({_S.BOOTSTRAPPED, _S.FAILED, _S.ABORTED}),
    _S.BOOTSTRAPPED: frozenset({_S.TRANSFERRING, _S.FAILED, _S.ABORTED}),
    _S.TRANSFERRING: frozenset({_S.DONE, _S.FAILED, _S.ABORTED}),
    _S.DONE: frozenset(),
    _S.FAILED: frozenset(),
    _S.ABORTED: frozenset(),
}


class IllegalTransition(ValueError):
    """A transfer was moved along an edge the state machine does not have."""


@dataclass
class TransferRecord:
    transfer_id: int
    state: TransferState
    deadline: float
    error: str = ""


class TransferRegistry:
    """Live transfers by id. At most ~6 verbs: add, advance, fail, get, expired, remove."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._records: dict[int, TransferRecord] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, transfer_id: int) -> bool:
        return transfer_id in self._records

    def add(self, transfer_id: int, timeout_s: float, state: TransferState = _S.ALLOCATED) -> TransferRecord:
        """Track a new transfer that must finish within ``timeout_s`` from now."""
        if transfer_id in self._records:
            raise ValueError(f"transfer {transfer_id} is already registered "
                             f"(state {self._records[transfer_id].state.name})")
        rec = TransferRecord(transfer_id, state, self._clock() + timeout_s)
        self._records[transfer_id] = rec
        return rec

    def get(self, transfer_id: int) -> TransferRecord:
        try:
            return self._records[transfer_id]
        except KeyError:
            raise KeyError(f"transfer {transfer_id} is not registered") from None

    def advance(self, transfer_id: int, new: TransferState, error: str = "") -> TransferRecord:
        """Move a transfer to ``new``; IllegalTransition names both states if the edge is absent."""
        rec = self.get(transfer_id)
        if new not in LEGAL[rec.state]:
            raise IllegalTransition(
                f"transfer {transfer_id}: illegal transition {rec.state.name} -> {new.name}")
        rec.state = new
        if error:
            rec.error = error
        return rec

    def fail(self, transfer_id: int, error: str) -> bool:
        """Fail a live transfer; returns False (no change) if it already finished."""
        rec = self.get(transfer_id)
        if rec.state.terminal:
            return False
        self.advance(transfer_id, _S.FAILED, error)
        return True

    def expired(self, now: float | None = None) -> list[int]:
        """Ids of live (non-terminal) transfers past their deadline, earliest deadline first."""
        t = self._clock() if now is None else now
        late = [r for r in self._records.values() if not r.state.terminal and r.deadline <= t]
        return [r.transfer_id for r in sorted(late, key=lambda r: (r.deadline, r.transfer_id))]

    def remove(self, transfer_id: int) -> TransferRecord:
        """Forget a transfer (normally after it reached a terminal state)."""
        rec = self.get(transfer_id)
        del self._records[transfer_id]
        return rec
