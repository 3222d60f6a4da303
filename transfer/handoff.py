"""Handoff: one request's KV handoff on one side (the decode worker receiving, the prefill worker
sending). Its only state is a :class:`TransferState`, moved by named verbs along the edges of
``transfer/state.py``; any other move raises :class:`IllegalTransition` naming both states.

Verbs (receiving side; the sending side starts at BOOTSTRAPPED, when the request and its page list
arrive, and uses send / land / fail / settle)::

    Handoff(rid)                  ALLOCATED      pages reserved
    bootstrap(transfer_id)        -> BOOTSTRAPPED a transfer id, the page list goes to the writer
    send()                        -> TRANSFERRING a write may land from now on
    land()                        -> DONE         the write completed (and was verified)
    redispatch(transfer_id)       -> BOOTSTRAPPED the writer died before writing: another one, same pages
    fail(why, aborted)            the request failed: terminal now if nothing was posted, else the
                                  error waits (the state stays TRANSFERRING) for
    settle(in_flight)             the writer's call ended: -> FAILED | ABORTED, or QUARANTINED when
                                  it says a write may still be in flight

The rule every caller relies on lives here and nowhere else: :attr:`Handoff.pages_free` --
destination pages are freed only in FAILED or ABORTED (no write into them is in flight and they
never became valid KV); DONE pages belong to the request, QUARANTINED pages are never reused.
No I/O, no clock of its own: deadlines are the caller's numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.transfer.state import LEGAL, IllegalTransition, TransferState

_S = TransferState


@dataclass(eq=False)
class Handoff:
    rid: str
    transfer_id: int = 0
    state: TransferState = _S.ALLOCATED
    deadline: float = math.inf
    error: str = ""
    aborted: bool = False          # the error is a client/router abort (ends ABORTED, not FAILED)

    # -- verbs ------------------------------------------------------------------------------------
    def bootstrap(self, transfer_id: int) -> None:
        self._move(_S.BOOTSTRAPPED, "bootstrap")
        self.transfer_id = transfer_id

    def send(self) -> None:
        self._move(_S.TRANSFERRING, "send")

    def land(self) -> None:
        if self.error:
            raise IllegalTransition(f"handoff {self.rid}: land after it failed ({self.error})")
        self._move(_S.DONE, "land")

    def redispatch(self, transfer_id: int) -> None:
        """Only when the writer is dead (nothing of its write can land)."""
        if self.error:
            raise IllegalTransition(f"handoff {self.rid}: redispatch after it failed ({self.error})")
        self._move(_S.BOOTSTRAPPED, "redispatch")
        self.transfer_id = transfer_id

    def fail(self, why: str, aborted: bool = False) -> bool:
        """The request failed with ``why`` (the first reason wins). Returns :attr:`pages_free`:
        True when nothing was posted (the handoff ends now), False while a write may be in
        flight (TRANSFERRING: :meth:`settle` ends it) or when it had ended already."""
        if self.state.terminal:
            return False
        if not self.error:
            self.error, self.aborted = why, aborted
        if self.state is not _S.TRANSFERRING:
            self._move(_S.ABORTED if self.aborted else _S.FAILED, "fail")
        return self.pages_free

    def settle(self, in_flight: bool) -> bool:
        """The writer's call for this transfer ended (returned or raised), after :meth:`fail`.
        ``in_flight``: its answer says a write may still land. Returns :attr:`pages_free`."""
        if not self.error:
            raise IllegalTransition(f"handoff {self.rid}: settle in {self.state.name} with no failure")
        if self.state is _S.TRANSFERRING:
            self._move(_S.QUARANTINED if in_flight else (_S.ABORTED if self.aborted else _S.FAILED),
                       "settle")
        return self.pages_free

    # -- what callers may do ----------------------------------------------------------------------
    @property
    def pages_free(self) -> bool:
        """The destination pages may be freed: no write into them is in flight and they hold no
        valid KV. The one place this rule is written."""
        return self.state in (_S.FAILED, _S.ABORTED)

    @property
    def live(self) -> bool:
        return not self.state.terminal

    def _move(self, new: TransferState, verb: str) -> None:
        if new not in LEGAL[self.state]:
            raise IllegalTransition(f"handoff {self.rid} (transfer {self.transfer_id}): {verb} is an "
                                    f"illegal transition {self.state.name} -> {new.name}")
        self.state = new
