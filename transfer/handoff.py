"""Handoff: one request's KV handoff on one side, a :class:`TransferState` moved by named verbs
along core/transfer_state.py's edges (:class:`IllegalTransition` otherwise). Destination pages are
free only in FAILED or ABORTED (:attr:`Handoff.pages_free`). No I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.core.transfer_state import LEGAL, IllegalTransition, TransferState

_S = TransferState


@dataclass(eq=False)
class Handoff:
    rid: str
    transfer_id: int = 0
    state: TransferState = _S.ALLOCATED
    deadline: float = math.inf
    error: str = ""
    aborted: bool = False

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
        """Fail with ``why`` (the first wins); :attr:`pages_free` (False while a write may be in flight:
        :meth:`settle` ends it)."""
        if self.state.terminal:
            return False
        if not self.error:
            self.error, self.aborted = why, aborted
        if self.state is not _S.TRANSFERRING:
            self._move(_S.ABORTED if self.aborted else _S.FAILED, "fail")
        return self.pages_free

    def settle(self, in_flight: bool) -> bool:
        """The writer's call ended (``in_flight``: a write may still land); :attr:`pages_free`."""
        if not self.error:
            raise IllegalTransition(f"handoff {self.rid}: settle in {self.state.name} with no failure")
        if self.state is _S.TRANSFERRING:
            self._move(_S.QUARANTINED if in_flight else (_S.ABORTED if self.aborted else _S.FAILED),
                       "settle")
        return self.pages_free

    @property
    def pages_free(self) -> bool:
        """No write into the destination pages is in flight and they hold no valid KV."""
        return self.state in (_S.FAILED, _S.ABORTED)

    @property
    def live(self) -> bool:
        return not self.state.terminal

    def _move(self, new: TransferState, verb: str) -> None:
        if new not in LEGAL[self.state]:
            raise IllegalTransition(f"handoff {self.rid} (transfer {self.transfer_id}): {verb} is an "
                                    f"illegal transition {self.state.name} -> {new.name}")
        self.state = new
