"""The one dispatcher every serving backend routes through: admission, the policy's choice, the load
it charges, re-routing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace

from tandem.core.messages import GenerateRequest
from tandem.core.types import Overloaded

from . import metrics as rm
from .planner import LatencyWindow
from .prefix_index import block_hashes
from .policies import (AdmissionLimits, PolicyConfig, RouterState, admit, choose, held_tokens, predicted_cached,
                       retry_after_s)
from .view import DECODE, PREFILL, ClusterView, Decision, RouteRequest, WorkerSnapshot
from .worker_load import Queued, WorkerLoad

RATE_EWMA = 0.25        # weight of the newest prefill-rate sample
AHEAD_MIN_TOKENS = 32   # a shared prefix worth waiting for (engine/sched/queue_policy.py's threshold)
_AHEAD_POLL_S = 0.005


@dataclass(eq=False)
class Route:
    """One routed request and what it holds (the dispatcher updates the holdings)."""

    request: RouteRequest
    decision: Decision
    decode: int                     # worker id; -1 = no live decode worker (nothing charged)
    prefill: int                    # worker id; -1 = none: the decode worker prefills locally
    decode_tokens: int = 0          # KV tokens charged on the decode worker
    decode_open: bool = False       # still charged on the decode worker
    prefill_open: bool = False      # still charged on the prefill worker
    routed_at: float = 0.0          # the dispatcher's clock at routing (TTFT)
    last_token_at: float | None = None   # the last ``grow`` (inter-token latency)
    predicted_cached: int = 0       # prompt tokens the router predicted the pair reuses (policies.py)
    ahead: "Route | None" = None    # a route still prefilling on the same worker, sharing a prefix
                                    # with this one longer than that worker reported holding (wait_ahead)
    prefilled: threading.Event = field(default_factory=threading.Event)   # set when it leaves prefill

    @property
    def rid(self) -> str:
        return self.request.request_id


class Dispatcher:
    def __init__(self, policy: str, config: PolicyConfig = PolicyConfig(),
                 limits: AdmissionLimits = AdmissionLimits(), *, clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self.state = RouterState(config)
        self.limits = limits
        self.clock = clock
        self.lock = threading.RLock()
        self._workers: dict[int, WorkerLoad] = {}
        self._groups: dict[str, tuple[Decision, int]] = {}   # group id -> (decision, members left)
        self._prior_rate = 1.0 / max(config.estimator.per_token_s, 1e-12)
        self.latency = LatencyWindow(clock=clock)
        self.on_capacity: Callable[[], None] | None = None   # called when load is released

    def add_worker(self, wid: int, role: str, name: str, capacity_tokens: int = 0) -> None:
        """A worker joins the rotation (its load gauge starts at 0)."""
        if role not in (PREFILL, DECODE):
            raise ValueError(f"worker {name}: role must be {PREFILL!r} or {DECODE!r}, got {role!r}")
        with self.lock:
            if wid in self._workers:
                raise ValueError(f"worker id {wid} ({name}) is already known as {self._workers[wid].name}")
            self._workers[wid] = WorkerLoad(name, role, capacity_tokens)
        rm.WORKER_LOAD.labels(name, role).set(0)

    def mark_dead(self, wid: int) -> bool:
        """Out of rotation at once; the router forgets what it knew about it. False when it was
        already dead (or unknown)."""
        with self.lock:
            w = self._workers.get(wid)
            if w is None or not w.alive:
                return False
            w.alive = False
            self.state.forget_worker(wid)
            return True

    def mark_suspect(self, wid: int, suspect: bool = True) -> bool:
        """A worker that stopped making progress (``suspect``) takes no new requests but keeps what
        the router knows of it (it may come back); ``suspect=False``: back in rotation."""
        with self.lock:
            w = self._workers.get(wid)
            if w is None or not w.alive or w.suspect == suspect:
                return False
            w.suspect = suspect
        if not suspect:
            self._released()
        return True

    def remove_worker(self, wid: int) -> None:
        """Forget a worker for good (replaced); its load gauge series goes too."""
        with self.lock:
            w = self._workers.pop(wid, None)
            if w is None:
                return
            self.state.forget_worker(wid)
        try:
            rm.WORKER_LOAD.remove(w.name, w.role)
        except KeyError:
            pass

    def snapshots(self) -> dict[int, WorkerSnapshot]:
        """Each worker's last report (workers that reported one)."""
        with self.lock:
            return {wid: w.snapshot for wid, w in self._workers.items() if w.snapshot is not None}

    def counts(self) -> dict[str, int]:
        """Workers in rotation per role: alive and not draining (the planner's current counts)."""
        with self.lock:
            out = {PREFILL: 0, DECODE: 0}
            for w in self._workers.values():
                if w.alive and not w.suspect and not (w.snapshot is not None and w.snapshot.draining):
                    out[w.role] += 1
            return out

    def update_snapshot(self, wid: int, snap: WorkerSnapshot) -> None:
        with self.lock:
            w = self._workers.get(wid)
            if w is not None:
                w.snapshot = snap

    def route(self, req: GenerateRequest, exclude: Collection[int] = ()) -> Route:
        """Admission, then the policy's choice among live workers not in ``exclude``; charges the
        chosen ones. Raises :class:`Overloaded` when every live prefill worker is past its limits."""
        hashes = None
        if self.state.kv.num_blocks():   # the KV-event index is fed: hash the prompt once, unlocked
            hashes = tuple(block_hashes(req.cache_key, self.state.config.kv_block_size))
        rr = RouteRequest(req.rid, req.cache_key, len(req.prompt_ids), session_id=req.session_id,
                          max_tokens=req.params.max_tokens, block_hashes=hashes)
        g = req.group
        if g is None or g.size <= 1:
            return self._route(rr, exclude)
        with self.lock:
            pinned = self._groups.get(g.id)
            if pinned is not None:
                dec, left = pinned
                if left > 1:
                    self._groups[g.id] = (dec, left - 1)
                else:
                    del self._groups[g.id]          # the group's last member
                if self._pinned_alive(dec, exclude):
                    return self._charge_route(rr, dec, self.view(exclude), shared_prompt=True)
            r = self._route(rr, exclude)
            if pinned is None and r.decode >= 0:
                self._groups[g.id] = (Decision(r.prefill, r.decode, "group",
                                               r.decision.matched_tokens), g.size - 1)
            return r

    def in_session(self, req: GenerateRequest) -> bool:
        """Whether ``req`` continues a session the table holds live (a later turn of a
        conversation the cluster has served), as opposed to one it has not seen."""
        if req.session_id is None:
            return False
        with self.lock:
            return self.state.sessions.get(req.session_id, self.clock()) is not None

    def reroute(self, r: Route, dead: int | Collection[int]) -> Route:
        """``r``'s charges back, then ``r`` routed again without ``dead`` (a worker id, or several:
        every worker an earlier attempt found dead or stalled), admission included."""
        self.release(r)
        return self._route(r.request, {dead} if isinstance(dead, int) else set(dead))

    def move(self, r: Route, to: int) -> None:
        """``r`` moved to decode worker ``to`` (live migration): its decode charges go with it,
        and its session's next turn goes there (where its KV now is)."""
        with self.lock:
            if r.decode_open:
                old, new = self._workers.get(r.decode), self._workers.get(to)
                if old is not None:
                    old.charge(-1, -r.decode_tokens)
                if new is not None:
                    new.charge(1, r.decode_tokens)
            r.decode = to
            key, now = r.request.session_key, self.clock()
            e = self.state.sessions.get(key, now)
            if e is not None:
                self.state.sessions.bind(key, e.prefill_worker, to, now)
        self._released()

    def prefill_done(self, r: Route) -> None:
        """The first token is out: release ``r`` on its prefill worker and time that prefill."""
        with self.lock:
            if r.last_token_at is None and r.decode_open:
                now = self.clock()
                self.latency.ttft(now - r.routed_at)
                r.last_token_at = now
            if r.prefill_open:
                self._leave_prefill(r, measure=True)
        self._released()

    def grow(self, r: Route, tokens: int) -> None:
        """``r`` holds ``tokens`` more KV tokens on its decode worker."""
        with self.lock:
            w = self._workers.get(r.decode)
            if w is not None and r.decode_open:
                w.tokens += tokens
                r.decode_tokens += tokens
                now = self.clock()
                if r.last_token_at is not None and tokens > 0 and r.decode_tokens > r.request.prompt_tokens + tokens:
                    self.latency.itl((now - r.last_token_at) / tokens)
                r.last_token_at = now

    async def wait_ahead(self, r: Route, timeout_s: float) -> None:
        """Before ``r`` is sent: the route its predicted reuse rests on (``r.ahead``) leaves
        prefill first (its first token, or its end), at most ``timeout_s``. Requests sharing a
        prompt prefix then reach the prefill worker in the order they were routed, so the first
        computes the prefix and the later one reuses it, as predicted (the engine would make the
        later one wait for it anyway: engine/sched/queue_policy.py ``InStepPrefixes``)."""
        a = r.ahead
        end = time.monotonic() + timeout_s
        while a is not None and not a.prefilled.is_set() and time.monotonic() < end:
            await asyncio.sleep(_AHEAD_POLL_S)

    def reused(self, r: Route, cached_tokens: int) -> None:
        """``r``'s workers reused ``cached_tokens`` of its prompt (its usage): the router's
        prediction error, in tokens, goes to ``tandem_route_cached_tokens_error``."""
        rm.ROUTE_CACHED_ERROR.observe(abs(r.predicted_cached - cached_tokens))

    def release(self, r: Route) -> None:
        """``r`` ended (finished, failed or aborted): everything it still holds comes back.
        Idempotent."""
        with self.lock:
            if r.prefill_open:
                self._leave_prefill(r, measure=False)
            if r.decode_open:
                r.decode_open = False
                w = self._workers.get(r.decode)
                if w is not None:
                    w.charge(-1, -r.decode_tokens)
        self._released()

    def _released(self) -> None:
        if self.on_capacity is not None:
            self.on_capacity()

    def view(self, exclude: Collection[int] = ()) -> ClusterView:
        """The policies' view of every known worker, now."""
        with self.lock:
            now = self.clock()
            return ClusterView.of([w.view(wid, now, wid not in exclude, self._prior_rate)
                                   for wid, w in self._workers.items()], now)

    def pending_s(self, wid: int) -> float:
        """The predicted queueing seconds of prefill worker ``wid``: its own prediction when its
        snapshot carries one, else its queued uncached prompt tokens over its measured prefill rate
        (router/README.md)."""
        with self.lock:
            return self._workers[wid].pending_s(self.clock(), self._prior_rate)

    def _route(self, rr: RouteRequest, exclude: Collection[int]) -> Route:
        t0 = time.perf_counter()
        try:
            with self.lock:
                view = self.view(exclude)
                live = view.alive_prefill()
                if live and not admit(view, self.limits):
                    wait = retry_after_s(view, self.limits)
                    raise Overloaded(f"all {len(live)} prefill workers are at their admission limits "
                                     f"(queue {self.limits.max_queue}, {self.limits.max_pending_s:g}s "
                                     f"predicted wait); retry in {wait}s", wait)
                dec = choose(view, rr, self.state, self.policy)
                return self._charge_route(rr, dec, view)
        finally:
            rm.ROUTING_DECISION.observe(time.perf_counter() - t0)

    def _pinned_alive(self, dec: Decision, exclude: Collection[int]) -> bool:
        for wid in (dec.decode_worker, dec.prefill_worker):
            if wid >= 0:
                w = self._workers.get(wid)
                if w is None or not w.alive or w.suspect or wid in exclude:
                    return False
        return dec.decode_worker >= 0

    def _charge_route(self, rr: RouteRequest, dec: Decision, view: ClusterView,
                      shared_prompt: bool = False) -> Route:
        alive = {w.worker_id for w in view.prefill + view.decode if w.alive}
        d = dec.decode_worker if dec.decode_worker in alive else -1
        if d < 0 and view.alive_decode():
            d = min(view.alive_decode(), key=lambda w: (w.running_tokens, w.in_flight)).worker_id
        p = dec.prefill_worker if dec.prefill_worker in alive else -1
        r = Route(rr, dec, d, p if d >= 0 else -1, routed_at=self.clock(),
                  predicted_cached=predicted_cached(self.state, rr, replace(dec, decode_worker=d)))
        if d < 0:
            return r
        n = rr.prompt_tokens
        self._workers[d].charge(1, n)
        r.decode_tokens, r.decode_open = n, True
        if r.prefill >= 0:
            w = self._workers[r.prefill]
            # the last prompt token is always computed; a group's later members reuse the prompt
            new = 1 if shared_prompt else max(n - dec.matched_tokens, 1)
            held = None if shared_prompt else held_tokens(self.state, rr, r.prefill)
            if held is not None:   # wait only for what the worker does not hold yet
                r.ahead = _ahead(w.queue.values(), rr.key, max(AHEAD_MIN_TOKENS, held + self.state.config.kv_block_size))
            w.queue[rr.request_id] = Queued(new, self.clock(), r)
            w.queued_new += new
            w.charge(1, n)
            r.prefill_open = True
        return r

    def _leave_prefill(self, r: Route, measure: bool) -> None:
        r.prefill_open = False
        r.prefilled.set()
        w = self._workers.get(r.prefill)
        if w is None:
            return
        q = w.queue.pop(r.rid, None)
        w.charge(-1, -r.request.prompt_tokens)
        if q is None:
            return
        w.queued_new -= q.new_tokens
        if measure:
            now = self.clock()
            service = now - max(q.since, w.last_done)
            if service > 0:
                sample = q.new_tokens / service
                w.rate = sample if w.rate is None else (1 - RATE_EWMA) * w.rate + RATE_EWMA * sample
            w.last_done = now


def _ahead(queued, key, least: int) -> Route | None:
    """The queued route whose prompt shares the longest prefix with ``key``, when that is at
    least ``least`` key elements; else None."""
    best, best_n = None, least - 1
    for q in queued:
        if q.route is None:
            continue
        other, n = q.route.request.key, 0
        for a, b in zip(other, key):
            if a != b:
                break
            n += 1
        if n > best_n:
            best, best_n = q.route, n
    return best
