"""Prometheus metrics measured at the HTTP front door (names fixed by the spec)."""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from tandem.router.rebalance import MoveReason

STATUSES = ("ok", "rejected", "aborted", "error")

# Token latencies of a serving system: sub-millisecond decode steps up to multi-second prefills.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                    0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


def _metric(cls, name: str, doc: str, **kwargs):
    existing = REGISTRY._names_to_collectors.get(name)  # no public lookup API in prometheus_client
    if existing is not None:
        if not isinstance(existing, cls):
            raise TypeError(f"metric {name} is already registered as {type(existing).__name__}, "
                            f"not {cls.__name__}")
        return existing
    return cls(name, doc, **kwargs)


REQUESTS = _metric(Counter, "tandem_requests_total",
                   "Generation requests at the front door, by outcome (ok, rejected, aborted, error).",
                   labelnames=("status",))
REJECTED = _metric(Counter, "tandem_rejected_requests_total",
                   "Requests answered 4xx by the front door before reaching the backend, by reason.",
                   labelnames=("reason",))
TTFT = _metric(Histogram, "tandem_time_to_first_token_seconds",
               "Request arrival at the front door to the first generated token.",
               buckets=_LATENCY_BUCKETS)
ITL = _metric(Histogram, "tandem_inter_token_latency_seconds",
              "Time between consecutive generated tokens, seen by the front door.",
              buckets=_LATENCY_BUCKETS)
PROMPT_TOKENS = _metric(Counter, "tandem_prompt_tokens_total",
                        "Prompt tokens of finished requests.")
CACHED_PROMPT_TOKENS = _metric(Counter, "tandem_cached_prompt_tokens_total",
                               "Prompt tokens of finished requests served from the prefix cache.")

CACHE_HIT_RATIO = _metric(Gauge, "tandem_cache_hit_ratio",
                          "Cluster-wide prefix cache hit ratio: cached / prompt tokens of finished "
                          "requests at the front door since start.")
ROUTING_DECISION = _metric(Histogram, "tandem_routing_decision_seconds",
                           "Time the router took to pick a prefill and a decode worker.",
                           buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
                                    0.01, 0.025, 0.05, 0.1))
WORKER_LOAD = _metric(Gauge, "tandem_worker_load",
                      "Requests in flight per worker, as the router's dispatch records see them.",
                      labelnames=("worker", "role"))

QUEUE_DEPTH = _metric(Gauge, "tandem_dispatch_queue_depth",
                      "Requests waiting in the router for a worker under its admission limits.")
QUEUE_WAIT = _metric(Histogram, "tandem_dispatch_queue_wait_seconds",
                     "Time a request waited in the deferred-dispatch queue, by outcome.",
                     labelnames=("outcome",), buckets=_LATENCY_BUCKETS)

MIGRATIONS = _metric(Counter, "tandem_decode_migrations_total",
                     "Running requests moved between decode workers, by why (pressure, rebalance, drain, "
                     "admin: POST /admin/migrate, forced: the debug_migrate_every lever, prestop: off a "
                     "decode worker that stopped making progress, its KV recomputed on the peer) and how it ended "
                     "(ok: the new worker streamed on; failed: back on the old worker, or recomputed; "
                     "aborted: the client went away mid-move).",
                     labelnames=("reason", "outcome"))
MIGRATION_DOWNTIME = _metric(Histogram, "tandem_decode_migration_downtime_seconds",
                             "A migrated request's stop: its last token on the old decode worker to its "
                             "first on the new one, as the router sees it.", buckets=_LATENCY_BUCKETS)

WORKER_STALLS = _metric(Counter, "tandem_worker_stalls_total",
                        "Workers found making no progress (no answer to ping or stats within "
                        "--progress-timeout), by role and what came of it (suspect: out of rotation; "
                        "rejoined: answered again; replaced: stuck past --progress-replace-after).",
                        labelnames=("role", "event"))
WORKERS_SUSPECT = _metric(Gauge, "tandem_workers_suspect", "Workers out of rotation for making no progress.")
FAILOVERS = _metric(Counter, "tandem_failovers_total",
                    "Requests whose worker died under them, by its role and what became of them "
                    "(resumed: on a live decode worker after the tokens the client had; redispatched: "
                    "routed again without it, nothing was streamed yet; failed: an error event, "
                    "--max-failovers spent or no live decode worker within --failover-wait-s).",
                    labelnames=("role", "outcome"))
FAILOVER_OUTCOMES = ("resumed", "redispatched", "failed")
STALL_REDISPATCHES = _metric(Counter, "tandem_stall_redispatches_total",
                             "Requests moved off a worker or transfer that stopped making progress, by "
                             "what stalled (decode, prefill, transfer) and how (redispatch: from the "
                             "prompt, nothing was streamed; resume: on a decode peer after the streamed "
                             "text; failed: no worker to take it, the client got an error event).",
                             labelnames=("stalled", "how"))

_TENANT_FAMILIES = (   # (name, help, labels): per-tenant counters (router/auth.py's tenants)
    ("tandem_tenant_requests_total", "Generation requests per tenant ('default' without a key file), "
     "counted when admitted past the tenant's rate limit or refused by it.", ("tenant",)),
    ("tandem_tenant_rate_limited_total", "Requests answered 429 because their tenant was over its "
     "rate_limit.", ("tenant",)),
    ("tandem_tenant_tokens_total", "Tokens of finished requests per tenant: prompt, cached (prompt "
     "tokens served from the prefix cache) and output.", ("tenant", "kind")),
)
TENANT_REQUESTS, TENANT_RATE_LIMITED, TENANT_TOKENS = (
    _metric(Counter, name, doc, labelnames=labels) for name, doc, labels in _TENANT_FAMILIES)

def count_tenant(tenant: str, what: str, n: int = 1) -> None:
    """``what``: "requests", "rate_limited", or a token kind ("prompt", "cached", "output")."""
    if what == "requests":
        TENANT_REQUESTS.labels(tenant).inc(n)
    elif what == "rate_limited":
        TENANT_RATE_LIMITED.labels(tenant).inc(n)
    elif n:
        TENANT_TOKENS.labels(tenant, what).inc(n)


_totals = {"prompt": 0, "cached": 0}
_totals_lock = threading.Lock()


def count_prompt(prompt_tokens: int, cached_tokens: int) -> None:
    """One finished request's usage: the token counters and the hit-ratio gauge."""
    PROMPT_TOKENS.inc(prompt_tokens)
    CACHED_PROMPT_TOKENS.inc(cached_tokens)
    with _totals_lock:
        _totals["prompt"] += prompt_tokens
        _totals["cached"] += cached_tokens
        if _totals["prompt"]:
            CACHE_HIT_RATIO.set(_totals["cached"] / _totals["prompt"])


MIGRATION_REASONS = tuple(r.value for r in MoveReason)
MIGRATION_OUTCOMES = ("ok", "failed", "aborted")
REJECT_REASONS = ("malformed", "invalid_request", "timeout", "disconnected", "too_large",
                  "unauthorized", "forbidden", "rate_limited", "model_not_found", "context_length",
                  "overloaded")
for _s in STATUSES:
    REQUESTS.labels(_s)
for _r in REJECT_REASONS:
    REJECTED.labels(_r)
for _why in MIGRATION_REASONS:
    for _o in MIGRATION_OUTCOMES:
        MIGRATIONS.labels(_why, _o)
for _role in ("prefill", "decode"):
    for _e in ("suspect", "rejoined", "replaced"):
        WORKER_STALLS.labels(_role, _e)
for _role in ("prefill", "decode"):
    for _o in FAILOVER_OUTCOMES:
        FAILOVERS.labels(_role, _o)
for _st in ("decode", "prefill", "transfer"):
    for _how in ("redispatch", "resume", "failed"):
        STALL_REDISPATCHES.labels(_st, _how)

ROUTE_CACHED_ERROR = _metric(Histogram, "tandem_route_cached_tokens_error",
                             "Per finished request, |predicted - actual| cached prompt tokens: the "
                             "router's prediction against what the chosen workers reused.",
                             buckets=(0, 1, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384))
