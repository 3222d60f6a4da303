"""One request's life on the router: :class:`RequestStream`, its :class:`Attempt` state (moved
along :data:`LEGAL` only) and its failure table (:data:`FAILURES`: a :class:`Failure` -> the method
that decides the :class:`Next` step). What the stream has sent the client (ids, characters, cached
tokens) lives on its current :class:`~tandem.cluster.legs.Legs` (``legs``), whose ``worker`` is where
the request is now: the backend's ``streams`` are the one place that says so.

    ROUTED ──► STREAMING ──► MOVING | RESUMING ──► STREAMING ... ──► DONE | FAILED
       └──► REDISPATCHING ──► ROUTED                 (nothing sent yet: routed again)

A new behaviour is one method returning a :class:`Step` and one row of :data:`FAILURES`
(tests/cluster/test_stream.py adds one).
"""

from __future__ import annotations

import dataclasses
import time
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.cluster.legs import Legs
    from tandem.core.types import StreamChunk


class Attempt(Enum):
    ROUTED = "routed"                # a route; nothing streamed yet
    STREAMING = "streaming"          # tokens reach the client from the current leg
    MOVING = "moving"                # a live migration's next leg (cluster/moves.py has its phases)
    RESUMING = "resuming"            # its worker died or stalled: resumed on a peer after what was sent
    REDISPATCHING = "redispatching"  # nothing was sent: routed again without the failed worker
    DONE = "done"
    FAILED = "failed"


class IllegalAttempt(RuntimeError):
    pass


LEGAL: dict[Attempt, frozenset[Attempt]] = {
    Attempt.ROUTED: frozenset({Attempt.STREAMING, Attempt.MOVING, Attempt.REDISPATCHING, Attempt.DONE,
                               Attempt.FAILED}),
    Attempt.STREAMING: frozenset({Attempt.MOVING, Attempt.RESUMING, Attempt.REDISPATCHING, Attempt.DONE,
                                  Attempt.FAILED}),
    Attempt.MOVING: frozenset({Attempt.STREAMING, Attempt.RESUMING, Attempt.DONE, Attempt.FAILED}),
    Attempt.RESUMING: frozenset({Attempt.STREAMING, Attempt.MOVING, Attempt.DONE, Attempt.FAILED}),
    Attempt.REDISPATCHING: frozenset({Attempt.ROUTED, Attempt.FAILED}),
}
TERMINAL = frozenset(Attempt) - frozenset(LEGAL)


class Failure(Enum):
    """What went wrong under a stream, as the backend sees it."""

    DECODE_DIED = "decode_died"          # the decode worker's actor died (RayActorError)
    PREFILL_DIED = "prefill_died"        # the prefill worker died before the first token
    DECODE_STALLED = "decode_stalled"    # the decode worker stopped making progress (suspect)
    PREFILL_STALLED = "prefill_stalled"  # the prefill worker did, while the first token was due
    TRANSFER_STALLED = "transfer_stalled"  # the prefill worker held the KV write past the deadline


class Next(Enum):
    RESUME = "resume"          # continue on a live decode worker after what the client has
    REDISPATCH = "redispatch"  # route again without the failed worker, from the prompt
    FAIL = "fail"              # one error event (``Step.why``)


@dataclasses.dataclass(frozen=True)
class Step:
    next: Next
    why: str = ""


# The failure table: each Failure -> the RequestStream method that decides what comes next.
FAILURES: dict[Failure, str] = {
    Failure.DECODE_DIED: "failover",
    Failure.PREFILL_DIED: "redispatch",
    Failure.DECODE_STALLED: "resume_or_redispatch",
    Failure.PREFILL_STALLED: "redispatch",
    Failure.TRANSFER_STALLED: "redispatch",
}


class RequestStream:
    """The router's one owner of a client request's attempts. ``sent``: tokens the client has (the
    backend updates it); ``max_failovers``: resumes after a death; ``max_attempts``: routes in all
    (a death before anything was sent costs one re-route, once). Decisions only: the backend acts."""

    failures: dict[Failure, str] = FAILURES

    def __init__(self, rid: str, *, max_failovers: int = 2, max_attempts: int = 3, failover_wait_s: float = 30.0):
        self.rid, self.max_failovers, self.max_attempts = rid, max_failovers, max_attempts
        self.failover_wait_s = failover_wait_s
        self.state = Attempt.ROUTED
        self.sent = 0           # tokens the client has
        self.began = False      # a chunk reached the client (then it is never routed again)
        self.attempt = 0        # 0-based route number
        self.failovers = 0      # resumes after a death
        self.died = False       # a worker died before anything was sent (one re-route for that)
        self.wire_rid = rid     # the current attempt's worker-side id (``rid~n`` after a re-dispatch)
        self.last_token_at = time.monotonic()   # the last token sent (or when the attempt began)
        self.legs: Legs | None = None   # the current attempt's Legs (its ``worker``: where it is now); None between
        self.history: list[tuple[Attempt, Attempt]] = []

    def to(self, state: Attempt) -> None:
        """IllegalAttempt, changing nothing, unless ``state`` is a legal next state (or the same one)."""
        if state is self.state:
            return
        if state not in LEGAL.get(self.state, ()):
            raise IllegalAttempt(f"request {self.rid}: {self.state.name} -> {state.name}")
        self.history.append((self.state, state))
        self.state = state

    def sent_chunk(self, c: StreamChunk, sent: int, last_token_at: float) -> None:
        """``c`` goes to the client, which then has ``sent`` tokens: what this stream has sent, and
        its state, follow."""
        self.began, self.sent = True, sent
        if c.token_ids:
            self.last_token_at = last_token_at
        if c.finish_reason is not None:
            self.to(Attempt.FAILED if c.error else Attempt.DONE)
        elif c.token_ids:
            self.to(Attempt.STREAMING)

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL

    def on_failure(self, kind: Failure, worker: str) -> Step:
        """What comes next after ``kind`` on the worker named ``worker`` (the table's method)."""
        step: Step = getattr(self, self.failures[kind])(kind, worker)
        return step

    # --- the table's methods -------------------------------------------------------------------

    def failover(self, kind: Failure, worker: str) -> Step:
        """A decode worker died. Nothing sent yet: routed again (as any death before serving); else
        resumed on a live peer while ``max_failovers`` allows."""
        if not self.sent:
            return self.redispatch(kind, worker)
        if self.failovers >= self.max_failovers:
            n = self.max_failovers
            return Step(Next.FAIL, f"decode worker {worker} died during the request" + (
                f"; not resumed: it already failed over {n} time{'s' * (n != 1)} (--max-failovers {n})"
                if n else " (--max-failovers 0: no failover)"))
        self.failovers += 1
        return Step(Next.RESUME)

    def redispatch(self, kind: Failure, worker: str) -> Step:
        """Nothing reached the client: routed again without ``worker`` while attempts are left (a
        death costs that only once)."""
        died = kind in (Failure.DECODE_DIED, Failure.PREFILL_DIED)
        role = "decode" if kind in (Failure.DECODE_DIED, Failure.DECODE_STALLED) else "prefill"
        if self.began or self.attempt >= self.max_attempts - 1 or (died and self.died):
            what = "died" if died else "stopped making progress"
            return Step(Next.FAIL, f"{role} worker {worker} {what} during the request")
        self.died = self.died or died
        return Step(Next.REDISPATCH)

    def resume_or_redispatch(self, kind: Failure, worker: str) -> Step:
        """A stuck decode worker: resumed on a peer after what was sent, else routed again."""
        if self.sent:
            return Step(Next.RESUME)
        return self.redispatch(kind, worker)

    # --- what the backend reports ------------------------------------------------------------

    def rerouted(self) -> None:
        """A REDISPATCH was carried out: a new route, under a new worker-side id (``rid~n``: the old
        one may still be aborted or tombstoned where it ran), nothing sent on it yet."""
        self.attempt += 1
        self.began, self.sent, self.wire_rid = False, 0, f"{self.rid}~{self.attempt}"
        self.to(Attempt.REDISPATCHING)
        self.to(Attempt.ROUTED)

    def view(self) -> dict[str, Any]:
        return {"rid": self.rid, "state": self.state.value, "sent": self.sent, "attempt": self.attempt,
                "failovers": self.failovers}
