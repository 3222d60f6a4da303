"""The one vocabulary of a KV transfer's state, and its legal edges.

    ALLOCATED ──> BOOTSTRAPPED ──> TRANSFERRING ──> DONE
        │              │   ^             │ │
        │              │   └─redispatch──┘ └──> QUARANTINED
        └──────────────┴─────────────────┴────> FAILED | ABORTED

ALLOCATED: destination pages are reserved. BOOTSTRAPPED: the writer has (or is being sent) the page
list. TRANSFERRING: a write may be in flight (NIXL's "PROC"). DONE (NIXL's "DONE"): the write
landed. FAILED (NIXL's "ERR", an error, a deadline) and ABORTED (a client or router abort): the
handoff ended and no write of it is in flight. QUARANTINED: it ended while a write may still be in
flight, so its destination pages are never reused. Redispatch (TRANSFERRING -> BOOTSTRAPPED) is
for a writer that died before writing: nothing of its can land, another writer fills the same
pages. The same enum is a write's poll answer (transfer/agent.py maps NIXL's strings onto it) and a
prefill result's status; transfer/handoff.py moves a request's handoff along these edges.
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
