"""What a routing policy sees: a snapshot of the workers, and the request being routed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

PREFILL = "prefill"
DECODE = "decode"


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the router sees it at decision time."""

    worker_id: int
    role: str                       # PREFILL or DECODE
    alive: bool = True              # health checks pass; a dead worker is never chosen
    queue_len: int = 0              # requests waiting (not yet computing)
    in_flight: int = 0              # requests dispatched and not finished (waiting + running)
    running_tokens: int = 0         # prefill: uncomputed prompt tokens queued or computing;
                                    # decode: KV tokens held by running requests
    pending_s: float = 0.0          # predicted seconds of work ahead of a new request (queue + rest
                                    # of the current batch): the queueing part of a predicted TTFT
    capacity_tokens: int = 0        # KV tokens the worker can hold (0 = unknown)
    key: str = ""                   # a name every router knows it by (the actor's name): what
                                    # rendezvous hashing of sessions ranks, so routers agree

    @property
    def load(self) -> int:
        """The load SGLang's router compares: requests dispatched and not finished."""
        return self.in_flight


@dataclass(frozen=True, slots=True)
class ClusterView:
    """All workers, split by role, in a stable order (worker id order)."""

    prefill: tuple[WorkerView, ...]
    decode: tuple[WorkerView, ...]
    now: float = 0.0                # seconds, the view builder's clock (session last-touched)

    @classmethod
    def of(cls, workers: Sequence[WorkerView], now: float = 0.0) -> "ClusterView":
        ws = sorted(workers, key=lambda w: w.worker_id)
        return cls(tuple(w for w in ws if w.role == PREFILL),
                   tuple(w for w in ws if w.role == DECODE), now)

    def alive_prefill(self) -> list[WorkerView]:
        return [w for w in self.prefill if w.alive]

    def alive_decode(self) -> list[WorkerView]:
        return [w for w in self.decode if w.alive]


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """The request being routed."""

    request_id: str
    key: Sequence[int]
    prompt_tokens: int
    key_unit: int = 1
    session_id: str | None = None   # explicit (X-Session-Id / session_id field)
    fingerprint: int | None = None  # sessions.fingerprint() of the conversation's opening, or None
    max_tokens: int = 0             # output budget (decode load estimate)
    block_hashes: tuple[int, ...] | None = None   # the key's chained block hashes at the engines'

    @property
    def session_key(self) -> str | int | None:
        """What the session table is keyed by: the explicit id, else the fingerprint."""
        return self.session_id if self.session_id is not None else self.fingerprint


@dataclass(frozen=True, slots=True)
class Decision:
    prefill_worker: int             # worker id; -1 = none (no alive prefill worker)
    decode_worker: int              # worker id; -1 = none
    reason: str                     # short tag for logs and metrics, e.g. "sticky", "prefix", "load"
    matched_tokens: int = 0         # prompt tokens the policy expects the prefill worker to hold
    predicted_ttft_s: float = 0.0   # the policy's estimate (0 when it makes none)


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """What a worker last reported about itself (the health monitor refreshes it from the actor's
    ``stats()``; a simulated worker reports its own state)."""

    at: float = 0.0                 # the dispatcher's clock when the report was taken
    waiting: int = 0                # requests queued in the worker's scheduler
    running: int = 0                # requests computing
    total_tokens: int = 0           # device KV tokens of its pool (0 = unknown)
    available_tokens: int = 0       # free device KV tokens
    waiting_prompt_tokens: int | None = None   # prompt tokens queued, not yet admitted (None:
                                    # not reported)
    pending_s: float | None = None  # the worker's own prediction of queued work (seconds), when it
                                    # makes one (simulated workers); None: the dispatcher estimates it
    draining: bool = False          # the planner drains it: no new requests (from any router)

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any], at: float) -> "WorkerSnapshot":
        """From a prefill/decode actor's ``stats()`` dict (the fields' names). Missing keys read as
        0 or None; a value of the wrong type is a ValueError naming the key."""
        def num(key: str, kind=int):
            v = stats.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"worker stats[{key!r}] = {v!r} is not a number")
            return kind(v)

        def optional(key: str, kind):
            return None if stats.get(key) is None else num(key, kind)

        return cls(at, num("waiting"), num("running"), num("total_tokens"), num("available_tokens"),
                   optional("waiting_prompt_tokens", int), optional("pending_s", float),
                   bool(stats.get("draining", False)))
