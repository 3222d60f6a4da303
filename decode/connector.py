"""The decode role's side of the engine: requests whose prompt KV a prefill worker writes.

:class:`DecodeConnector` is the scheduler's KVConnector on a decode worker (engine/connector.py):
a request the worker :meth:`~DecodeConnector.expect`-ed is not computed here; the scheduler
reserves a row, the decode tree's cached prefix (its normal match and component vote) and slots
for the rest, and the connector turns them into a :class:`Reservation` (worker/receiving.py).
A request marked :meth:`~DecodeConnector.hold` keeps its KV when it finishes normally (its reply
is pushed to a prefill worker, then released). :class:`DecodeHandle` is
how the decode worker (asyncio, another thread) reaches it:

    receive(greq, on_chunk) -> Future[Reservation | ComputeHere | None]
                                queue the request; its Reservation once reserved (None: it
                                ended first, its final chunk says why; HERE: the connector's
                                ``rule(rid, LocalRule)``, asked as it is queued, prefills it here)
    land(rid, first_token, first_logprob) / land_resumed(rid)
                                the KV landed: decode from here (chunks go to on_chunk) from
                                prefill's first token, or, for a resumed request
                                (``greq.resume``), from the tokens it came with
    cancel(rid, why)            free the reserved pages: only once no write into them is in flight
    page_digest(regions)        digest of the received regions' pages (``--kv-digest``)
    migrate(rid)                live migration, the source side: end rid here ("migrated", its
                                stream's last chunk), holding its KV; then held_pages(rid, start)
                                and release_held(rid) once it was copied to the new worker

For a hybrid model the reservation also names the SWA rows of the window decode keeps past
``prefix_len`` (the window before it is the tree's own, locked) and the working state row (the
recurrent state at the prompt's end, never the checkpoint at the hit).
"""

from __future__ import annotations

from tandem.decode.local_prefill import LocalRule
from tandem.worker.receiving import Keep, ReceivingConnector, ReceivingHandle, Reservation

__all__ = ["DecodeConnector", "DecodeHandle", "Reservation"]


class DecodeConnector(ReceivingConnector):
    """Engine thread, except :meth:`expect`, :meth:`forget`, :meth:`rule`, :meth:`hold` and
    :meth:`unhold` (any thread)."""

    def __init__(self, engine):
        super().__init__(engine)
        self._hold: set[str] = set()   # requests whose KV is held when they finish normally
        self._held: set[str] = set()   # ... that did finish so: held until a Release
        self._rules: dict[str, LocalRule] = {}   # expected requests that may be prefilled here

    def rule(self, rid: str, rule: LocalRule) -> None:
        """Before expected ``rid`` is submitted: it is prefilled here instead when ``rule`` says so
        as it is queued (its receive's answer is then ``HERE``)."""
        with self._lock:
            self._rules[rid] = rule

    def forget(self, rid: str) -> None:
        with self._lock:
            self._rules.pop(rid, None)
        super().forget(rid)

    def computes_here(self, rid: str, ids: list[int]) -> bool:
        with self._lock:
            rule = self._rules.pop(rid, None)
        return rule is not None and rule.here(len(ids), self.cached_prefix(ids))

    def hold(self, rid: str) -> None:
        """``rid``'s KV is held when it finishes "stop" or "length" (its reply is pushed to a
        prefill worker, then Released). Call :meth:`unhold` once its stream ended."""
        with self._lock:
            self._hold.add(rid)

    def unhold(self, rid: str) -> bool:
        """Undo :meth:`hold`; True when ``rid`` already finished held (the caller Releases it)."""
        with self._lock:
            self._hold.discard(rid)
            if rid in self._held:
                self._held.discard(rid)
                return True
            return False

    def keeps(self, rid: str, reason: str) -> Keep:
        """Holds the KV of a request that migrated (until the new worker has copied it), and of
        one marked :meth:`hold` that finished normally (until its push ended; its sequence is
        cached now, so later requests here hit it while it is held)."""
        with self._lock:
            held = rid in self._hold and reason in ("stop", "length")
            self._hold.discard(rid)
            if held:
                self._held.add(rid)
        if held:
            return Keep.HELD_CACHED
        return Keep.HELD if reason == "migrated" else Keep.NO


class DecodeHandle(ReceivingHandle):
    """``receive``, ``cancel``, ``page_digest``: worker/receiving.py; ``land``, ``land_resumed``,
    ``migrate``, ``held_pages``, ``release_held``: engine/handle.py."""

    ROLE, CONNECTOR = "decode", DecodeConnector
    connector: DecodeConnector
