"""Prometheus metrics of the simulated workers (``tandem serve --engine sim``), one series per
worker name.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from tandem.router.metrics import _metric


def _per_worker(kind, name: str, doc: str, *labels: str):
    return _metric(kind, name, doc, labelnames=("worker", *labels))


PREFILL_QUEUE = _per_worker(Gauge, "tandem_sim_prefill_queue",
                            "Simulated prefill worker: requests waiting for their prefill.")
PREFILL_PENDING = _per_worker(Gauge, "tandem_sim_prefill_pending_seconds",
                              "Simulated prefill worker: predicted seconds of queued work (simulated time).")
CACHE_TOKENS = _per_worker(Gauge, "tandem_sim_prefix_cache_tokens",
                           "Simulated prefill worker: tokens held by its prefix cache.")
PREFILL_TOKENS = _per_worker(Counter, "tandem_sim_prefill_tokens_total",
                             "Simulated prefill worker: prompt tokens prefilled, computed or cached.", "kind")
TRANSFER_BYTES = _per_worker(Counter, "tandem_sim_transfer_bytes_total",
                             "Simulated KV bytes sent from a prefill worker to decode workers.")
DECODE_RUNNING = _per_worker(Gauge, "tandem_sim_decode_running",
                             "Simulated decode worker: requests in its running batch.")
DECODE_KV = _per_worker(Gauge, "tandem_sim_decode_kv_tokens",
                        "Simulated decode worker: KV tokens reserved (prompt + output of admitted requests).")
DECODE_TOKENS = _per_worker(Counter, "tandem_sim_decode_tokens_total",
                            "Simulated decode worker: tokens generated.")
BUSY = _per_worker(Counter, "tandem_sim_busy_seconds_total",
                   "Simulated seconds a worker spent computing (prefills or decode steps).", "role")
