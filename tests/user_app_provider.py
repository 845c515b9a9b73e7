"""An application that configures OpenTelemetry itself, then uses kvbus as the README shows.

``python tests/user_app_provider.py OTLP_URL NATS_URL NAME GROUP TO NBYTES``: installs its own
tracer provider (service ``my-app``, exporting to ``OTLP_URL``) and meter provider (an in-memory
reader) before `Bus.connect`, sends one context inside a span of its own, and prints as JSON
whether its providers are still the global ones, its span's id, the transfer id and the metric
names its reader saw. The OTEL_* variables are set too (the test points them at the same
endpoint under another service name): kvbus must not install providers of its own.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from opentelemetry import metrics, trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from kvbus import Bus

sys.path.insert(0, str(Path(__file__).parent))
from user_agent import MODEL, context  # the same agent code as the user script


async def main(otlp: str, url: str, name: str, group: str, to: str, nbytes: str) -> None:
    tracer_provider = TracerProvider(resource=Resource.create({"service.name": "my-app"}))
    tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{otlp}/v1/traces")))
    trace.set_tracer_provider(tracer_provider)
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    metrics.set_meter_provider(meter_provider)
    tracer = trace.get_tracer("my-app")
    async with await Bus.connect(url) as bus:
        me = await bus.agent(name, group=group, signature=MODEL)
        with tracer.start_as_current_span("my-app.step") as step:
            report = await me.send(to, context(int(nbytes)))
    data = reader.get_metrics_data()
    names = sorted(
        {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics} if data else set()
    )
    tracer_provider.force_flush()
    print(
        json.dumps(
            {
                "tracer_kept": trace.get_tracer_provider() is tracer_provider,
                "meter_kept": metrics.get_meter_provider() is meter_provider,
                "step_span": format(step.get_span_context().span_id, "016x"),
                "transfer_id": report.transfer_id,
                "metrics": names,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
