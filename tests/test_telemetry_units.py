"""The pieces of `kvbus.telemetry` that need no other process: the ``traceparent`` decoder (wire
input), spans made later (`LazySpan`, `later`), counters read at collection (`Tally`).

They use SDK providers of their own, never the global ones (this process must not trace: see
`test_telemetry.test_tracing_off_costs_nothing`).
"""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvbus import telemetry
from kvbus.telemetry_later import LazySpan, drain, later
from kvbus.telemetry_metrics import Tally

HEX = "0123456789abcdef"


def reference(value: str) -> tuple[int, int, int] | None:
    """What the OpenTelemetry API's own propagator makes of a ``traceparent``."""
    ctx = TraceContextTextMapPropagator().extract({"traceparent": value})
    from opentelemetry import trace

    sc = trace.get_current_span(ctx).get_span_context()
    return (sc.trace_id, sc.span_id, int(sc.trace_flags)) if sc.is_valid else None


def ours(value: str) -> tuple[int, int, int] | None:
    sc = telemetry.span_context(value)
    return (sc.trace_id, sc.span_id, int(sc.trace_flags)) if sc is not None else None


traceparents = st.builds(
    lambda v, t, s, f: f"{v}-{t}-{s}-{f}",
    st.sampled_from(["00", "01", "ff", "0g", "0"]),
    st.one_of(st.text(HEX, min_size=32, max_size=32), st.just("0" * 32), st.text(HEX + "xX", max_size=34)),
    st.one_of(st.text(HEX, min_size=16, max_size=16), st.just("0" * 16), st.text(HEX + "-", max_size=17)),
    st.one_of(st.sampled_from(["00", "01", "ff"]), st.text(HEX, max_size=3)),
)


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        traceparents,
        st.builds(
            lambda pad, v, end: pad + v + end,
            st.sampled_from(["", " ", "\t", "x"]),
            traceparents,
            st.sampled_from(["", " ", "\n", "-", "-x", " x"]),
        ),
        st.text(max_size=80),
    )
)
def test_traceparent_decoder_agrees_with_the_api_propagator(value: str) -> None:
    assert ours(value) == reference(value)


def test_traceparent_decoder_takes_what_the_encoder_writes() -> None:
    value = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert ours(value) == (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 1)
    assert telemetry.extract(value) is not None
    for bad in (None, "", "00-" + "0" * 32 + "-b7ad6b7169203331-01", "garbage", "00-ab-cd-01", "x" * 10_000):
        assert telemetry.span_context(bad) is None and telemetry.extract(bad) is None


def _tracer() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


async def test_a_lazy_span_is_made_after_the_step_with_what_happened_to_it_meanwhile() -> None:
    provider, exporter = _tracer()
    tracer = provider.get_tracer("test")
    parent = tracer.start_span("parent")

    def make(start_ns: int) -> Span:
        return tracer.start_span("lazy", context=telemetry.trace.set_span_in_context(parent), start_time=start_ns)

    lazy = LazySpan(make)
    lazy.set_attributes({"a": 1})
    lazy.add_event("retransmit", {"kvbus.chunk": 3})
    lazy.set_status(StatusCode.ERROR, "broken")
    lazy.end()
    assert lazy.real is telemetry.INVALID_SPAN and not exporter.get_finished_spans()  # nothing made yet
    await asyncio.sleep(0)  # the event loop runs what waited
    (span,) = exporter.get_finished_spans()
    assert span.name == "lazy" and span.parent is not None and span.parent.span_id == parent.get_span_context().span_id
    assert span.attributes == {"a": 1} and [e.name for e in span.events] == ["retransmit"]
    assert span.status.status_code is StatusCode.ERROR
    # The times are when things happened, not when the span was made.
    assert span.start_time is not None and span.end_time is not None
    assert span.start_time <= span.events[0].timestamp <= span.end_time


async def test_later_keeps_order_and_runs_at_once_without_a_loop() -> None:
    seen: list[int] = []
    later(seen.append, 1)
    later(seen.append, 2)
    assert seen == []
    drain()
    assert seen == [1, 2]
    await asyncio.to_thread(later, seen.append, 3)  # no running loop in that thread
    assert seen == [1, 2, 3]


def test_a_failing_callback_does_not_stop_the_others() -> None:
    seen: list[int] = []
    later(lambda: 1 / 0)
    later(seen.append, 1)
    drain()
    assert seen == [1]


def test_tally_reports_its_totals_at_collection() -> None:
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    transfers = Tally(meter, "kvbus.transfers")
    transfers.add(1, {"medium": "full", "outcome": "ok"})
    transfers.add(2, {"medium": "full", "outcome": "ok"})
    transfers.add(1, {"medium": "int8", "outcome": "ok"})
    data = reader.get_metrics_data()
    assert data is not None
    (metric,) = [m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
    points = {p.attributes["medium"]: p.value for p in metric.data.data_points}
    assert metric.name == "kvbus.transfers" and metric.data.is_monotonic
    assert points == {"full": 3, "int8": 1}


def test_later_is_not_held_up_by_a_loop_that_closed_before_its_drain() -> None:
    seen: list[int] = []

    async def queue_and_leave() -> None:
        later(seen.append, 1)
        asyncio.get_running_loop().stop()  # the loop goes away before it runs the drain

    loop = asyncio.new_event_loop()
    task = loop.create_task(queue_and_leave())
    loop.run_forever()
    assert task.done()
    loop.close()

    async def next_loop() -> None:
        later(seen.append, 2)
        await asyncio.sleep(0)

    asyncio.run(next_loop())
    assert seen == [1, 2]
