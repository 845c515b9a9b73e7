"""Fixtures: real servers on free ports, a group scheduler, connected buses.

The session runs in a temporary directory of its own (``TMPDIR``, inherited by every process it
starts), and checks at the end that it left no embedded server running and no server folder
behind (`pytest_sessionfinish`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest

from kvbus.app.local import NatsServer, RedisServer
from kvbus.bus import Bus, BusConfig
from kvbus.bus.paths import PathsConfig
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

#: This session's temporary directory: what the servers it starts (in this process or in the
#: processes it starts) leave behind shows there, apart from other runs on the same machine.
SESSION_TMP = Path(tempfile.mkdtemp(prefix="pytest-kvbus-session-"))
os.environ["TMPDIR"] = str(SESSION_TMP)
tempfile.tempdir = str(SESSION_TMP)
#: Server binaries whose processes must not outlive the session.
SERVER_NAMES = ("nats-server", "valkey-server", "redis-server")


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    """A real nats-server (JetStream on) for the whole test session."""
    server = NatsServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real Redis-protocol server for the whole test session."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fresh_nats() -> Iterator[NatsServer]:
    """A nats-server of this test only: for a test that kills, restarts or reconfigures it, or
    needs its JetStream buckets (the coordinator's, the leases) to start empty."""
    server = NatsServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
async def scheduler(nats_url: str) -> AsyncIterator[GroupScheduler]:
    """A group scheduler for group ``default`` in this process (its own NATS connection)."""
    sched = await GroupScheduler.connect(nats_url, "default", config=SchedulerConfig(max_active=8))
    try:
        yield sched
    finally:
        await sched.close()


FAST = BusConfig(ack_timeout=0.5, peer_timeout=3.0, request_timeout=2.0, grant_timeout=10.0, partial_timeout=2.0)


@pytest.fixture
def nats_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bus made in the test sends every byte through NATS (tests of the NATS data path:
    faults injected into its chunk messages, forged chunks on its subjects)."""
    monkeypatch.setenv("KVBUS_PATHS_ALLOWED", "nats")


@pytest.fixture
async def bus(nats_url: str, scheduler: GroupScheduler) -> AsyncIterator[Bus]:
    """A bus connection with short timeouts, closed after the test."""
    b = await Bus.connect(nats_url, config=FAST)
    try:
        yield b
    finally:
        await b.close()


@pytest.fixture
async def sender_bus(nats_url: str, scheduler: GroupScheduler, request: pytest.FixtureRequest) -> AsyncIterator[Bus]:
    """A sending bus (not secure) whose allowed paths the test names (``shm,tcp,nats`` by default)."""
    allowed = getattr(request, "param", "shm,tcp,nats")
    bus = await Bus.connect(nats_url, config=FAST, paths=PathsConfig(allowed=allowed, tcp_host="127.0.0.1"))
    try:
        yield bus
    finally:
        await bus.close()


def sigint_as_default() -> None:
    """A ``preexec_fn``: the child takes Ctrl-C's default action.

    A test run started in the background (``nohup ... &``, a CI runner's job) inherits SIGINT
    ignored, and an ignored signal stays ignored across exec. Python then installs no
    KeyboardInterrupt handler, and a `kvbus up` sent SIGINT never stops.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ready_up(tmp_path: Path) -> tuple[subprocess.Popen[str], str]:
    """`kvbus up` (one group, one replica each, its stack file in ``tmp_path``) once it says it is
    up, and what it printed until then."""
    env = {**os.environ, "KVBUS_STACK_FILE": str(tmp_path / "stack.json")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbus.app.cli", "up", "--replicas", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=sigint_as_default,  # noqa: PLW1509 - only resets a signal, before exec
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "Ctrl-C" in line or not line:
            break
    out = "".join(lines)
    assert "kvbus is up" in out, out
    return proc, out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("KVBUS_SLOW"):
        return
    skip = pytest.mark.skip(reason="slow; set KVBUS_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _leftovers() -> tuple[list[psutil.Process], list[Path]]:
    """Embedded servers still running from this session's folders, and the folders left."""
    procs = []
    for proc in psutil.process_iter(["name"]):
        try:
            if any(n in (proc.info["name"] or "") for n in SERVER_NAMES) and proc.cwd().startswith(str(SESSION_TMP)):
                procs.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    folders = []
    for folder in sorted(SESSION_TMP.glob("kvbus-*")):
        if folder.is_dir() and folder.name == "kvbus-testbed" and not any(folder.iterdir()):
            folder.rmdir()  # the testbed's base folder, every run in it removed
            continue
        folders.append(folder)
    return procs, folders


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if it left an embedded server running or a server folder behind (after the
    session fixtures are gone; a server whose parent was killed gets a moment to die with it)."""
    deadline = time.monotonic() + 10
    # Folders whose owner was killed on purpose (kill -9 tests) are removed by the next embedded
    # server started on the machine; none starts after the last test, so sweep them as it would.
    from kvbus.app.processes import sweep_stale_folders

    sweep_stale_folders(SESSION_TMP)
    procs, folders = _leftovers()
    while procs and time.monotonic() < deadline:
        time.sleep(0.2)
        procs, folders = _leftovers()
    if not procs and not folders:
        return
    lines = [f"  process {p.pid} ({p.info['name']})" for p in procs]
    lines += [f"  folder {f}" for f in folders]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("the test session left servers or folders behind:\n" + "\n".join(lines), red=True)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(SESSION_TMP, ignore_errors=True)
