"""A KV transfer's states and their legal edges (diagram: core/README.md): a handoff's state, a
write's poll answer and a result's status. QUARANTINED: a write may still be in flight, so the
pages are never reused.
"""

from __future__ import annotations

import enum


class TransferState(enum.Enum):
    ALLOCATED = "allocated"
    BOOTSTRAPPED = "bootstrapped"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"
    QUARANTINED = "quarantined"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_S = TransferState
_TERMINAL = frozenset({_S.DONE, _S.FAILED, _S.ABORTED, _S.QUARANTINED})
LEGAL: dict[TransferState, frozenset[TransferState]] = {
    _S.ALLOCATED: frozenset({_S.BOOTSTRAPPED, _S.FAILED, _S.ABORTED}),
    _S.BOOTSTRAPPED: frozenset({_S.TRANSFERRING, _S.FAILED, _S.ABORTED}),
    _S.TRANSFERRING: frozenset({_S.DONE, _S.FAILED, _S.ABORTED, _S.QUARANTINED, _S.BOOTSTRAPPED}),
    **{s: frozenset() for s in _TERMINAL},
}


class IllegalTransition(ValueError):
    """A transfer was moved along an edge the state machine does not have."""
