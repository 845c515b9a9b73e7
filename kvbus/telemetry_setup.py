"""Configuring the OpenTelemetry SDK for a kvbus process from the standard variables.

`kvbus.telemetry.setup` (called by `Bus.connect` and by every kvbus service) lands here. It
installs a tracer provider and a meter provider only when the variables ask for them and the
process has none yet: an application that configured OpenTelemetry itself, by hand or through
``opentelemetry-instrument`` (whose configurator runs before the program and always installs
SDK providers), keeps its providers and kvbus's spans and instruments join them.

Traces: ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``, ``none`` or an exporter's entry point
name; when unset, ``otlp`` if an ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` is set, else no
tracing), ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` (``http/protobuf``, the default, or
``grpc``), ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, the sampler and batch
variables (``OTEL_TRACES_SAMPLER[_ARG]``, ``OTEL_BSP_*``), which the SDK reads itself.

Metrics: ``KVBUS_METRICS_PORT`` serves kvbus's instruments on a Prometheus endpoint (0: a free
port); ``OTEL_METRICS_EXPORTER`` (``otlp``, ``prometheus``, ``console``) adds readers when set
explicitly (never by default: a trace-only collector such as Jaeger refuses OTLP metrics).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from opentelemetry import metrics, trace

from kvbus.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_PROTOCOL = "http/protobuf"
PROTOCOLS = ("http/protobuf", "grpc")
#: The port `OTEL_METRICS_EXPORTER=prometheus` serves on when OTEL_EXPORTER_PROMETHEUS_PORT is unset.
PROMETHEUS_DEFAULT_PORT = 9464


@dataclass(slots=True)
class Setup:
    """What `configure` found and did (one per process; filled in place, so a failure keeps what was done)."""

    tracing: bool = False
    """Spans are recorded (a provider that is not a no-op: kvbus's or the application's)."""
    tracer_provider: Any = None
    """The provider kvbus installed (None when it installed none)."""
    application_tracer: bool = False
    """The application had its own tracer provider: kvbus's spans join it."""
    meter_provider: Any = None
    """The provider kvbus created (global, or private when the application has one)."""
    private_meter: Any = None
    """A meter of kvbus's own provider when the application's is global (KVBUS_METRICS_PORT set)."""
    application_meter: bool = False
    """The application had its own meter provider."""
    metrics_port: int | None = None
    """The port kvbus serves Prometheus metrics on."""


def disabled(env: Mapping[str, str]) -> bool:
    """Whether ``OTEL_SDK_DISABLED`` turns the SDK off."""
    return env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def _names(value: str | None) -> list[str]:
    names = [n.strip().lower() for n in (value or "").split(",") if n.strip()]
    return [] if names == ["none"] else [n for n in names if n != "none"]


def trace_exporters(env: Mapping[str, str]) -> list[str]:
    """The span exporters the variables ask for (empty: no tracing)."""
    if disabled(env):
        return []
    if "OTEL_TRACES_EXPORTER" in env:
        return _names(env["OTEL_TRACES_EXPORTER"])
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return ["otlp"]
    return []


def metric_exporters(env: Mapping[str, str]) -> list[str]:
    """The metric readers the variables ask for: ``OTEL_METRICS_EXPORTER`` only when set explicitly."""
    return [] if disabled(env) else _names(env.get("OTEL_METRICS_EXPORTER"))


def has_tracer_provider() -> bool:
    """Whether the process already has a tracer provider of its own (anything but the API's proxy)."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def has_meter_provider() -> bool:
    """Whether the process already has a meter provider of its own (anything but the API's proxy)."""
    from opentelemetry.metrics._internal import _ProxyMeterProvider

    return not isinstance(metrics.get_meter_provider(), _ProxyMeterProvider)


def configure(done: Setup, service_name: str, env: Mapping[str, str]) -> None:
    """Install what the variables ask for into ``done``, keeping the providers an application installed.

    Raises:
        ConfigError: a metrics port is not a port number, or is taken.
    """
    if disabled(env):
        return
    if has_tracer_provider():
        provider = trace.get_tracer_provider()
        done.application_tracer = True
        done.tracing = not isinstance(provider, trace.NoOpTracerProvider)
        logger.debug("kvbus spans join the application's tracer provider (%s)", type(provider).__name__)
    else:
        exporters = [e for e in (_span_exporter(n, env) for n in trace_exporters(env)) if e is not None]
        if exporters:
            done.tracer_provider = _install_tracing(service_name, env, exporters)
            done.tracing = True
    _configure_metrics(done, service_name, env)


def resource(service_name: str, env: Mapping[str, str]) -> Any:
    """The process's resource: ``OTEL_RESOURCE_ATTRIBUTES``, then ``OTEL_SERVICE_NAME``, then ``service_name``."""
    from opentelemetry.sdk.resources import Resource

    res = Resource.create({})
    if env.get("OTEL_SERVICE_NAME"):
        res = res.merge(Resource({"service.name": env["OTEL_SERVICE_NAME"]}))
    elif str(res.attributes.get("service.name", "")).startswith("unknown_service"):
        res = res.merge(Resource({"service.name": service_name}))
    return _hashed_resource()(res.attributes, res.schema_url)


@functools.cache
def _hashed_resource() -> type:
    from opentelemetry.sdk.resources import Resource

    class HashedResource(Resource):
        """A resource that computes its hash once: the OTLP encoder hashes the resource of every
        span it exports, and `Resource.__hash__` serialises every attribute to JSON each time."""

        def __init__(self, attributes: Any, schema_url: str | None = None) -> None:
            super().__init__(attributes, schema_url)
            self._hash = super().__hash__()

        def __hash__(self) -> int:
            return self._hash

        def __eq__(self, other: object) -> bool:
            return super().__eq__(other)

    return HashedResource


def _protocol(env: Mapping[str, str], signal: str) -> str:
    protocol = env.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = (protocol or DEFAULT_PROTOCOL).strip().lower()
    if protocol not in PROTOCOLS:
        logger.warning("OTLP protocol %r is not supported here; using %s", protocol, DEFAULT_PROTOCOL)
        protocol = DEFAULT_PROTOCOL
    return protocol


def _endpoint(env: Mapping[str, str], signal: str, protocol: str) -> str | None:
    """The signal's endpoint: its own variable as is; the generic one is a base URL for HTTP."""
    own = env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    if own:
        return own
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not base:
        return None  # the exporter's default (localhost)
    return base if protocol == "grpc" else base.rstrip("/") + f"/v1/{signal.lower()}"


def _span_exporter(name: str, env: Mapping[str, str]) -> Any:
    if name == "otlp":
        protocol = _protocol(env, "TRACES")
        endpoint = _endpoint(env, "TRACES", protocol)
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

            return Grpc(endpoint=endpoint)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

        return Http(endpoint=endpoint)
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    return _entry_point("opentelemetry_traces_exporter", name)


def _entry_point(group: str, name: str) -> Any:
    """An exporter a package registers under ``name`` (what the SDK's configurator also looks up)."""
    for ep in entry_points(group=group, name=name):
        try:
            return ep.load()()
        except Exception:
            logger.exception("could not load the %s exporter %r", group, name)
            return None
    logger.warning("no %s named %r is installed: ignored", group, name)
    return None


def _install_tracing(service_name: str, env: Mapping[str, str], exporters: list[Any]) -> Any:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    res = resource(service_name, env)
    provider = TracerProvider(resource=res)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    logger.info(
        "tracing as %s to %s", res.attributes.get("service.name"), ", ".join(type(e).__module__ for e in exporters)
    )
    return provider


def _configure_metrics(done: Setup, service_name: str, env: Mapping[str, str]) -> None:
    port = env.get("KVBUS_METRICS_PORT", "").strip()
    names = metric_exporters(env)
    if has_meter_provider():
        done.application_meter = True
        if not port:
            logger.debug("kvbus instruments join the application's meter provider")
            return
        # The application keeps its provider; the endpoint asked for serves kvbus's own instruments.
        names = []
    readers: list[Any] = []
    prometheus_ports: list[tuple[str, int]] = []
    if port:
        prometheus_ports.append(("", _port(env, "KVBUS_METRICS_PORT", 0)))
    for name in names:
        if name == "prometheus":
            host = env.get("OTEL_EXPORTER_PROMETHEUS_HOST", "localhost")
            prometheus_ports.append((host, _port(env, "OTEL_EXPORTER_PROMETHEUS_PORT", PROMETHEUS_DEFAULT_PORT)))
        else:
            reader = _metric_reader(name, env)
            if reader is not None:
                readers.append(reader)
    if prometheus_ports:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server

        readers.append(PrometheusMetricReader())  # one reader (one registry), as many endpoints as asked
        for i, (host, p) in enumerate(prometheus_ports):
            try:
                served = start_http_server(p, addr=host or "0.0.0.0")
            except OSError as exc:
                raise ConfigError(f"cannot serve Prometheus metrics on port {p}: {exc}") from None
            if p == 0 and isinstance(served, tuple):
                p = served[0].server_port  # an ephemeral port: say which
            if i == 0 and port:
                done.metrics_port = p
            logger.info("Prometheus metrics on %s:%d", host or "*", p)
    if not readers:
        return
    from opentelemetry.sdk.metrics import MeterProvider

    # Exemplars (a span id beside a measurement) cost time on every measurement, and a Prometheus
    # scrape in the text format shows none: off unless OTEL_METRICS_EXEMPLAR_FILTER asks for them.
    exemplars: dict[str, Any] = {}
    if not env.get("OTEL_METRICS_EXEMPLAR_FILTER"):
        from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter

        exemplars["exemplar_filter"] = AlwaysOffExemplarFilter()
    provider = MeterProvider(resource=resource(service_name, env), metric_readers=readers, **exemplars)
    done.meter_provider = provider
    if done.application_meter:
        done.private_meter = provider.get_meter("kvbus")
        logger.info("kvbus metrics on their own endpoint; the application's meter provider is left as it is")
    else:
        metrics.set_meter_provider(provider)


def _port(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, "").strip()
    if not value:
        return default
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigError(f"{name}={value!r} is not a port number (0-65535; 0 picks a free one)")
    return port


def _metric_reader(name: str, env: Mapping[str, str]) -> Any:
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    if name == "otlp":
        protocol = _protocol(env, "METRICS")
        endpoint = _endpoint(env, "METRICS", protocol)
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as Grpc

            return PeriodicExportingMetricReader(Grpc(endpoint=endpoint))
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as Http

        return PeriodicExportingMetricReader(Http(endpoint=endpoint))
    if name == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

        return PeriodicExportingMetricReader(ConsoleMetricExporter())
    exporter = _entry_point("opentelemetry_metrics_exporter", name)
    if exporter is None:
        return None
    from opentelemetry.sdk.metrics.export import MetricReader

    return exporter if isinstance(exporter, MetricReader) else PeriodicExportingMetricReader(exporter)


def environ_or(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    """``environ``, or the process's environment."""
    return os.environ if environ is None else environ
