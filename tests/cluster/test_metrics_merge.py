"""cluster/metrics.py: workers' expositions merge into one valid exposition with a worker label."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tandem.cluster.metrics import merge_expositions


def _worker(nbytes: int, seconds: float | None = None) -> bytes:
    reg = CollectorRegistry()
    Counter("tandem_kv_transfer_bytes_total", "KV bytes.", registry=reg).inc(nbytes)
    h = Histogram("tandem_kv_transfer_seconds", "One transfer.", buckets=(0.01, 0.1), registry=reg)
    if seconds is not None:
        h.observe(seconds)
    return generate_latest(reg)


def test_samples_keep_one_header_and_gain_a_worker_label():
    driver = CollectorRegistry()
    Counter("tandem_requests_total", "Requests.", labelnames=("status",), registry=driver).labels("ok").inc(3)
    text = merge_expositions({"prefill-0": _worker(100, 0.05), "prefill-1": _worker(7)},
                             generate_latest(driver)).decode()
    assert text.count("# TYPE tandem_kv_transfer_bytes_total counter") == 1
    assert text.count("# TYPE tandem_kv_transfer_seconds histogram") == 1
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    total = {s.labels["worker"]: s.value for s in fams["tandem_kv_transfer_bytes"].samples
             if s.name.endswith("_total")}
    assert total == {"prefill-0": 100.0, "prefill-1": 7.0}
    buckets = {(s.labels["worker"], s.labels["le"]): s.value
               for s in fams["tandem_kv_transfer_seconds"].samples if s.name.endswith("_bucket")}
    assert buckets[("prefill-0", "0.1")] == 1.0 and buckets[("prefill-0", "0.01")] == 0.0
    assert buckets[("prefill-1", "+Inf")] == 0.0
    req = [s for s in fams["tandem_requests"].samples if s.name == "tandem_requests_total"]
    assert [(s.labels, s.value) for s in req] == [({"status": "ok"}, 3.0)]   # the driver's: no worker label


def test_a_family_whose_type_conflicts_is_dropped_not_duplicated():
    a = CollectorRegistry()
    Counter("tandem_x_total", "x", registry=a).inc()
    b = b"# HELP tandem_x gauge here\n# TYPE tandem_x gauge\ntandem_x 5.0\n"
    text = merge_expositions({"w0": generate_latest(a), "w1": b}).decode()
    fams = list(text_string_to_metric_families(text))
    assert [f.type for f in fams if f.name == "tandem_x"] == ["counter"]
