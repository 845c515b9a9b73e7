"""A real OTLP/HTTP endpoint for the telemetry tests: it decodes what the OTLP exporters of the
test's processes send (``ExportTraceServiceRequest`` and ``ExportMetricsServiceRequest`` bodies)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class SpanRecord:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    events: list[str]
    links: list[tuple[str, str]] = field(default_factory=list)
    """(trace id, span id) of each span link."""
    resource: dict[str, Any] = field(default_factory=dict)


class OtlpReceiver:
    """A minimal OTLP/HTTP endpoint: ``/v1/traces`` and ``/v1/metrics``."""

    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []
        self.metrics: list[tuple[str, str]] = []
        """(service name, metric name) of every data point batch received."""
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path.endswith("/v1/traces"):
                    receiver.add(ExportTraceServiceRequest.FromString(body))
                    reply = ExportTraceServiceResponse().SerializeToString()
                elif self.path.endswith("/v1/metrics"):
                    receiver.add_metrics(ExportMetricsServiceRequest.FromString(body))
                    reply = ExportMetricsServiceResponse().SerializeToString()
                else:
                    reply = b""
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, req: ExportTraceServiceRequest) -> None:
        for rs in req.resource_spans:
            resource = {a.key: value(a.value) for a in rs.resource.attributes}
            service = str(resource.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    record = SpanRecord(
                        service,
                        s.name,
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        s.kind,
                        {a.key: value(a.value) for a in s.attributes},
                        [e.name for e in s.events],
                        [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        resource,
                    )
                    with self.lock:
                        self.spans.append(record)

    def add_metrics(self, req: ExportMetricsServiceRequest) -> None:
        for rm in req.resource_metrics:
            service = next((a.value.string_value for a in rm.resource.attributes if a.key == "service.name"), "")
            for sm in rm.scope_metrics:
                with self.lock:
                    self.metrics.extend((service, m.name) for m in sm.metrics)

    def wait_for(self, names: set[str], trace_id: str | None = None, timeout: float = 15.0) -> list[SpanRecord]:
        """The spans received (of one trace, if given) once every name in ``names`` is among them, or at the timeout."""
        end = time.monotonic() + timeout
        while True:
            with self.lock:
                got = [s for s in self.spans if trace_id is None or s.trace_id == trace_id]
            if names <= {s.name for s in got} or time.monotonic() > end:
                return got
            time.sleep(0.05)

    def wait_until(self, check: Any, timeout: float = 15.0) -> list[SpanRecord]:
        """The spans received once ``check(spans)`` is true, or at the timeout."""
        end = time.monotonic() + timeout
        while True:
            with self.lock:
                got = list(self.spans)
            if check(got) or time.monotonic() > end:
                return got
            time.sleep(0.05)

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def value(v: Any) -> Any:
    """The Python value of an OTLP ``AnyValue``."""
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None
