"""Prometheus metrics of one engine, read from its scheduler's counters at scrape time."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector


class EngineCollector(Collector):
    def __init__(self, engine, worker: str, role: str = "colocated"):
        self.engine, self.worker, self.role = engine, worker, role

    def collect(self):
        e, s = self.engine, self.engine.scheduler
        st = dict(s.stats)
        cs = e.kv.cache.stats()
        labels, values = ["worker", "role"], [self.worker, self.role]

        def gauge(name, doc, v):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, float(v))
            return g

        def counter(name, doc, v):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, float(v))
            return c

        yield gauge("tandem_worker_running_requests", "requests holding KV on this worker", len(s.running))
        yield gauge("tandem_worker_waiting_requests", "requests queued on this worker", len(s.waiting))
        used = e.allocator.size - e.allocator.available_size()
        yield gauge("tandem_worker_kv_used_tokens", "device KV slots in use (cache + requests)", used)
        yield gauge("tandem_worker_kv_capacity_tokens", "device KV slots in total", e.allocator.size)
        yield gauge("tandem_worker_cache_evictable_tokens", "unlocked tokens in the prefix cache",
                    cs.evictable)
        yield counter("tandem_worker_prompt_tokens", "prompt tokens admitted", st["prompt_tokens"])
        yield counter("tandem_worker_cached_prompt_tokens", "prompt tokens served from the prefix cache",
                      st["cached_tokens"])
        yield counter("tandem_worker_prompt_tokens_computed",
                      "prompt tokens run through the model (re-prefills and n > 1 siblings included)",
                      st["prompt_tokens_computed"])
        yield counter("tandem_worker_generated_tokens", "tokens sampled", st["generated_tokens"])
        yield counter("tandem_worker_evicted_tokens", "tokens evicted from the prefix cache",
                      st["evicted_tokens"])
        yield counter("tandem_worker_steps", "model steps run", st["steps"])
        yield counter("tandem_spec_drafted_tokens", "n-gram draft tokens verified (engine/sched/spec/)",
                      st["spec_drafted_tokens"])
        yield counter("tandem_spec_accepted_tokens", "draft tokens the target model accepted",
                      st["spec_accepted_tokens"])
        yield counter("tandem_retractions", "requests retracted under KV memory pressure",
                      st["retractions"])
        yield counter("tandem_retraction_restores", "retracted requests restored from the host tier",
                      st["retraction_restores"])
        yield counter("tandem_retraction_recomputes", "retracted requests re-prefilled from tokens",
                      st["retraction_recomputes"])
        yield counter("tandem_retraction_aborts", "retracted requests aborted (no room ever)",
                      st["retraction_aborts"])
        yield gauge("tandem_host_pool_used_tokens", "host (L2) KV tokens in use", cs.host)
        bpt = e.kv_pool.bytes_per_token
        yield counter("tandem_retraction_backup_bytes", "KV bytes backed up to the host on retraction",
                      st["backup_tokens"] * bpt)
        yield counter("tandem_retraction_backup_seconds", "time spent backing up on retraction",
                      st["backup_seconds"])
        yield counter("tandem_retraction_restore_bytes", "KV bytes restored to the device",
                      st["restore_tokens"] * bpt)
        yield counter("tandem_retraction_restore_seconds", "time spent restoring retracted requests",
                      st["restore_seconds"])
        ratio = st["cached_tokens"] / st["prompt_tokens"] if st["prompt_tokens"] else 0.0
        yield gauge("tandem_worker_cache_hit_ratio", "cached / admitted prompt tokens", ratio)
        cache = e.kv.cache
        pinned = GaugeMetricFamily("tandem_worker_pinned_tokens", "prompt tokens pinned in the prefix cache "
                                   "(any tier), per tenant", labels=[*labels, "tenant"])
        for tenant, n in cache.pinned_tokens.items():
            pinned.add_metric([*values, tenant or "default"], float(n))
        yield pinned
        yield counter("tandem_worker_pin_hits", "prefix matches that ended on a pinned prefix", cache.pin_hits)
        yield counter("tandem_worker_pins_refused", "pins past their tenant's cap (served unpinned)",
                      cache.pin_refused)
        l3 = e.kv.cache.tier("l3")
        if l3 is not None:
            yield from _l3_series(l3, gauge, counter)


def _l3_series(l3, gauge, counter):
    t, s = l3.stats, l3.store.stats
    yield gauge("tandem_l3_up", "1 while the L3 store answers (0: down, every read a miss)", l3.store.up)
    yield counter("tandem_l3_hit_pages", "KV pages read from the L3 store into the prefix cache", t.hit_pages)
    yield counter("tandem_l3_miss_pages", "KV pages looked up in L3 and not fetched (absent, corrupt, "
                  "late, no room)", t.miss_pages)
    yield counter("tandem_l3_corrupt_pages", "L3 pages whose digest did not match (each a miss)", s.corrupt)
    yield counter("tandem_l3_component_hits", "hybrid models: component values (a page's SWA rows, a "
                  "state checkpoint) read from the L3 store into the prefix cache", t.aux_hits)
    yield counter("tandem_l3_component_misses", "hybrid models: component values a match end needed "
                  "that could not be read (corrupt, wrong size, late)", t.aux_misses)
    yield counter("tandem_l3_read_bytes", "KV bytes read from the L3 store", s.bytes_read)
    yield counter("tandem_l3_written_bytes", "KV bytes written to the L3 store", s.bytes_written)
    yield counter("tandem_l3_write_dropped_pages", "L3 writes dropped (queue full, store down)",
                  s.write_dropped)
    yield counter("tandem_l3_errors", "L3 store calls that failed or timed out", s.errors)
    yield counter("tandem_l3_prefetch_seconds", "time spent fetching L3 pages before prefill",
                  t.prefetch_s)
    yield counter("tandem_l3_prefetched_pages", "L3 values (KV pages, component values) read ahead "
                  "into host staging when a request was queued", t.prefetched_pages)
    yield counter("tandem_l3_prefetch_used_pages", "staged L3 values a fetch took instead of reading "
                  "the store", t.prefetch_used_pages)
    yield counter("tandem_l3_prefetch_dropped_pages", "staged L3 values dropped unused (the staging "
                  "bound)", t.prefetch_dropped_pages)


def register_engine_metrics(engine, worker: str, role: str = "colocated", registry=REGISTRY) -> EngineCollector:
    c = EngineCollector(engine, worker, role)
    registry.register(c)
    return c
