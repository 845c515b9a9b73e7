"""OpenTelemetry for kvbus: one trace per transfer across processes, and metrics.

Tracing is off, at no cost, unless configured: set the standard ``OTEL_EXPORTER_OTLP_ENDPOINT``
(or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), with ``OTEL_EXPORTER_OTLP_PROTOCOL`` =
``http/protobuf`` (default) or ``grpc``, and ``OTEL_SERVICE_NAME``; Jaeger accepts OTLP
directly. Without them the global no-op tracer is used and spans cost a function call.

The W3C trace context rides in NATS message headers (``traceparent``) and, where a message
is a msgpack control message, in its ``traceparent`` field; `inject` and `extract` convert.

Metrics go to a Prometheus scrape endpoint when ``KVBUS_METRICS_PORT`` is set (each service
sets its own port); without it the instruments are no-ops.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_LOCK = threading.Lock()
_CONFIGURED: dict[str, Any] = {}

#: Attribute names (OpenTelemetry messaging semantic conventions where they exist).
MESSAGING_SYSTEM = "messaging.system"
MESSAGING_DESTINATION = "messaging.destination.name"
MESSAGING_OPERATION = "messaging.operation.type"
MESSAGE_ID = "messaging.message.id"
MESSAGE_BODY_SIZE = "messaging.message.body.size"


def tracing_configured(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")) and (
        env.get("OTEL_SDK_DISABLED", "").lower() != "true")


def setup(service_name: str | None = None) -> bool:
    """Configure tracing and metrics for this process from the environment (idempotent).

    Returns whether tracing exports anywhere.
    """
    with _LOCK:
        if "done" in _CONFIGURED:
            return bool(_CONFIGURED.get("tracing"))
        _CONFIGURED["done"] = True
        name = os.environ.get("OTEL_SERVICE_NAME") or service_name or "kvbus"
        if tracing_configured():
            _setup_tracing(name)
            _CONFIGURED["tracing"] = True
        port = os.environ.get("KVBUS_METRICS_PORT")
        if port:
            _setup_metrics(name, int(port))
        return bool(_CONFIGURED.get("tracing"))


def _setup_tracing(name: str) -> None:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    logger.info("tracing to OTLP (%s) as %s", protocol, name)


def _setup_metrics(name: str, port: int) -> None:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource
    from prometheus_client import start_http_server

    start_http_server(port)
    metrics.set_meter_provider(MeterProvider(resource=Resource.create({"service.name": name}),
                                             metric_readers=[PrometheusMetricReader()]))
    logger.info("Prometheus metrics on :%d", port)


def shutdown() -> None:
    """Flush spans (call before a process exits)."""
    provider = trace.get_tracer_provider()
    flush = getattr(provider, "force_flush", None)
    if flush is not None:
        flush()


def tracer() -> trace.Tracer:
    return trace.get_tracer("kvbus")


def inject(headers: dict[str, str] | None = None, span: Span | None = None) -> dict[str, str]:
    """The W3C trace context of ``span`` (or the current one) as headers."""
    carrier: dict[str, str] = dict(headers or {})
    ctx = trace.set_span_in_context(span) if span is not None else None
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def traceparent(span: Span | None = None) -> str | None:
    """The ``traceparent`` of ``span`` (or the current span), or None when not recording."""
    return inject(span=span).get("traceparent")


def extract(traceparent_value: str | None) -> otel_context.Context | None:
    """A parent context from a ``traceparent`` string (None for no parent)."""
    if not traceparent_value:
        return None
    return _PROPAGATOR.extract({"traceparent": traceparent_value})


@contextmanager
def span(name: str, *, parent: str | otel_context.Context | None = None, kind: trace.SpanKind = trace.SpanKind.INTERNAL,
         attributes: Mapping[str, Any] | None = None) -> Iterator[Span]:
    """A span as a context manager; ``parent`` may be a ``traceparent`` string from the wire.

    Exceptions are recorded on the span and re-raised.
    """
    ctx = extract(parent) if isinstance(parent, str) else parent
    with tracer().start_as_current_span(name, context=ctx, kind=kind, attributes=dict(attributes or {}),
                                        record_exception=True, set_status_on_exception=True) as s:
        yield s


def fail(s: Span, exc: BaseException) -> None:
    s.set_status(Status(StatusCode.ERROR, str(exc)))


class Metrics:
    """The instruments kvbus records (no-ops unless a meter provider is configured)."""

    def __init__(self) -> None:
        m = metrics.get_meter("kvbus")
        self.transfer_latency = m.create_histogram("kvbus.transfer.duration", unit="s",
                                                   description="Send to verified delivery, by medium")
        self.transfer_bytes = m.create_counter("kvbus.transfer.bytes", unit="By", description="Payload bytes by medium")
        self.transfers = m.create_counter("kvbus.transfers", description="Transfers by medium and outcome")
        self.queue_delay = m.create_histogram("kvbus.queue.delay", unit="s", description="Request to grant, per agent")
        self.preemptions = m.create_counter("kvbus.preemptions", description="Transfers paused for a more urgent one")
        self.reservation_misses = m.create_counter("kvbus.reservation.misses", description="Reserved slots missed")
        self.link_bandwidth = m.create_histogram("kvbus.link.bandwidth", unit="By/s",
                                                 description="Observed bandwidth per link")
        self.cache_events = m.create_counter("kvbus.cache.events", description="Cache tier hits, misses, prefetch hits")
        self.memory_peak = m.create_histogram("kvbus.agent.memory", unit="By", description="Agent KV bytes (probe)")
        self.retransmits = m.create_counter("kvbus.chunks.retransmitted", description="Chunks sent again")


_METRICS: Metrics | None = None


def instruments() -> Metrics:
    """The process's instruments (created on first use, after `setup`)."""
    global _METRICS
    if _METRICS is None:
        _METRICS = Metrics()
    return _METRICS
