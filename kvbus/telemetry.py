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
    """Whether the environment names an OTLP endpoint for traces (and does not disable the SDK)."""
    env = os.environ if environ is None else environ
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")) and (
        env.get("OTEL_SDK_DISABLED", "").lower() != "true"
    )


def setup(service_name: str | None = None, *, environ: Mapping[str, str] | None = None) -> bool:
    """Configure tracing and metrics for this process from the environment (idempotent).

    Args:
        service_name: used when ``OTEL_SERVICE_NAME`` is not set.
        environ: read instead of ``os.environ`` (the benchmark turns telemetry on in-process).

    Returns whether tracing exports anywhere.
    """
    env = os.environ if environ is None else environ
    with _LOCK:
        if "done" in _CONFIGURED:
            return bool(_CONFIGURED.get("tracing"))
        _CONFIGURED["done"] = True
        name = env.get("OTEL_SERVICE_NAME") or service_name or "kvbus"
        if tracing_configured(env):
            _setup_tracing(name, env)
            _CONFIGURED["tracing"] = True
        port = env.get("KVBUS_METRICS_PORT")
        if port:
            _CONFIGURED["metrics_port"] = _setup_metrics(name, int(port))
        return bool(_CONFIGURED.get("tracing"))


def metrics_port() -> int | None:
    """The port this process serves Prometheus metrics on (None when it does not)."""
    return _CONFIGURED.get("metrics_port")


def _setup_tracing(name: str, env: Mapping[str, str]) -> None:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter

        exporter: SpanExporter = GrpcSpanExporter(endpoint=endpoint or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter

        # The generic endpoint is a base URL: the HTTP exporter appends the signal's path to it.
        if not endpoint and env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            endpoint = env["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
        exporter = HttpSpanExporter(endpoint=endpoint)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _CONFIGURED["provider"] = provider
    logger.info("tracing to OTLP (%s) as %s", protocol, name)


def _setup_metrics(name: str, port: int) -> int:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource
    from prometheus_client import start_http_server

    served = start_http_server(port)
    if port == 0 and isinstance(served, tuple):
        port = served[0].server_port  # an ephemeral port: say which
    metrics.set_meter_provider(
        MeterProvider(resource=Resource.create({"service.name": name}), metric_readers=[PrometheusMetricReader()])
    )
    logger.info("Prometheus metrics on :%d", port)
    return port


def shutdown() -> None:
    """Flush spans (call before a process exits)."""
    provider = trace.get_tracer_provider()
    flush = getattr(provider, "force_flush", None)
    if flush is not None:
        flush()


_TRACER: trace.Tracer | None = None
_ENABLED = True
_SAVED: dict[bool, tuple[Any, Any]] = {}


def tracer() -> trace.Tracer:
    """The kvbus tracer (cached: a proxy until `setup` installs a provider, then the SDK's)."""
    global _TRACER
    if _TRACER is None:
        _TRACER = trace.get_tracer("kvbus") if _ENABLED else trace.NoOpTracer()
    return _TRACER


def set_enabled(enabled: bool) -> None:
    """Switch this process's spans and instruments on or off (no-ops) after `setup`.

    The benchmark uses it to time the same process with telemetry on and off; services leave it on.
    """
    global _ENABLED, _TRACER, _METRICS
    if enabled == _ENABLED:
        return
    # Keep both sets of instruments: creating them again would register duplicates.
    _SAVED[_ENABLED] = (_TRACER, _METRICS)
    _ENABLED = enabled
    _TRACER, _METRICS = _SAVED.get(enabled, (None, None))


def is_recording() -> bool:
    """Whether the current span records (build costly attributes only then)."""
    return trace.get_current_span().is_recording()


def start(
    name: str,
    *,
    parent: str | otel_context.Context | Span | None = None,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    attributes: Mapping[str, Any] | None = None,
    start_time: int | None = None,
) -> Span:
    """A span that is not made current (for work that ends in another callback); call ``end()``.

    ``parent`` may be a ``traceparent`` string from the wire, a context or a span.
    """
    if isinstance(parent, str):
        ctx = extract(parent)
    elif isinstance(parent, Span):
        ctx = trace.set_span_in_context(parent)
    else:
        ctx = parent
    return tracer().start_span(name, context=ctx, kind=kind, attributes=attributes, start_time=start_time)


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
def span(
    name: str,
    *,
    parent: str | otel_context.Context | None = None,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[Span]:
    """A span as a context manager; ``parent`` may be a ``traceparent`` string from the wire.

    Exceptions are recorded on the span and re-raised.
    """
    ctx = extract(parent) if isinstance(parent, str) else parent
    with tracer().start_as_current_span(
        name,
        context=ctx,
        kind=kind,
        attributes=dict(attributes or {}),
        record_exception=True,
        set_status_on_exception=True,
    ) as s:
        yield s


def fail(s: Span, exc: BaseException) -> None:
    """Mark span ``s`` as failed with ``exc``'s message."""
    s.set_status(Status(StatusCode.ERROR, str(exc)))


class Metrics:
    """The instruments kvbus records (no-ops unless a meter provider is configured)."""

    def __init__(self, meter: metrics.Meter | None = None) -> None:
        m = meter or metrics.get_meter("kvbus")
        self.transfer_latency = m.create_histogram(
            "kvbus.transfer.duration", unit="s", description="Send to verified delivery, by medium"
        )
        self.transfer_bytes = m.create_counter("kvbus.transfer.bytes", unit="By", description="Payload bytes by medium")
        self.transfers = m.create_counter("kvbus.transfers", description="Transfers by medium and outcome")
        self.queue_delay = m.create_histogram("kvbus.queue.delay", unit="s", description="Request to grant, per agent")
        self.preemptions = m.create_counter("kvbus.preemptions", description="Transfers paused for a more urgent one")
        self.reservation_misses = m.create_counter("kvbus.reservation.misses", description="Reserved slots missed")
        self.link_bandwidth = m.create_histogram(
            "kvbus.link.bandwidth", unit="By/s", description="Observed bandwidth per link"
        )
        self.cache_events = m.create_counter("kvbus.cache.events", description="Cache tier hits, misses, prefetch hits")
        self.memory_peak = m.create_histogram("kvbus.agent.memory", unit="By", description="Agent KV bytes (probe)")
        self.retransmits = m.create_counter("kvbus.chunks.retransmitted", description="Chunks sent again")


_METRICS: Metrics | None = None


def instruments() -> Metrics:
    """The process's instruments (created on first use, after `setup`)."""
    global _METRICS
    if _METRICS is None:
        _METRICS = Metrics(None if _ENABLED else metrics.NoOpMeter("kvbus"))
    return _METRICS


class CacheMetrics:
    """A cache tier listener (`kvbus.cachetier.TierListener` shape) counting hits, misses and prefetch hits.

    Remote fetches count as ``fetched``, remote misses as ``miss``, rebuilt blocks as ``recomputed``;
    blocks a prefetch brought in and a later ``get`` found resident count as ``prefetch_hit`` (read
    from the tier's stats by `observe`).
    """

    def __init__(self, agent: str, inner: Any = None) -> None:
        self.agent = agent
        self.inner = inner
        self._seen: dict[str, int] = {}

    def _count(self, event: str, keys: list[str]) -> None:
        instruments().cache_events.add(len(keys), {"agent": self.agent, "event": event})

    def _forward(self, name: str, keys: list[str]) -> None:
        hook = getattr(self.inner, name, None)
        if hook is not None:
            hook(keys)

    def offloaded(self, keys: list[str]) -> None:
        """Count blocks written to the remote tier and forward to the wrapped listener."""
        self._count("offloaded", keys)
        self._forward("offloaded", keys)

    def fetched(self, keys: list[str]) -> None:
        """Count blocks read back from the remote tier and forward to the wrapped listener."""
        self._count("fetched", keys)
        self._forward("fetched", keys)

    def missed(self, keys: list[str]) -> None:
        """Count remote misses (``miss``) and forward to the wrapped listener."""
        self._count("miss", keys)
        self._forward("missed", keys)

    def dropped(self, keys: list[str]) -> None:
        """Count blocks dropped without a remote copy and forward to the wrapped listener."""
        self._count("dropped", keys)
        self._forward("dropped", keys)

    def recomputed(self, keys: list[str]) -> None:
        """Count blocks rebuilt by recomputing and forward to the wrapped listener."""
        self._count("recomputed", keys)
        self._forward("recomputed", keys)

    def observe(self, stats: Any) -> None:
        """Count the growth of the tier's ``hits`` and ``prefetch_hits`` counters since the last call."""
        for field, event in (("hits", "hit"), ("prefetch_hits", "prefetch_hit")):
            now = int(getattr(stats, field, 0) or 0)
            grown = now - self._seen.get(field, 0)
            self._seen[field] = now
            if grown > 0:
                instruments().cache_events.add(grown, {"agent": self.agent, "event": event})
