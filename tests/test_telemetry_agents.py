"""Traces and metrics from the user's own agent processes, configured by the variables alone.

Every process is a real OS process: a `kvbus group-scheduler`, a receiving agent and a sending
agent written as a user writes them (`tests/user_agent.py`: `Bus.connect`, `bus.agent`, `send` /
`inbox`, no telemetry call), exporting to a real OTLP/HTTP endpoint (`tests.otlp`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.trace import SpanKind

from kvbus.errors import ConfigError
from kvbus.telemetry_setup import Setup, configure, metric_exporters, trace_exporters
from tests.otlp import OtlpReceiver, SpanRecord

HERE = Path(__file__).parent
USER_AGENT = str(HERE / "user_agent.py")
USER_APP = str(HERE / "user_app_provider.py")
GROUP = "agents-otel"
RX = "user-rx"
NBYTES = 3 << 20
TRANSFER_SPANS = {"kvbus.send", "kvbus.grant.wait", "kvbus.encode", "kvbus.stream", "kvbus.schedule", "kvbus.receive"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env() -> dict[str, str]:
    """This environment without any telemetry variable."""
    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "KVBUS_METRICS_PORT"}


def otel_env(otlp: str, service: str, metrics_port: int | None = None) -> dict[str, str]:
    """The standard variables a deployment sets, pointing at ``otlp``."""
    env = clean_env()
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp,
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_SERVICE_NAME=service,
        OTEL_BSP_SCHEDULE_DELAY="50",
        PYTHONUNBUFFERED="1",
    )
    if metrics_port is not None:
        env["KVBUS_METRICS_PORT"] = str(metrics_port)
    return env


def readline(p: subprocess.Popen[str], want: str, timeout: float = 30.0) -> str:
    """The first line of ``p``'s output that contains ``want``."""
    assert p.stdout is not None
    end = time.monotonic() + timeout
    seen: list[str] = []
    while time.monotonic() < end:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"process exited ({p.poll()}) before {want!r}: {seen}")
        seen.append(line.strip())
        if want in line:
            return line.strip()
    raise TimeoutError(f"no {want!r} in {seen}")


def stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(10)


def finish(p: subprocess.Popen[str]) -> int:
    """Close the agent's standard input (it exits normally) and return its exit code."""
    assert p.stdin is not None
    p.stdin.close()
    return p.wait(30)


def scrape(port: int, until: str, timeout: float = 15.0) -> str:
    end = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            page = r.read().decode()
        if until in page or time.monotonic() > end:
            return page
        time.sleep(0.1)


def of_transfer(spans: list[SpanRecord], transfer_id: str) -> list[SpanRecord]:
    return [s for s in spans if s.attributes.get("kvbus.transfer_id") == transfer_id]


@pytest.fixture(scope="module")
def stack(nats_url: str) -> Iterator[dict[str, Any]]:
    """An OTLP endpoint, a traced scheduler process and a traced receiving agent process."""
    with OtlpReceiver() as otlp:
        procs: list[subprocess.Popen[str]] = []
        try:
            sched = subprocess.Popen(
                [sys.executable, "-m", "kvbus.app.cli", "group-scheduler", "--group", GROUP, "--nats-url", nats_url],
                env=otel_env(otlp.url, "agents-scheduler"),
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(sched)
            readline(sched, "group scheduler for")
            rx = subprocess.Popen(
                [sys.executable, USER_AGENT, nats_url, RX, GROUP, "receive"],
                env=otel_env(otlp.url, "agents-receiver"),
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(rx)
            readline(rx, "ready")
            yield {"otlp": otlp, "nats_url": nats_url, "rx": rx}
        finally:
            stop(procs)


def send(
    stack: dict[str, Any], name: str, env: dict[str, str], *, command: list[str] | None = None, stderr: Any = None
) -> Any:
    """Start a sending user agent; returns the process and its report (it stays up until `finish`)."""
    cmd = [*(command or [sys.executable]), USER_AGENT, stack["nats_url"], name, GROUP, "send", RX, str(NBYTES)]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stdin=subprocess.PIPE, stderr=stderr, text=True)
    try:
        report = json.loads(readline(p, "transfer_id", timeout=60))
    except BaseException:
        stop([p])
        raise
    delivered = json.loads(readline(stack["rx"], report["transfer_id"]))
    assert delivered["sender"] == name
    return p, report


@pytest.fixture(scope="module")
def user_transfer(stack: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A user's sending agent with the variables set (and KVBUS_METRICS_PORT): its report, spans, metrics."""
    otlp: OtlpReceiver = stack["otlp"]
    port = free_port()
    p, report = send(stack, "user-tx", otel_env(otlp.url, "agents-sender", port))
    try:
        tid = report["transfer_id"]
        page = scrape(port, until="kvbus_transfers")
        spans = otlp.wait_until(lambda got: {s.name for s in _trace_of(got, tid)} >= TRANSFER_SPANS)
        yield {"report": report, "spans": _trace_of(spans, tid), "metrics": page, "exit": finish(p)}
    finally:
        stop([p])


def _trace_of(spans: list[SpanRecord], transfer_id: str) -> list[SpanRecord]:
    """Every span of the trace whose ``kvbus.send`` has this transfer id."""
    roots = [s for s in of_transfer(spans, transfer_id) if s.name == "kvbus.send"]
    return [s for s in spans if roots and s.trace_id == roots[0].trace_id]


def test_user_agents_export_one_trace_with_nothing_but_the_variables(user_transfer: dict[str, Any]) -> None:
    spans = user_transfer["spans"]
    assert {s.name for s in spans} >= TRANSFER_SPANS
    by_name = {s.name: s for s in spans}
    root = by_name["kvbus.send"]
    assert root.parent_id == "" and root.kind == SpanKind.PRODUCER.value + 1
    assert {s.service for s in spans} == {"agents-sender", "agents-scheduler", "agents-receiver"}
    assert by_name["kvbus.send"].service == "agents-sender"
    assert by_name["kvbus.schedule"].service == "agents-scheduler"
    assert by_name["kvbus.receive"].service == "agents-receiver"
    assert by_name["kvbus.schedule"].parent_id == by_name["kvbus.grant.wait"].span_id
    assert by_name["kvbus.receive"].parent_id == root.span_id
    # One export per span: no second provider in any process.
    assert len([s for s in spans if s.name == "kvbus.send"]) == 1
    assert user_transfer["exit"] == 0


def test_user_agent_serves_prometheus_metrics_from_kvbus_metrics_port(user_transfer: dict[str, Any]) -> None:
    page = user_transfer["metrics"]
    for name in ("kvbus_transfers", "kvbus_transfer_duration", "kvbus_transfer_bytes", "kvbus_queue_delay"):
        assert name in page, name
    assert 'agent="user-tx"' in page
    assert f'medium="{user_transfer["report"]["medium"]}"' in page
    assert 'service_name="agents-sender"' in page  # the resource, as Prometheus target_info


def test_a_sender_that_does_not_trace_still_gets_scheduler_and_receiver_spans(stack: dict[str, Any]) -> None:
    otlp: OtlpReceiver = stack["otlp"]
    p, report = send(stack, "quiet-tx", clean_env())
    try:
        tid = report["transfer_id"]
        spans = otlp.wait_until(
            lambda got: {"kvbus.schedule", "kvbus.receive"} <= {s.name for s in of_transfer(got, tid)}
        )
        assert finish(p) == 0
    finally:
        stop([p])
    mine = {s.name: s for s in of_transfer(spans, tid)}
    assert "kvbus.send" not in mine
    schedule, receive = mine["kvbus.schedule"], mine["kvbus.receive"]
    # Root spans of their own, found by the transfer id; the receiver's links to the decision.
    assert schedule.parent_id == "" and schedule.service == "agents-scheduler"
    assert receive.parent_id == "" and receive.service == "agents-receiver"
    assert schedule.trace_id != receive.trace_id
    assert receive.links == [(schedule.trace_id, schedule.span_id)]
    children = {s.name for s in spans if s.trace_id == receive.trace_id and s.parent_id == receive.span_id}
    assert {"kvbus.reassemble", "kvbus.decode"} <= children


def test_an_application_with_its_own_providers_keeps_them(stack: dict[str, Any]) -> None:
    otlp: OtlpReceiver = stack["otlp"]
    env = otel_env(otlp.url, "not-the-app")  # the variables too: kvbus must still leave the app's providers
    done = subprocess.run(
        [sys.executable, USER_APP, otlp.url, stack["nats_url"], "app-tx", GROUP, RX, str(NBYTES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["tracer_kept"] and out["meter_kept"]
    # kvbus did not even try to install a provider of its own (the API would refuse, and say so).
    assert "Overriding of current" not in done.stderr, done.stderr
    # kvbus's instruments joined the application's meter provider.
    assert {"kvbus.transfers", "kvbus.transfer.duration"} <= set(out["metrics"])
    tid = out["transfer_id"]
    spans = otlp.wait_until(lambda got: "kvbus.receive" in {s.name for s in of_transfer(got, tid)})
    send_span = next(s for s in of_transfer(spans, tid) if s.name == "kvbus.send")
    # kvbus's spans went to the application's provider, under the application's span.
    assert send_span.service == "my-app" and send_span.parent_id == out["step_span"]
    assert not [s for s in spans if s.service == "not-the-app"]
    receive = next(s for s in of_transfer(spans, tid) if s.name == "kvbus.receive")
    assert receive.trace_id == send_span.trace_id


def test_opentelemetry_instrument_configures_and_kvbus_joins(stack: dict[str, Any], tmp_path: Path) -> None:
    pytest.importorskip("opentelemetry.distro")
    instrument = shutil.which("opentelemetry-instrument", path=str(Path(sys.executable).parent))
    if instrument is None:
        pytest.skip("opentelemetry-instrument is not installed")
    otlp: OtlpReceiver = stack["otlp"]
    env = otel_env(otlp.url, "agents-instrumented")
    env.update(OTEL_METRIC_EXPORT_INTERVAL="200", OTEL_LOGS_EXPORTER="none")
    with open(tmp_path / "stderr", "w+") as err:
        p, report = send(stack, "instrumented-tx", env, command=[instrument, sys.executable], stderr=err)
        try:
            tid = report["transfer_id"]
            spans = otlp.wait_until(lambda got: {s.name for s in _trace_of(got, tid)} >= TRANSFER_SPANS)
            assert finish(p) == 0
        finally:
            stop([p])
        err.seek(0)
        stderr = err.read()
    assert "Overriding of current" not in stderr, stderr
    trace = _trace_of(spans, tid)
    assert {s.name for s in trace} >= TRANSFER_SPANS
    mine = [s for s in trace if s.service == "agents-instrumented"]
    # The spans went through the provider opentelemetry-instrument's configurator installed
    # (it alone stamps telemetry.auto.version), once each: kvbus installed none of its own.
    assert mine and all("telemetry.auto.version" in s.resource for s in mine)
    assert len([s for s in mine if s.name == "kvbus.send"]) == 1
    # Its meter provider (OTEL_METRICS_EXPORTER defaults to otlp there) carries kvbus's instruments.
    deadline = time.monotonic() + 15
    while ("agents-instrumented", "kvbus.transfers") not in otlp.metrics and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ("agents-instrumented", "kvbus.transfers") in otlp.metrics


def test_which_variables_turn_tracing_and_metrics_on() -> None:
    assert trace_exporters({}) == []
    assert trace_exporters({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == ["otlp"]
    assert trace_exporters({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}) == ["otlp"]
    assert trace_exporters({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_TRACES_EXPORTER": "none"}) == []
    assert trace_exporters({"OTEL_TRACES_EXPORTER": "console,otlp"}) == ["console", "otlp"]
    assert trace_exporters({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_SDK_DISABLED": "true"}) == []
    # Metrics over OTLP only when asked by name (a trace-only collector refuses them).
    assert metric_exporters({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}) == []
    assert metric_exporters({"OTEL_METRICS_EXPORTER": "otlp"}) == ["otlp"]


@pytest.mark.parametrize("port", ["abc", "-1", "70000"])
def test_a_bad_metrics_port_is_a_config_error(port: str) -> None:
    with pytest.raises(ConfigError, match="KVBUS_METRICS_PORT"):
        configure(Setup(), "kvbus-test", {"KVBUS_METRICS_PORT": port})
