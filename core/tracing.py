"""OpenTelemetry traces over OTLP/HTTP, off (a no-op that imports nothing) until :func:`setup`.
A trace crosses processes as a W3C ``traceparent`` (GenerateRequest.trace).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Mapping

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

_state: dict[str, Any] = {}


def endpoint_from_env() -> str | None:
    """The OTLP/HTTP traces URL the standard variables name, or None."""
    url = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if url:
        return url
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return base.rstrip("/") + "/v1/traces" if base else None


def traces_url(url: str) -> str:
    """``url`` with the OTLP/HTTP traces path when it names only ``scheme://host:port``."""
    return url.rstrip("/") + "/v1/traces" if url.rstrip("/").count("/") <= 2 else url


def setup(service_name: str, endpoint: str | None = None) -> bool:
    """Turn tracing on here (idempotent; ``endpoint`` None: the OTEL variables'); whether it is on."""
    if _state:
        return True
    url = endpoint or endpoint_from_env()
    if not url:
        return False
    url = traces_url(url)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url), schedule_delay_millis=500))
    _state.update(tracer=provider.get_tracer("tandem"), provider=provider,
                  propagator=TraceContextTextMapPropagator())
    return True


def enabled() -> bool:
    return bool(_state)


def flush(timeout_s: float = 5.0) -> None:
    """Export every finished span now (tests; before a process exits)."""
    if _state:
        _state["provider"].force_flush(int(timeout_s * 1000))


def shutdown() -> None:
    """Flush and turn tracing off in this process."""
    if _state:
        _state["provider"].shutdown()
        _state.clear()


class _Off:
    """The span handed out while tracing is off: accepts everything, records nothing."""

    def set(self, key: str, value: Any) -> None:
        pass

    def traceparent(self) -> str:
        return ""


_OFF = _Off()


class _Span:
    def __init__(self, span: Span) -> None:
        self.span = span

    def set(self, key: str, value: Any) -> None:
        self.span.set_attribute(key, value)

    def traceparent(self) -> str:
        """This span as a W3C traceparent: the parent to give a child in another process."""
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        _state["propagator"].inject(carrier, context=set_span_in_context(self.span))
        return carrier.get("traceparent", "")


def _context(parent: str | Mapping[str, str] | None) -> Context | None:
    """The OpenTelemetry context of ``parent`` (traceparent, headers, or None: the current one)."""
    if parent is None:
        return None
    carrier = {"traceparent": parent} if isinstance(parent, str) else {
        "traceparent": parent.get("traceparent", ""), "tracestate": parent.get("tracestate", "")}
    if not carrier["traceparent"]:
        return None
    context: Context = _state["propagator"].extract(carrier)
    return context


@contextmanager
def span(name: str, parent: str | Mapping[str, str] | None = None, *, server: bool = False,
         start_s: float | None = None, **attrs: Any) -> Iterator[_Span | _Off]:
    """A span around the block under ``parent`` (None: current); records nothing when off or ``parent`` is ""."""
    if not _state or parent == "":
        yield _OFF
        return
    from opentelemetry.trace import SpanKind

    kw: dict[str, Any] = {"context": _context(parent), "kind": SpanKind.SERVER if server else SpanKind.INTERNAL,
          "attributes": {k: v for k, v in attrs.items() if v is not None}}
    if start_s is not None:
        kw["start_time"] = int(start_s * 1e9)
    with _state["tracer"].start_as_current_span(name, **kw) as sp:
        yield _Span(sp)


def current() -> str:
    """The current span as a traceparent ("" when tracing is off or no span is open)."""
    if not _state:
        return ""
    from opentelemetry.trace import get_current_span

    sp = get_current_span()
    return _Span(sp).traceparent() if sp.get_span_context().is_valid else ""



def record(name: str, parent: str, start_s: float, end_s: float | None = None, **attrs: Any) -> str:
    """A finished span from ``start_s`` to ``end_s``; its traceparent ("" when off or ``parent`` is "")."""
    if not _state or not parent:
        return ""
    sp = _state["tracer"].start_span(name, context=_context(parent), start_time=int(start_s * 1e9),
                                     attributes={k: v for k, v in attrs.items() if v is not None})
    sp.end(end_time=None if end_s is None else int(end_s * 1e9))
    return _Span(sp).traceparent()
