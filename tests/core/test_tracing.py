"""core/tracing.py while tracing is off (issue 40): nothing of OpenTelemetry's SDK or exporter is
imported by serving code, every call is a no-op, and the endpoint comes from the flag or the
standard OTEL_EXPORTER_OTLP_* variables."""

from __future__ import annotations

import subprocess
import sys
import time

from tandem.core import tracing


def test_off_by_default_imports_no_sdk():
    code = ("import sys, tandem.router.http, tandem.engine.engine, tandem.cluster.serve, tandem.core.tracing as t\n"
            "assert not t.enabled() and t.current() == '' and t.record('x', '00-ab-cd-01', 0.0) == ''\n"
            "with t.span('x', '00-' + 'a' * 32 + '-' + 'b' * 16 + '-01') as s:\n"
            "    s.set('k', 1); assert s.traceparent() == ''\n"
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_endpoint_from_the_flag_or_the_environment(monkeypatch):
    for k in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(k, raising=False)
    assert tracing.endpoint_from_env() is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")
    assert tracing.endpoint_from_env() == "http://collector:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://other:4318/custom")
    assert tracing.endpoint_from_env() == "http://other:4318/custom"      # the traces variable wins
    assert tracing.traces_url("http://h:4318") == "http://h:4318/v1/traces"
    assert tracing.traces_url("http://h:4318/v1/traces") == "http://h:4318/v1/traces"


def test_setup_without_an_endpoint_stays_off(monkeypatch):
    for k in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(k, raising=False)
    assert not tracing.enabled()        # every test that turns it on turns it off again
    assert not tracing.setup("router") and not tracing.enabled()
    assert tracing.record("decode", "00-" + "a" * 32 + "-" + "b" * 16 + "-01", time.time()) == ""
