"""What each testbed run left on the machine, and `kvbus testbed clean`.

Every run has an id (8 hex digits). Its namespaces are ``kvb-<id>-...``, its folder
``<base>/<id>/`` (logs, server data, ``state.json``). ``state.json`` names the process that
built the run (pid and start time, so a reused pid is not mistaken for it), its namespaces and
the processes it started; it is written before the first namespace is made, so a run killed at
any point can be cleaned. A run whose builder is gone is *stale*: `clean` kills every process in
its namespaces, deletes the namespaces (their veths and bridges go with them) and the folder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbus.app.testbed import netns

logger = logging.getLogger(__name__)


def base_dir() -> Path:
    """Where runs keep their folders (``KVBUS_TESTBED_DIR``, else ``<tmp>/kvbus-testbed``)."""
    return Path(os.environ.get("KVBUS_TESTBED_DIR") or Path(tempfile.gettempdir()) / "kvbus-testbed")


def process_start(pid: int) -> float | None:
    """A process's start time in clock ticks since boot (None if it does not exist or is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X"):
            return None  # dead, only not reaped yet
        return float(fields[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class RunState:
    """The record of one run (``state.json``)."""

    run_id: str
    owner_pid: int
    owner_start: float | None
    topology: str = ""
    created: float = field(default_factory=time.time)
    namespaces: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)

    @property
    def folder(self) -> Path:
        """The run's folder."""
        return base_dir() / self.run_id

    def save(self) -> None:
        """Write ``state.json`` (atomically)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / "state.json.tmp"
        tmp.write_text(
            json.dumps(
                {
                    "run_id": self.run_id,
                    "owner_pid": self.owner_pid,
                    "owner_start": self.owner_start,
                    "topology": self.topology,
                    "created": self.created,
                    "namespaces": self.namespaces,
                    "pids": self.pids,
                }
            )
        )
        tmp.replace(self.folder / "state.json")

    @classmethod
    def load(cls, run_id: str) -> RunState | None:
        """The saved state of run ``run_id`` (None when there is none or it cannot be read)."""
        try:
            data: dict[str, Any] = json.loads((base_dir() / run_id / "state.json").read_text())
            return cls(
                str(data["run_id"]),
                int(data["owner_pid"]),
                data.get("owner_start"),
                str(data.get("topology", "")),
                float(data.get("created", 0)),
                [str(n) for n in data.get("namespaces", [])],
                [int(p) for p in data.get("pids", [])],
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def owner_alive(self) -> bool:
        """True while the process that built the run is still running."""
        return process_start(self.owner_pid) is not None and process_start(self.owner_pid) == self.owner_start


def namespace_prefix(run_id: str) -> str:
    """The prefix of run ``run_id``'s namespaces."""
    return f"{netns.PREFIX}{run_id}-"


def run_of(namespace: str) -> str | None:
    """The run id in a testbed namespace's name (None for other namespaces)."""
    if not namespace.startswith(netns.PREFIX):
        return None
    rest = namespace[len(netns.PREFIX) :]
    run_id, sep, _ = rest.partition("-")
    return run_id if sep and len(run_id) == 8 and all(c in "0123456789abcdef" for c in run_id) else None


@dataclass(frozen=True, slots=True)
class RunInfo:
    """One run found on the machine."""

    run_id: str
    topology: str
    alive: bool
    namespaces: tuple[str, ...]
    processes: int
    folder: bool


def list_runs() -> list[RunInfo]:
    """Every run with a namespace or a folder on this machine."""
    ids: set[str] = set()
    by_run: dict[str, list[str]] = {}
    for ns in netns.namespaces():
        rid = run_of(ns)
        if rid:
            ids.add(rid)
            by_run.setdefault(rid, []).append(ns)
    base = base_dir()
    if base.is_dir():
        for entry in base.iterdir():
            if entry.is_dir() and run_of(f"{netns.PREFIX}{entry.name}-x") == entry.name:
                ids.add(entry.name)
    out = []
    for rid in sorted(ids):
        state = RunState.load(rid)
        names = tuple(sorted(by_run.get(rid, [])))
        procs = sum(len(netns.pids(ns)) for ns in names)
        out.append(
            RunInfo(
                rid,
                state.topology if state else "?",
                bool(state and state.owner_alive()),
                names,
                procs,
                (base / rid).exists(),
            )
        )
    return out


def _kill(pid_list: list[int], sig: int) -> None:
    for pid in pid_list:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            logger.warning("cannot signal process %d", pid)


def remove_run(run_id: str) -> dict[str, int]:
    """Kill what runs in run ``run_id``'s namespaces, delete them and its folder.

    Returns counts of what was removed: ``namespaces``, ``processes``, ``folders``.
    """
    prefix = namespace_prefix(run_id)
    spaces = [ns for ns in netns.namespaces() if ns.startswith(prefix)]
    state = RunState.load(run_id)
    recorded = [p for p in (state.pids if state else []) if process_start(p) is not None]
    victims = sorted({p for ns in spaces for p in netns.pids(ns)} | set(recorded))
    victims = [p for p in victims if p != os.getpid()]
    _kill(victims, signal.SIGTERM)
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and any(process_start(p) is not None for p in victims):
        time.sleep(0.05)
    _kill([p for p in victims if process_start(p) is not None], signal.SIGKILL)
    for ns in spaces:
        netns.delete(ns)
    folder = base_dir() / run_id
    removed_folder = 0
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
        removed_folder = 1
    logger.info("testbed run %s removed: %d namespaces, %d processes", run_id, len(spaces), len(victims))
    return {"namespaces": len(spaces), "processes": len(victims), "folders": removed_folder}


def clean(*, run_id: str | None = None, everything: bool = False) -> dict[str, int]:
    """Remove stale runs (whose builder is gone), one given run, or with ``everything`` all runs.

    A run with namespaces but no folder here is not known to be stale: it may belong to another
    base folder (another ``KVBUS_TESTBED_DIR`` or ``TMPDIR``: another user's or test session's
    runs on the same machine), whose builder may be alive. It is left alone unless named or
    ``everything`` is given.

    Returns the summed counts of `remove_run`, plus ``runs`` and ``kept`` (runs left alone).
    """
    totals = {"runs": 0, "namespaces": 0, "processes": 0, "folders": 0, "kept": 0}
    for info in list_runs():
        if run_id is not None and info.run_id != run_id:
            continue
        if (info.alive or not info.folder) and not everything and run_id is None:
            totals["kept"] += 1
            continue
        counts = remove_run(info.run_id)
        totals["runs"] += 1
        for key, value in counts.items():
            totals[key] += value
    return totals
