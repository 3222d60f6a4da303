"""An OTLP/HTTP traces receiver for tests: a tiny HTTP server on 127.0.0.1 that decodes the
ExportTraceServiceRequest protobufs OpenTelemetry's exporter posts (core/tracing.py)."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_pb


class Receiver:
    """An OTLP/HTTP traces endpoint: every span it is sent, as (service.name, span) dicts."""

    def __init__(self):
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = trace_pb.ExportTraceServiceRequest()
                req.ParseFromString(body)
                outer.add(req)
                out = trace_pb.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1/traces"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def add(self, req) -> None:
        for rs in req.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in s.attributes}
                    with self.lock:
                        self.spans.append({"service": service, "name": s.name, "trace": s.trace_id.hex(),
                                           "id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                           "attrs": attrs})

    def of_trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace_id]

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
