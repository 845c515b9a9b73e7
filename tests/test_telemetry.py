"""Observability: one trace per transfer across OS processes, Prometheus metrics, `kvbus top`.

A test OTLP/HTTP receiver (`tests.otlp`) decodes what the real OTLP exporters of the sender, the
group scheduler and the receiver processes send it. (`test_telemetry_agents.py` runs agents as a
user writes them, with nothing but the variables.)
"""

from __future__ import annotations

import asyncio
import json
import os
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

from kvbus import telemetry
from kvbus.app.local import NatsServer
from kvbus.config import redact_url
from tests.otlp import OtlpReceiver

HERE = Path(__file__).parent
PEER = str(HERE / "telemetry_peer.py")
GROUP = "otel"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(otlp: str, service: str, metrics_port: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp,
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_SERVICE_NAME=service,
        OTEL_BSP_SCHEDULE_DELAY="50",
        PYTHONUNBUFFERED="1",
    )
    env.pop("OTEL_SDK_DISABLED", None)
    if metrics_port is not None:
        env["KVBUS_METRICS_PORT"] = str(metrics_port)
    return env


def _stop(procs: list[subprocess.Popen[str]], *, kill: bool = True) -> None:
    # Killed by default: what the tests look at (spans, output) has arrived by then, and a
    # graceful stop spends seconds releasing leases.
    for p in procs:
        if p.poll() is None:
            p.kill() if kill else p.terminate()
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()


def _readline(p: subprocess.Popen[str], want: str, timeout: float = 20.0) -> list[str]:
    """Lines from ``p`` up to one containing ``want``."""
    assert p.stdout is not None
    lines: list[str] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"process exited ({p.poll()}) before {want!r}: {lines}")
        lines.append(line.strip())
        if want in line:
            return lines
    raise TimeoutError(f"no {want!r} in {lines}")


def _scrape(port: int, until: str = "", timeout: float = 15.0) -> str:
    """The Prometheus page on ``port`` (once it contains ``until``, or at the timeout)."""
    end = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            page = r.read().decode()
        if until in page or time.monotonic() > end:
            return page
        time.sleep(0.1)


@pytest.fixture(scope="module")
def transfer(nats_url: str) -> Iterator[dict[str, Any]]:
    """One transfer between agents in separate OS processes, its scheduler in a third, all tracing."""
    with OtlpReceiver() as otlp:
        sched_port, tx_port = free_port(), free_port()
        procs: list[subprocess.Popen[str]] = []
        try:
            sched = subprocess.Popen(
                [sys.executable, "-m", "kvbus.app.cli", "group-scheduler", "--group", GROUP, "--nats-url", nats_url],
                env=_env(otlp.url, "test-scheduler", sched_port),
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(sched)
            _readline(sched, "group scheduler for")
            rx = subprocess.Popen(
                [sys.executable, PEER, "rx", nats_url, "otel-rx", GROUP],
                env=_env(otlp.url, "test-receiver"),
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(rx)
            _readline(rx, "ready")
            tx = subprocess.Popen(
                [sys.executable, PEER, "tx", nats_url, "otel-tx", GROUP, "otel-rx", str(3 << 20)],
                env=_env(otlp.url, "test-sender", tx_port),
                stdout=subprocess.PIPE,
                stdin=subprocess.PIPE,
                text=True,
            )
            procs.append(tx)
            lines = _readline(tx, "sent", timeout=30)
            report = json.loads(lines[-2])
            delivered = json.loads(_readline(rx, "transfer_id")[-1])
            spans = otlp.wait_for(
                {
                    "kvbus.send",
                    "kvbus.grant.wait",
                    "kvbus.encode",
                    "kvbus.stream",
                    "kvbus.schedule",
                    "kvbus.receive",
                    "kvbus.reassemble",
                    "kvbus.decode",
                }
            )
            yield {
                "report": report,
                "delivered": delivered,
                "spans": spans,
                "otlp": otlp,
                # The done report reaches the scheduler after the sender printed its report.
                "metrics": {"sender": _scrape(tx_port), "scheduler": _scrape(sched_port, until="kvbus_link_bandwidth")},
            }
        finally:
            _stop(procs)


def test_one_trace_across_sender_scheduler_and_receiver(transfer: dict[str, Any]) -> None:
    report = transfer["report"]
    assert transfer["delivered"]["transfer_id"] == report["transfer_id"]
    sends = [
        s
        for s in transfer["spans"]
        if s.name == "kvbus.send" and s.attributes.get("kvbus.transfer_id") == report["transfer_id"]
    ]
    assert len(sends) == 1
    root = sends[0]
    spans = {s.name: s for s in transfer["spans"] if s.trace_id == root.trace_id}
    # Every process's spans are in the sender's trace, with the right parents.
    assert {s.service for s in spans.values()} == {"test-sender", "test-scheduler", "test-receiver"}
    assert root.parent_id == "" and root.kind == SpanKind.PRODUCER.value + 1  # proto enums count from UNSPECIFIED
    for child in ("kvbus.grant.wait", "kvbus.encode", "kvbus.stream", "kvbus.receive"):
        assert spans[child].parent_id == root.span_id, child
    assert spans["kvbus.schedule"].parent_id == spans["kvbus.grant.wait"].span_id
    assert spans["kvbus.schedule"].service == "test-scheduler"
    assert spans["kvbus.receive"].service == "test-receiver"
    assert spans["kvbus.receive"].kind == SpanKind.CONSUMER.value + 1
    assert spans["kvbus.reassemble"].parent_id == spans["kvbus.receive"].span_id
    assert spans["kvbus.decode"].parent_id == spans["kvbus.receive"].span_id
    # Attributes: semantic conventions, sizes, the decision and its predicted vs observed time.
    a = root.attributes
    assert a["messaging.system"] == "nats" and a["messaging.destination.name"] == "otel-rx"
    assert a["kvbus.medium"] == report["medium"] and a["kvbus.bytes"] == report["nbytes"]
    assert a["kvbus.chunks"] == report["chunks"] >= 3 and a["kvbus.retransmits"] == report["retransmits"]
    assert a["kvbus.observed_s"] > 0
    sched = spans["kvbus.schedule"].attributes
    assert sched["kvbus.medium"] == report["medium"] and sched["kvbus.transfer_id"] == report["transfer_id"]
    candidates = json.loads(sched["kvbus.candidates"])
    assert isinstance(candidates, list)
    chosen = next(c for c in candidates if c["medium"] == report["medium"])
    # The predicted terms of the choice, as the decision record has them (issue 32).
    assert sched["kvbus.predicted.comm_s"] == pytest.approx(chosen["comm_s"])
    assert sched["kvbus.predicted.loss_s"] == pytest.approx(chosen["loss_s"])
    assert sched["kvbus.explored"] is report["decision"]["explored"]
    if report["decision"].get("predicted_s") is not None:
        assert a["kvbus.predicted_s"] == pytest.approx(report["decision"]["predicted_s"])


def test_inter_group_trace_includes_the_coordinators_lease(fresh_nats: NatsServer) -> None:
    """A transfer to an agent of another group waits for its group's bandwidth lease: the
    coordinator (its own process) answers inside the sender's trace, next to the scheduler."""
    server = fresh_nats
    procs: list[subprocess.Popen[str]] = []
    try:
        with OtlpReceiver() as otlp:
            url = server.url
            coord = subprocess.Popen(
                [sys.executable, "-m", "kvbus.app.cli", "coordinator", "--nats-url", url],
                env=_env(otlp.url, "test-coordinator"),
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(coord)
            _readline(coord, "coordinator on")
            for g in ("otel-a", "otel-b"):
                p = subprocess.Popen(
                    [sys.executable, "-m", "kvbus.app.cli", "group-scheduler", "--group", g, "--nats-url", url],
                    env=_env(otlp.url, f"test-scheduler-{g}"),
                    stdout=subprocess.PIPE,
                    text=True,
                )
                procs.append(p)
                _readline(p, "group scheduler for")
            rx = subprocess.Popen(
                [sys.executable, PEER, "rx", url, "otel-far", "otel-b"],
                env=_env(otlp.url, "test-receiver"),
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(rx)
            _readline(rx, "ready")
            tx = subprocess.Popen(
                [sys.executable, PEER, "tx", url, "otel-near", "otel-a", "otel-far", str(1 << 20)],
                env=_env(otlp.url, "test-sender"),
                stdout=subprocess.PIPE,
                stdin=subprocess.PIPE,
                text=True,
            )
            procs.append(tx)
            report = json.loads(_readline(tx, "sent", timeout=30)[-2])
            spans = otlp.wait_for({"kvbus.send", "kvbus.grant.wait", "kvbus.schedule", "kvbus.coord.lease"})
            root = next(
                s
                for s in spans
                if s.name == "kvbus.send" and s.attributes.get("kvbus.transfer_id") == report["transfer_id"]
            )
            trace = {s.name: s for s in spans if s.trace_id == root.trace_id}
            lease = trace["kvbus.coord.lease"]
            assert lease.service == "test-coordinator"
            assert lease.parent_id == trace["kvbus.grant.wait"].span_id
            assert lease.kind == SpanKind.SERVER.value + 1
            assert lease.attributes["kvbus.group"] == "otel-a" and lease.attributes["kvbus.share_bps"] > 0
            assert trace["kvbus.schedule"].service == "test-scheduler-otel-a"
    finally:
        _stop(procs)


def test_prometheus_endpoints_serve_kvbus_metrics(transfer: dict[str, Any]) -> None:
    medium = transfer["report"]["medium"]
    sender = transfer["metrics"]["sender"]
    for name in ("kvbus_transfer_duration", "kvbus_transfer_bytes", "kvbus_transfers", "kvbus_queue_delay"):
        assert name in sender, name
    assert f'medium="{medium}"' in sender
    assert 'agent="otel-tx"' in sender
    scheduler = transfer["metrics"]["scheduler"]
    assert "kvbus_agent_memory" in scheduler
    assert "kvbus_link_bandwidth" in scheduler and 'link="otel-tx->otel-rx"' in scheduler


def test_tracing_off_costs_nothing() -> None:
    # This process configured no tracer: spans do not record and nothing goes on the wire.
    with telemetry.span("kvbus.send") as s:
        assert not s.is_recording()
        assert telemetry.traceparent() is None
    assert not telemetry.start("kvbus.receive", parent=None).is_recording()
    assert telemetry.extract(None) is None


def test_redact_url_hides_credentials() -> None:
    assert redact_url("nats://alice:s3cret@host:4222") == "nats://alice:***@host:4222"
    assert redact_url("nats://tok3n@host:4222") == "nats://***@host:4222"
    assert redact_url("nats://a:x@h1:1,nats://b:y@h2:2") == "nats://a:***@h1:1,nats://b:***@h2:2"
    assert redact_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"


def test_group_scheduler_does_not_print_credentials(nats_server: Any) -> None:
    host_port = nats_server.url.split("://", 1)[1]
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvbus.app.cli",
            "group-scheduler",
            "--group",
            "redact",
            "--nats-url",
            f"nats://someone:hunter2@{host_port}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out = "\n".join(_readline(p, "group scheduler for", timeout=15))
    except RuntimeError as exc:  # the server may refuse the credentials: what it printed still counts
        out = str(exc)
    finally:
        _stop([p])
    assert "hunter2" not in out


async def test_top_renders_a_frame_of_a_running_stack(tmp_path: Path) -> None:
    from kvbus.bus import Bus

    env = dict(os.environ, KVBUS_STACK_FILE=str(tmp_path / "stack.json"), PYTHONUNBUFFERED="1")
    env.pop("KVBUS_NATS_URL", None)
    up = subprocess.Popen([sys.executable, "-m", "kvbus.app.cli", "up"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        _readline(up, "kvbus is up", timeout=30)
        url = json.loads((tmp_path / "stack.json").read_text())["nats_url"]
        async with await Bus.connect(url) as bus:
            await bus.agent("top-watcher", group="default", role="verifier")
            deadline = time.monotonic() + 10
            while True:
                # `top` with no --nats-url finds the stack through its stack file.
                # (In a thread: the agent's probes need this event loop.)
                done = await asyncio.to_thread(
                    subprocess.run,
                    [sys.executable, "-m", "kvbus.app.cli", "top", "--once"],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                out = done.stdout
                if "top-watcher" in out or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
        assert "group default" in out
        assert "top-watcher" in out and "verifier" in out
    finally:
        _stop([up])
