"""What the router knows of one worker's load (router/dispatch.py keeps one per worker)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from . import metrics as rm
from .view import PREFILL, WorkerSnapshot, WorkerView


@dataclass(slots=True)
class Queued:
    """One request queued on a prefill worker, as the router counted it."""

    new_tokens: int                 # prompt tokens the prefill is expected to compute
    since: float                    # dispatched at (the dispatcher's clock)
    route: Any = None               # the dispatcher's Route, while it waits (wait_ahead)


@dataclass
class WorkerLoad:
    """What the router knows of one worker's load: its own records of what it routed there
    (requests, KV tokens, the prefill queue and its measured rate) and the worker's latest
    snapshot; :meth:`view` is what the policies see of it."""

    name: str
    role: str
    capacity_tokens: int
    alive: bool = True
    suspect: bool = False           # making no progress (a hang, not a death): no new requests
    requests: int = 0
    tokens: int = 0
    queue: OrderedDict = field(default_factory=OrderedDict)   # prefill: rid -> Queued, in order
    queued_new: int = 0             # sum of queue's new_tokens
    rate: float | None = None       # measured prefill tokens per second
    last_done: float = float("-inf")
    snapshot: WorkerSnapshot | None = None

    def charge(self, requests: int, tokens: int) -> None:
        """Add ``requests`` and ``tokens`` routed here (negative: released)."""
        self.requests += requests
        self.tokens += tokens
        if requests:
            rm.WORKER_LOAD.labels(self.name, self.role).set(self.requests)

    def pending_s(self, now: float, prior_rate: float) -> float:
        """Seconds of prefill queued here (the snapshot's, else from the records at the measured
        rate, ``prior_rate`` tokens/s before one was measured)."""
        snap = self.snapshot
        if snap is not None and snap.pending_s is not None:
            return snap.pending_s
        rate = self.rate or prior_rate
        records = 0.0
        if self.queue:
            head = next(iter(self.queue.values()))
            in_service = max(now - max(head.since, self.last_done), 0.0)
            records = (self.queued_new - head.new_tokens) / rate + max(head.new_tokens / rate - in_service, 0.0)
        if snap is None or snap.waiting_prompt_tokens is None:
            return records
        since = sum(q.new_tokens for q in self.queue.values() if q.since > snap.at)
        return max(records, (snap.waiting_prompt_tokens + since) / rate)

    def queue_len(self) -> int:
        snap = self.snapshot
        if snap is None:
            return self.requests
        since = sum(1 for q in self.queue.values() if q.since > snap.at)
        return max(self.requests, snap.waiting + since)

    def view(self, wid: int, now: float, eligible: bool, prior_rate: float) -> WorkerView:
        snap = self.snapshot
        capacity = snap.total_tokens if snap is not None and snap.total_tokens else self.capacity_tokens
        prefill = self.role == PREFILL
        draining = snap is not None and snap.draining
        return WorkerView(wid, self.role, self.alive and not self.suspect and eligible and not draining,
                          queue_len=self.queue_len() if prefill else 0,
                          in_flight=self.requests, running_tokens=self.tokens,
                          pending_s=self.pending_s(now, prior_rate) if prefill else 0.0, capacity_tokens=capacity,
                          key=self.name)
