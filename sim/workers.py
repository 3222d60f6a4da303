"""Simulated prefill and decode workers. Time is passed in; nothing here sleeps or schedules."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tandem.router.policies import RouterState
from tandem.router.prefix_index import KVEvent
from tandem.router.view import DECODE, PREFILL, WorkerSnapshot, WorkerView
from tandem.sim.cost_model import Profile


@dataclass(slots=True)
class SimRequest:
    rid: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    key: list[int]
    # filled as the request moves through the cluster
    prefill_worker: int = -1
    decode_worker: int = -1
    reason: str = ""
    cached_tokens: int = 0
    pred_s: float = 0.0
    pred_new: int = 0
    prefill_start: float = -1.0
    prefill_end: float = -1.0
    ttft_at: float = -1.0
    decode_join: float = -1.0
    finish: float = -1.0
    remaining: int = 0
    ctx: int = 0

    @property
    def ttft(self) -> float:
        return self.ttft_at - self.arrival


@dataclass
class WorkerStats:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    busy_s: float = 0.0
    max_queue: int = 0
    tokens_out: int = 0


class PrefillWorker:
    def __init__(self, wid: int, profile: Profile, cache, unit: int):
        self.id = wid
        self.profile = profile
        self.cache = cache
        self.unit = unit
        self.alive = True
        self.queue: deque[SimRequest] = deque()
        self.current: SimRequest | None = None
        self._node: Any = None         # the cache node the running prefill holds locked
        self.busy_until = 0.0
        self._queued_s = 0.0
        self._queued_new = 0
        self.stats = WorkerStats()

    def _hit(self, req: SimRequest) -> tuple[int, object]:
        r = self.cache.match(req.key)
        # a fully cached prompt still computes its last token (the logits of the first output)
        hit = min(len(r.device_indices) * self.unit, req.prompt_tokens - 1)
        return max(hit, 0), r.last_device_node

    def enqueue(self, req: SimRequest, now: float, expected_hit: int = 0) -> None:
        """Queue ``req``. Its predicted prefill time (what ``pending_s`` sums, as Mooncake's
        Conductor sums its own predictions) uses the router's ``expected_hit`` tokens; the
        cache is not consulted until the prefill starts."""
        hit = min(max(expected_hit, 0), req.prompt_tokens - 1)
        req.pred_new = req.prompt_tokens - hit
        req.pred_s = self.profile.prefill_s(req.pred_new, hit)
        self._queued_s += req.pred_s
        self._queued_new += req.pred_new
        self.queue.append(req)
        self.stats.max_queue = max(self.stats.max_queue, len(self.queue))

    def remove(self, req: SimRequest) -> bool:
        """Take a still-queued ``req`` out of the queue (an abort); False when it is not queued."""
        try:
            self.queue.remove(req)
        except ValueError:
            return False
        self._queued_s -= req.pred_s
        self._queued_new -= req.pred_new
        return True

    def start(self, now: float) -> float | None:
        """Start the next queued request if idle; returns when its prefill ends."""
        if self.current is not None or not self.queue:
            return None
        req = self.queue.popleft()
        self._queued_s -= req.pred_s
        self._queued_new -= req.pred_new
        hit, node = self._hit(req)
        self.cache.lock(node)
        dur = self.profile.prefill_s(req.prompt_tokens - hit, hit)
        req.cached_tokens = hit
        req.prefill_start = now
        req.prefill_end = now + dur
        self.current, self._node = req, node
        self.busy_until = req.prefill_end
        s = self.stats
        s.requests += 1
        s.prompt_tokens += req.prompt_tokens
        s.hit_tokens += hit
        s.busy_s += dur
        return self.busy_until

    def finish(self, now: float) -> SimRequest:
        """The running prefill is done: cache its pages, unlock its prefix, hand it back."""
        req, node = self.current, self._node
        if req is None:
            raise RuntimeError(f"prefill worker {self.id}: finish() with no prefill running")
        self.cache.insert(req.key)
        self.cache.unlock(node)
        self.current = self._node = None
        return req

    def pending_s(self, now: float) -> float:
        rest = self.busy_until - now if self.current is not None else 0.0
        return max(rest, 0.0) + self._queued_s

    def view(self, now: float) -> WorkerView:
        running = self._queued_new
        cur = self.current
        if cur is not None:
            dur = cur.prefill_end - cur.prefill_start
            left = (cur.prefill_end - now) / dur if dur > 0 else 0.0
            running += int((cur.prompt_tokens - cur.cached_tokens) * max(left, 0.0))
        return WorkerView(self.id, PREFILL, self.alive, len(self.queue),
                          len(self.queue) + (cur is not None), running, self.pending_s(now))

    def snapshot(self, now: float) -> WorkerSnapshot:
        """Queue, running and this worker's own ``pending_s`` (its pool size is the caller's)."""
        return WorkerSnapshot(now, len(self.queue), int(self.current is not None), pending_s=self.pending_s(now))


class DecodeWorker:
    def __init__(self, wid: int, profile: Profile, capacity_tokens: int):
        self.id = wid
        self.profile = profile
        self.capacity = capacity_tokens
        self.alive = True
        self.reserved = 0
        self.waiting: deque[SimRequest] = deque()
        self.inbound = 0
        self.running: list[SimRequest] = []
        self.joining: list[SimRequest] = []
        self.stepping = False
        self._ctx = 0
        self.peak_reserved = 0
        self.stats = WorkerStats()

    @staticmethod
    def _need(req: SimRequest) -> int:
        return req.prompt_tokens + req.output_tokens

    def reserve(self, req: SimRequest) -> bool:
        """Reserve KV room for ``req`` (prompt + output). False: it waits in ``waiting``
        (in order; a request larger than the whole pool is admitted alone)."""
        need = self._need(req)
        if not self.waiting and (self.reserved + need <= self.capacity or self.reserved == 0):
            self.reserved += need
            self.inbound += 1
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            return True
        self.waiting.append(req)
        self.stats.max_queue = max(self.stats.max_queue, len(self.waiting))
        return False

    def join(self, req: SimRequest, now: float) -> bool:
        """``req``'s KV arrived. Returns True when the worker was idle (schedule a step now)."""
        self.inbound -= 1
        req.decode_join = now
        req.remaining = req.output_tokens - 1
        req.ctx = req.prompt_tokens + 1
        self.stats.requests += 1
        self.stats.prompt_tokens += req.prompt_tokens
        self.joining.append(req)
        if self.stepping:
            return False
        self.stepping = True
        return True

    def step(self, now: float) -> tuple[list[SimRequest], list[SimRequest], float | None]:
        """A step boundary at ``now``: the batch that ran since the last boundary emits a token
        each; finished requests leave. Returns ``(finished, newly admitted waiters, next
        boundary or None when idle)``."""
        done = []
        if self.running:
            keep = []
            for r in self.running:
                r.remaining -= 1
                r.ctx += 1
                if r.remaining <= 0:
                    r.finish = now
                    done.append(r)
                    self.reserved -= self._need(r)
                    self._ctx -= r.ctx - 1
                else:
                    keep.append(r)
            self._ctx += len(keep)
            self.stats.tokens_out += len(self.running)
            self.running = keep
        for r in self.joining:
            if r.remaining <= 0:
                r.finish = now
                done.append(r)
                self.reserved -= self._need(r)
            else:
                self.running.append(r)
                self._ctx += r.ctx
        self.joining = []
        admitted = []
        while self.waiting and (self.reserved + self._need(self.waiting[0]) <= self.capacity
                                or self.reserved == 0):
            r = self.waiting.popleft()
            self.reserved += self._need(r)
            self.inbound += 1
            admitted.append(r)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        if not self.running:
            self.stepping = False
            return done, admitted, None
        dt = self.profile.decode_step_s(len(self.running), self._ctx)
        self.stats.busy_s += dt
        return done, admitted, now + dt

    def view(self, now: float) -> WorkerView:
        return WorkerView(self.id, DECODE, self.alive, len(self.waiting),
                          len(self.running) + len(self.joining) + self.inbound + len(self.waiting),
                          self.reserved, 0.0, self.capacity)

    def snapshot(self, now: float) -> WorkerSnapshot:
        return WorkerSnapshot(now, len(self.waiting), len(self.running) + len(self.joining),
                              self.capacity, max(self.capacity - self.reserved, 0))


class EventSink:
    """Stands in for the cache's ZMQ publisher: hands each stored/removed page straight to the
    router's global index (zero event delay), as ``worker_ids`` (all prefill workers when the
    cache is the shared global one)."""

    def __init__(self, state: RouterState, worker_ids: list[int]):
        self.state = state
        self.worker_ids = worker_ids

    def publish(self, events: Iterable) -> None:
        for e in events:
            hashes = tuple(getattr(e, "block_hashes", ()))
            kind = "cleared" if not hasattr(e, "block_hashes") else (
                "stored" if hasattr(e, "token_ids") else "removed")
            for w in self.worker_ids:
                self.state.kv.apply(KVEvent(w, kind, hashes, getattr(e, "num_tokens", 0),
                                            getattr(e, "medium", "device"),
                                            getattr(e, "parent_block_hash", None)))
