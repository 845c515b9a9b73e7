"""OpenTelemetry for kvbus: one trace per transfer across processes, and metrics.

Every kvbus process configures itself from the standard variables: `Bus.connect` calls `setup`,
and so does every kvbus service (`kvbus group-scheduler`, `coordinator`, `up`, `demo`). Tracing
is on when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``, or
``OTEL_TRACES_EXPORTER``) asks for it, with ``OTEL_EXPORTER_OTLP_PROTOCOL`` = ``http/protobuf``
(default) or ``grpc``, and ``OTEL_SERVICE_NAME``; Jaeger accepts OTLP directly. Without them the
global no-op tracer is used and spans cost a function call. An application that installed its
own tracer or meter provider (by hand, or with ``opentelemetry-instrument``) keeps it, and
kvbus's spans and instruments join it. `kvbus.telemetry_setup` reads the variables.

The W3C trace context rides in NATS message headers (``traceparent``) and, where a message
is a msgpack control message, in its ``traceparent`` field; `inject` and `extract` convert.
A scheduler or receiver whose sender does not trace records a root span of its own with the
transfer id (``kvbus.transfer_id``); the receiver's links to the scheduler's decision.

Metrics go to a Prometheus scrape endpoint when ``KVBUS_METRICS_PORT`` is set (each service
sets its own port; 0 picks a free one); without it (and without ``OTEL_METRICS_EXPORTER``) the
instruments are no-ops.
"""

from __future__ import annotations

import atexit
import re
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Any, cast

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import (
    INVALID_SPAN,
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from kvbus.telemetry_later import LazySpan as LazySpan
from kvbus.telemetry_later import drain as drain
from kvbus.telemetry_later import later as later
from kvbus.telemetry_metrics import Metrics as Metrics
from kvbus.telemetry_setup import Setup, configure, environ_or

_LOCK = threading.Lock()
#: A W3C ``traceparent``: version, trace id, parent span id, flags (lower-case hex), as the
#: OpenTelemetry API's propagator reads it (its pattern, without its dict, getter and context).
_TRACEPARENT = re.compile(r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$")
#: The service name of a process that names none (an agent process without OTEL_SERVICE_NAME).
DEFAULT_SERVICE_NAME = "kvbus-agent"
#: An empty context: the parent of a root span, whatever span is current.
ROOT = otel_context.Context()
_NO_PROVIDER = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
_NO_STATE = TraceState()
_NO_SPAN: AbstractContextManager[Span] = nullcontext(INVALID_SPAN)

#: Attribute names (OpenTelemetry messaging semantic conventions where they exist).
MESSAGING_SYSTEM = "messaging.system"
MESSAGING_DESTINATION = "messaging.destination.name"
MESSAGING_OPERATION = "messaging.operation.type"
MESSAGE_ID = "messaging.message.id"
MESSAGE_BODY_SIZE = "messaging.message.body.size"


class _State:
    """This process's telemetry: what `setup` did, the cached tracer and instruments, the on/off switch."""

    __slots__ = ("enabled", "metrics", "saved", "setup", "tracer")

    def __init__(self) -> None:
        self.setup: Setup | None = None
        self.tracer: trace.Tracer | None = None
        self.metrics: Metrics | None = None
        self.enabled = True
        self.saved: dict[bool, tuple[Any, Any]] = {}


_S = _State()


def setup(service_name: str | None = None, *, environ: Mapping[str, str] | None = None) -> bool:
    """Configure tracing and metrics for this process from the environment (once; later calls return at once).

    `Bus.connect` and the kvbus services call it; an application that wants to configure by
    hand calls it first (with its own ``service_name``), or installs its own providers before
    `Bus.connect` (kvbus then leaves them as they are).

    Args:
        service_name: used when neither ``OTEL_SERVICE_NAME`` nor ``OTEL_RESOURCE_ATTRIBUTES`` names one.
        environ: read instead of ``os.environ`` (the benchmark turns telemetry on in-process).

    Returns whether spans are recorded (by kvbus's provider or the application's).

    Raises:
        ConfigError: ``KVBUS_METRICS_PORT`` is not a port, or is taken (raised once).
    """
    with _LOCK:
        if _S.setup is not None:
            return _S.setup.tracing
        done = Setup()
        try:
            configure(done, service_name or DEFAULT_SERVICE_NAME, environ_or(environ))
        finally:
            _S.setup = done
            # Spans from now on come straight from the configured provider (not through the
            # API's proxy). Instruments made before stay: the proxy's forward to the global
            # provider, and making them again would register duplicates; only kvbus's own
            # meter (KVBUS_METRICS_PORT beside an application's provider) needs new ones.
            fresh = done.private_meter is not None
            _S.tracer = None
            if fresh:
                _S.metrics = None
            if True in _S.saved:
                _S.saved[True] = (None, None if fresh else _S.saved[True][1])
            # After the providers' own exit hooks are registered, so that this one runs first.
            atexit.register(drain)
        return done.tracing


def metrics_port() -> int | None:
    """The port this process serves Prometheus metrics on (None when it does not)."""
    return _S.setup.metrics_port if _S.setup is not None else None


def shutdown() -> None:
    """Flush spans and metrics (call before a process exits)."""
    drain()
    providers = [trace.get_tracer_provider(), metrics.get_meter_provider()]
    if _S.setup is not None and _S.setup.private_meter is not None:
        providers.append(_S.setup.meter_provider)
    for provider in providers:
        flush = getattr(provider, "force_flush", None)
        if flush is not None:
            flush()


def tracer() -> trace.Tracer:
    """The kvbus tracer (cached: a proxy until a provider is installed, then the provider's own)."""
    t = _S.tracer
    if t is None:
        t = _S.tracer = trace.get_tracer("kvbus") if _S.enabled else trace.NoOpTracer()
    return t


def set_enabled(enabled: bool) -> None:
    """Switch this process's spans and instruments on or off (no-ops) after `setup`.

    The benchmark uses it to time the same process with telemetry on and off; services leave it on.
    """
    if enabled == _S.enabled:
        return
    drain()
    # Keep both sets of instruments: creating them again would register duplicates.
    _S.saved[_S.enabled] = (_S.tracer, _S.metrics)
    _S.enabled = enabled
    _S.tracer, _S.metrics = _S.saved.get(enabled, (None, None))


def tracing() -> bool:
    """Whether this process records kvbus spans at all (a tracer provider that is not a no-op).

    Cheap (no span is made): hot paths skip building span attributes when it is False.
    """
    # An exact type test: isinstance against the API's abstract classes costs a microsecond.
    return _S.enabled and type(trace.get_tracer_provider()) not in _NO_PROVIDER


def end_later(s: Span, attributes: Mapping[str, Any] | None = None) -> None:
    """End ``s`` now (its end time is taken now), doing the work of it `later`."""
    if type(s) is LazySpan:
        if attributes:
            s.set_attributes(attributes)
        s.end()
    elif s.is_recording():
        later(_end, s, attributes, time.time_ns())


def _end(s: Span, attributes: Mapping[str, Any] | None, end_ns: int) -> None:
    if attributes:
        s.set_attributes(attributes)
    s.end(end_time=end_ns)


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
    links: Sequence[Link] | None = None,
    lazy: bool = False,
) -> Span:
    """A span that is not made current (for work that ends in another callback); call ``end()``.

    ``parent`` may be a ``traceparent`` string from the wire, a context or a span (None: the
    current span); `ROOT` starts a trace of its own whatever span is current. ``lazy``: a
    `LazySpan`, made `later` (for a span whose context no message carries).
    """
    if not tracing():
        return INVALID_SPAN
    if lazy:
        if parent is None:
            parent = trace.get_current_span()  # now, not when it is made
        return LazySpan(lambda start_ns: _start(name, parent, kind, attributes, start_time or start_ns, links))
    return _start(name, parent, kind, attributes, start_time, links)


def _start(
    name: str,
    parent: str | otel_context.Context | Span | None,
    kind: trace.SpanKind,
    attributes: Mapping[str, Any] | None,
    start_time: int | None,
    links: Sequence[Link] | None,
) -> Span:
    # Type tests, not isinstance against the API's abstract Span (a microsecond each).
    ctx: otel_context.Context | None
    if parent is None or type(parent) is otel_context.Context:
        ctx = parent
    elif type(parent) is str:
        ctx = extract(parent)
    else:
        ctx = trace.set_span_in_context(parent.real if type(parent) is LazySpan else cast(Span, parent))
    return tracer().start_span(name, context=ctx, kind=kind, attributes=attributes, start_time=start_time, links=links)


def span(
    name: str,
    *,
    parent: str | otel_context.Context | None = None,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    attributes: Mapping[str, Any] | None = None,
    current: bool = True,
    lazy: bool = False,
) -> AbstractContextManager[Span]:
    """A span as a context manager; ``parent`` may be a ``traceparent`` string from the wire.

    Exceptions are recorded on the span and re-raised. ``current=False`` leaves the context as
    it is (cheaper: for a span whose work starts no span of its own); ``lazy`` makes it `later`
    (see `start`). No span, and no cost, when the process does not trace.
    """
    if not tracing():
        return _NO_SPAN
    return _Scope(start(name, parent=parent, kind=kind, attributes=attributes, lazy=lazy), current=current)


def using(s: Span, *, end: bool = True, current: bool = True) -> AbstractContextManager[Span]:
    """``s`` for a block, made current (what ``use_span`` does, without its generator layers):
    exceptions are recorded on it; it ends with the block unless ``end=False``."""
    if s is INVALID_SPAN:
        return _NO_SPAN
    return _Scope(s, current=current, end=end)


class _Scope:
    """A started span for the length of a ``with`` block (made current if asked); it ends with
    the block's end time, the work of ending it done `later`."""

    __slots__ = ("_current", "_end", "_span", "_token")

    def __init__(self, s: Span, *, current: bool, end: bool = True) -> None:
        self._span = s
        self._current = current
        self._end = end
        self._token: Any = None

    def __enter__(self) -> Span:
        if self._current:
            self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._token is not None:
            otel_context.detach(self._token)
        if exc is not None and self._span.is_recording():
            self._span.record_exception(exc)
            self._span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        if self._end:
            end_later(self._span)


def link_to(traceparent_value: str | None, attributes: Mapping[str, Any] | None = None) -> list[Link]:
    """A span link to the span a ``traceparent`` names (empty when there is none, or it is not valid)."""
    target = span_context(traceparent_value)
    return [] if target is None else [Link(target, attributes)]


def inject(headers: dict[str, str] | None = None, span: Span | None = None) -> dict[str, str]:
    """The W3C trace context of ``span`` (or the current one) as headers."""
    carrier: dict[str, str] = dict(headers or {})
    tp = traceparent(span)
    if tp is not None:
        carrier["traceparent"] = tp
    return carrier


def traceparent(span: Span | None = None) -> str | None:
    """The ``traceparent`` of ``span`` (or the current span), or None when there is none."""
    ctx = (span if span is not None else trace.get_current_span()).get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def extract(traceparent_value: str | None) -> otel_context.Context | None:
    """A parent context from a ``traceparent`` string from the wire (None when there is none or it
    is not a valid one, as W3C Trace Context says: then the receiving side starts a trace)."""
    ctx = span_context(traceparent_value)
    return None if ctx is None else trace.set_span_in_context(NonRecordingSpan(ctx))


def span_context(traceparent_value: str | None) -> SpanContext | None:
    """The remote span a ``traceparent`` names, or None when it is missing or not valid."""
    if not traceparent_value or len(traceparent_value) > 512:
        return None
    m = _TRACEPARENT.search(traceparent_value)
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    ctx = SpanContext(
        int(trace_id, 16),
        int(span_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(int(flags, 16)),
        trace_state=_NO_STATE,
    )
    return ctx if ctx.is_valid else None


def fail(s: Span, exc: BaseException) -> None:
    """Mark span ``s`` as failed with ``exc``'s message."""
    s.set_status(Status(StatusCode.ERROR, str(exc)))


def instruments() -> Metrics:
    """The process's instruments (created on first use, after `setup`)."""
    m = _S.metrics
    if m is None:
        private = _S.setup.private_meter if _S.setup is not None else None
        m = _S.metrics = Metrics(private if _S.enabled else metrics.NoOpMeter("kvbus"))
    return m


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
