"""Routing policies: ``choose(view, req, state) -> Decision``."""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field
from typing import Callable

from .prefix_index import ApproxPrefixIndex, GlobalBlockIndex, block_hashes
from .sessions import SessionTable
from .view import ClusterView, Decision, RouteRequest, WorkerView

POLICIES = ("round_robin", "random", "least_load", "cache_aware", "kv_events", "session")
DEFAULT_POLICY = "session"


@dataclass(frozen=True)
class PrefillEstimator:
    """Predicted prefill seconds of ``new`` uncached tokens after ``cached`` cached ones:
    ``overhead_s + per_token_s * new + per_pair_s * new * (cached + new / 2)``."""

    overhead_s: float = 0.010
    per_token_s: float = 2.68e-5        # 2 * 8.03e9 FLOP / 600 TFLOP/s
    per_pair_s: float = 1.05e-9         # 4 * 32 layers * 4096 FLOP / 500 TFLOP/s

    def seconds(self, new: float, cached: float = 0) -> float:
        if new <= 0:
            return self.overhead_s
        return self.overhead_s + new * (self.per_token_s + self.per_pair_s * (cached + 0.5 * new))


@dataclass(frozen=True)
class AdmissionLimits:
    """Per prefill worker: past either limit it takes no new (non-sticky) work."""

    max_queue: int = 64                 # waiting requests
    max_pending_s: float = 30.0         # predicted queueing seconds (the TTFT a new request would
                                        # see before its own prefill starts)


L3_BLOCK_CREDIT = 0.25     # PolicyConfig.l3_block_credit for a cluster with a shared L3 store


@dataclass(frozen=True)
class PolicyConfig:
    seed: int = 0
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    # kv_events: NVIDIA Dynamo's KV router (its kv_overlap_score_weight, default 1.0)
    overlap_weight: float = 1.0
    kv_block_size: int = 16             # key elements per hashed block = the engines' page size
    host_block_credit: float = 0.5      # a host-tier block saves this fraction of its prefill
    l3_block_credit: float = 0.0
    # session
    session_ttl_s: float = 600.0
    max_sessions: int = 100_000
    spill: AdmissionLimits = AdmissionLimits(max_queue=16, max_pending_s=5.0)
    estimator: PrefillEstimator = PrefillEstimator()
    duplicate_penalty: float = 1.0     # session: prefill tokens charged per duplicated token
    evict_penalty: float = 1.0         # session: prefill tokens charged per token it makes evict
    rendezvous: bool = False           # session: a cold session goes to its rendezvous winner
    # approximate index (cache_aware, session)
    index_page_size: int = 1            # key elements per page
    index_capacity: int | None = None   # key elements per worker; None = unbounded


@dataclass
class RouterState:
    """Everything the policies remember between decisions. One per router replica."""

    config: PolicyConfig = field(default_factory=PolicyConfig)
    rng: random.Random = field(init=False)
    sessions: SessionTable = field(init=False)
    approx: ApproxPrefixIndex = field(init=False)
    kv: GlobalBlockIndex = field(init=False)
    rr_prefill: int = 0
    rr_decode: int = 0

    def __post_init__(self):
        c = self.config
        self.rng = random.Random(c.seed)
        self.sessions = SessionTable(c.session_ttl_s, c.max_sessions)
        self.approx = ApproxPrefixIndex(c.index_page_size, c.index_capacity)
        self.kv = GlobalBlockIndex()

    def forget_worker(self, worker: int) -> None:
        """A worker left: drop what the router remembered about it."""
        self.approx.remove_worker(worker)
        self.kv.remove_worker(worker)
        self.sessions.forget_worker(worker)


def _none(reason: str = "no_worker") -> Decision:
    return Decision(-1, -1, reason)


def _matched_tokens(req: RouteRequest, elements: int) -> int:
    return min(elements * req.key_unit, req.prompt_tokens)


def _rotate_min(ws: list[WorkerView], key, turn: int) -> WorkerView:
    best = min(key(w) for w in ws)
    tied = [w for w in ws if key(w) == best]
    return tied[turn % len(tied)]


def _least_decode(ws: list[WorkerView], state: "RouterState") -> int:
    if not ws:
        return -1
    state.rr_decode += 1
    return _rotate_min(ws, lambda w: (w.running_tokens, w.in_flight), state.rr_decode).worker_id


def _least_prefill(ws: list[WorkerView], state: "RouterState") -> WorkerView:
    state.rr_prefill += 1
    return _rotate_min(ws, lambda w: (w.in_flight, w.running_tokens), state.rr_prefill)


def _over(w: WorkerView, limits: AdmissionLimits) -> bool:
    return w.queue_len >= limits.max_queue or w.pending_s >= limits.max_pending_s


def rendezvous_score(session: str | int, worker: str) -> int:
    """Highest-random-weight hash of (session, worker): every router ranks workers alike."""
    return int.from_bytes(hashlib.blake2b(f"{session}\x00{worker}".encode(), digest_size=8).digest(), "big")


def _rendezvous(ws: list[WorkerView], session: str | int) -> WorkerView:
    return max(ws, key=lambda w: (rendezvous_score(session, w.key or str(w.worker_id)), -w.worker_id))


def _exact(state: "RouterState", req: RouteRequest) -> dict[int, int]:
    """Prompt key elements each worker holds (device or host) or has pinned (a pinned page waits on
    one of its tiers until the pin ends: the prefix's workers are preferred, issue 52)."""
    kv = state.kv
    if not kv.num_blocks() and not kv.has_pins():
        return {}
    c = state.config
    hashes = req.block_hashes if req.block_hashes is not None else block_hashes(req.key, c.kv_block_size)
    out = {w: dev + host for w, (dev, host) in kv.overlap(hashes).items()}
    for w, n in kv.pinned_prefix(hashes).items():
        out[w] = max(out.get(w, 0), n)
    return {w: n * c.kv_block_size for w, n in out.items()}


def _l3_tokens(state: "RouterState", req: RouteRequest) -> int:
    c = state.config
    if not c.l3_block_credit:
        return 0
    hashes = req.block_hashes if req.block_hashes is not None else block_hashes(req.key, c.kv_block_size)
    return _matched_tokens(req, state.kv.known_prefix(hashes) * c.kv_block_size)


def held_tokens(state: "RouterState", req: RouteRequest, worker: int) -> int | None:
    """Prompt tokens ``worker`` reported holding (or pinned) of the request (the exact KV-event
    index), or None when no event has fed the index."""
    if not state.kv.num_blocks() and not state.kv.has_pins():
        return None
    return _matched_tokens(req, _exact(state, req).get(worker, 0))


def predicted_cached(state: "RouterState", req: RouteRequest, dec: Decision) -> int:
    """Prompt tokens the chosen pair is predicted to reuse: the prefill worker's match (the
    policy's, or the exact KV-event index's when more: a pushed reply, decode/reply_push.py), or
    what that index says the decode worker holds when it prefills the prompt itself:
    decode/local_prefill.py's rule without its overhead term (the part left to compute,
    ``n - held``, at most what the prefill worker would compute again, ``held - matched``)."""
    exact = _exact(state, req)
    prefill = max(dec.matched_tokens, _matched_tokens(req, exact.get(dec.prefill_worker, 0)))
    decode = _matched_tokens(req, exact.get(dec.decode_worker, 0)) if dec.decode_worker >= 0 else 0
    if decode > prefill and req.prompt_tokens - decode <= decode - prefill:
        return decode
    return prefill


def round_robin(view: ClusterView, req: RouteRequest, state: RouterState) -> Decision:
    ps, ds = view.alive_prefill(), view.alive_decode()
    if not ps:
        return _none()
    p = ps[state.rr_prefill % len(ps)].worker_id
    d = ds[state.rr_decode % len(ds)].worker_id if ds else -1
    state.rr_prefill += 1
    state.rr_decode += 1
    return Decision(p, d, "turn")


def random_choice(view: ClusterView, req: RouteRequest, state: RouterState) -> Decision:
    ps, ds = view.alive_prefill(), view.alive_decode()
    if not ps:
        return _none()
    p = state.rng.choice(ps).worker_id
    d = state.rng.choice(ds).worker_id if ds else -1
    return Decision(p, d, "random")


def least_load(view: ClusterView, req: RouteRequest, state: RouterState) -> Decision:
    ps = view.alive_prefill()
    if not ps:
        return _none()
    return Decision(_least_prefill(ps, state).worker_id, _least_decode(view.alive_decode(), state), "load")


def cache_aware(view: ClusterView, req: RouteRequest, state: RouterState) -> Decision:
    """The SGLang router's ``cache_aware`` policy over :class:`ApproxPrefixIndex`."""
    ps = view.alive_prefill()
    if not ps:
        return _none()
    c = state.config
    loads = [w.load for w in ps]
    hi, lo = max(loads), min(loads)
    matched = 0
    if hi - lo > c.balance_abs_threshold and hi > c.balance_rel_threshold * lo:
        chosen, reason = _least_prefill(ps, state), "imbalance"
    else:
        m = state.approx.match(req.key)
        best = max(ps, key=lambda w: (m.get(w.worker_id, 0), -w.load, -state.approx.size(w.worker_id),
                                      -w.worker_id))
        matched = _matched_tokens(req, m.get(best.worker_id, 0))
        if req.prompt_tokens and matched / req.prompt_tokens > c.cache_threshold:
            chosen, reason = best, "prefix"
        else:
            chosen = min(ps, key=lambda w: (state.approx.size(w.worker_id), w.load, w.worker_id))
            reason, matched = "smallest_tree", _matched_tokens(req, m.get(chosen.worker_id, 0))
    state.approx.insert(chosen.worker_id, req.key)
    return Decision(chosen.worker_id, _least_decode(view.alive_decode(), state), reason, matched)


def kv_events(view: ClusterView, req: RouteRequest, state: RouterState) -> Decision:
    """Dynamo's KV router over the exact index: ``cost(w) = weight * prefill_blocks(w) +
    decode_blocks(w)``; prefill_blocks = the request's blocks not cached on ``w`` (a
    host-tier block counts ``1 - host_block_credit``; with ``l3_block_credit``, a block after
    ``w``'s own that another worker reported counts ``1 - l3_block_credit``: an L3 hit),
    decode_blocks = ``w``'s active blocks (tokens it still has to process)."""
    ps = view.alive_prefill()
    if not ps:
        return _none()
    c = state.config
    block_tokens = c.kv_block_size * req.key_unit
    total = -(-req.prompt_tokens // block_tokens)
    hashes = req.block_hashes if req.block_hashes is not None else block_hashes(req.key, c.kv_block_size)
    ov = state.kv.overlap(hashes)
    pinned = state.kv.pinned_prefix(hashes) if state.kv.has_pins() else {}
    known = state.kv.known_prefix(hashes) if c.l3_block_credit else 0
    cost = {}
    for w in ps:
        dev, host = ov.get(w.worker_id, (0, 0))
        host = max(host, pinned.get(w.worker_id, 0) - dev)    # a pinned page: at worst on a lower tier
        l3 = max(known - dev - host, 0)     # the blocks after w's own, read from the store
        prefill_blocks = max(total - dev - host * c.host_block_credit - l3 * c.l3_block_credit, 0.0)
        cost[w.worker_id] = c.overlap_weight * prefill_blocks + -(-w.running_tokens // block_tokens)
    state.rr_prefill += 1
    w = _rotate_min(ps, lambda w: (cost[w.worker_id], w.in_flight), state.rr_prefill)
    dev = ov.get(w.worker_id, (0, 0))[0]
    return Decision(w.worker_id, _least_decode(view.alive_decode(), state), "kv_cost",
                    _matched_tokens(req, dev * c.kv_block_size))


def session(view: ClusterView, req: RouteRequest, state: RouterState) -> Decision:
    """Sticky sessions with load-aware prefix affinity (the default)."""
    ps = view.alive_prefill()
    if not ps:
        return _none()
    c = state.config
    est = c.estimator
    key = req.session_key
    entry = state.sessions.get(key, view.now)
    chosen: WorkerView | None = None
    reason = ""
    m = state.approx.match(req.key)
    exact = _exact(state, req) if entry is None else {}
    if exact:
        m = dict(m)
        for wid, n in exact.items():
            m[wid] = max(m.get(wid, 0), n)
    if entry is not None:
        sticky = next((w for w in ps if w.worker_id == entry.prefill_worker), None)
        if sticky is not None and not _over(sticky, c.spill):
            chosen, reason = sticky, "sticky"
    live_hit = any(m.get(w.worker_id, 0) for w in ps)
    if chosen is None and c.rendezvous and key is not None and not live_hit:
        chosen, reason = _rendezvous([w for w in ps if not _over(w, c.spill)] or ps, key), "rendezvous"
    if chosen is None:
        best: tuple[float, int, int, int, int] | None = None
        top = _matched_tokens(req, max(m.values(), default=0))
        l3 = _l3_tokens(state, req) if exact else 0
        for w in [w for w in ps if not _over(w, c.spill)] or ps:    # the overloaded only if all are
            hit = _matched_tokens(req, m.get(w.worker_id, 0))
            saved = hit + c.l3_block_credit * max(l3 - hit, 0)     # an L3 hit, at a discount
            t = (w.pending_s + est.seconds(req.prompt_tokens - saved, saved)
                 + _later_cost(state, req, w, hit, top))
            k = (t, -hit, state.approx.size(w.worker_id), w.in_flight, w.worker_id)
            if best is None or k < best:
                best, chosen = k, w
        reason = "spill" if entry is not None else ("prefix" if best is not None and -best[1] > 0 else "load")
    assert chosen is not None    # ps is not empty: the loop above chose one
    hit = _matched_tokens(req, m.get(chosen.worker_id, 0))
    ttft = chosen.pending_s + est.seconds(req.prompt_tokens - hit, hit)
    state.approx.insert(chosen.worker_id, req.key)

    ds = view.alive_decode()
    d = -1
    if entry is not None:
        dw = next((w for w in ds if w.worker_id == entry.decode_worker), None)
        if dw is not None and not _decode_overloaded(dw, ds):
            d = dw.worker_id
    elif ds:
        ok = [w for w in ds if not _decode_overloaded(w, ds)]
        held = [w for w in ok if exact.get(w.worker_id, 0)]
        if held:
            d = max(held, key=lambda w: (exact[w.worker_id], -w.running_tokens, -w.worker_id)).worker_id
        elif c.rendezvous and key is not None and ok:
            d = _rendezvous(ok, key).worker_id
    if d < 0:
        d = _least_decode(ds, state)
    state.sessions.bind(key, chosen.worker_id, d, view.now)
    return Decision(chosen.worker_id, d, reason, hit, ttft)


def _later_cost(state: RouterState, req: RouteRequest, w: WorkerView, hit: int, top: int) -> float:
    c = state.config
    dup = top - hit
    ev = 0
    if c.index_capacity is not None:
        new = req.prompt_tokens - hit
        over = (state.approx.size(w.worker_id) - c.index_capacity) * req.key_unit + new
        ev = max(0, min(new, over))
    return c.estimator.per_token_s * (c.duplicate_penalty * dup + c.evict_penalty * ev)


def _decode_overloaded(w: WorkerView, ds: list[WorkerView]) -> bool:
    if w.capacity_tokens and w.running_tokens >= 0.9 * w.capacity_tokens:
        return True
    lo = min(x.running_tokens for x in ds)
    return w.running_tokens > 2 * lo + 32_768


POLICY_FUNCS: dict[str, Callable[[ClusterView, RouteRequest, RouterState], Decision]] = {
    "round_robin": round_robin,
    "random": random_choice,
    "least_load": least_load,
    "cache_aware": cache_aware,
    "kv_events": kv_events,
    "session": session,
}


def choose(view: ClusterView, req: RouteRequest, state: RouterState, policy: str = DEFAULT_POLICY) -> Decision:
    """Route ``req`` with the named policy."""
    fn = POLICY_FUNCS.get(policy)
    if fn is None:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    return fn(view, req, state)


def admit(view: ClusterView, limits: AdmissionLimits = AdmissionLimits()) -> bool:
    """True when at least one alive prefill worker is under both limits."""
    return any(not _over(w, limits) for w in view.prefill if w.alive)


def retry_after_s(view: ClusterView, limits: AdmissionLimits = AdmissionLimits(),
                  default_s: int = 5, max_s: int = 60) -> int:
    """Seconds a refused client should wait (the Retry-After header): the predicted time until the
    soonest alive prefill worker is back under its limits, from its predicted queue
    (``pending_s``; per queued request ``pending_s / queue_len``)."""
    best = None
    for w in view.prefill:
        if not w.alive:
            continue
        wait = max(w.pending_s - limits.max_pending_s, 0.0)
        if w.queue_len >= limits.max_queue:
            per_req = w.pending_s / w.queue_len if w.queue_len else 0.0
            wait = max(wait, (w.queue_len - limits.max_queue + 1) * per_req)
        best = wait if best is None else min(best, wait)
    if best is None:
        return default_s
    return int(min(max(math.ceil(best), 1), max_s))
