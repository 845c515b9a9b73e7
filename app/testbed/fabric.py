"""`Testbed`: builds a topology from namespaces, veths, bridges and tc, runs processes on its hosts,
changes links on schedule, and tears everything down.

Layout (``<run>`` is the run id)::

    kvb-<run>-sw      the switch namespace: one bridge per rack (br0, br1, ...), and with more
                      than one rack a core bridge (brc) that each rack reaches by its uplink
                      (veth u<r> on the rack bridge, c<r> on the core bridge)
    kvb-<run>-<host>  one namespace per host, eth0 = 10.77.x.y/16, its peer p<i> on the rack bridge

Bandwidth is htb on the egress of each direction's veth end (upload: the host's eth0 or the
uplink's rack end; download: the switch port or the uplink's core end). Delay, jitter and loss
are netem on the same queues when the kernel has netem, else the NFQUEUE delay line in the
switch namespace. Nothing is made in the root namespace: every device is created inside the
run's namespaces, so deleting them removes everything.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from kvbus.app.testbed import netns, shaping
from kvbus.app.testbed.errors import ProcessFailed, TestbedError
from kvbus.app.testbed.runs import RunState, namespace_prefix, process_start, remove_run
from kvbus.app.testbed.topology import LinkSpec, Topology

logger = logging.getLogger(__name__)

#: Environment variables that tell a process on a host where it is (see `Testbed.spawn`).
HOST_ID_ENV = "KVBUS_HOST_ID"
ADVERTISE_ENV = "KVBUS_PATHS_ADVERTISE_HOST"
#: The NFQUEUE number of the delay line.
QUEUE = 0


class Testbed:
    """A built topology. Use as a context manager: `build` on entry, `teardown` on exit.

    Args:
        topology: what to build.
        run_id: 8 hex digits (default: random).
    """

    __test__ = False  # not a pytest test class

    def __init__(self, topology: Topology, *, run_id: str | None = None) -> None:
        self.topology = topology
        self.run_id = run_id or secrets.token_hex(4)
        self.state = RunState(self.run_id, os.getpid(), process_start(os.getpid()), topology.name)
        self.folder = self.state.folder
        self.links: dict[str, LinkSpec] = {}
        """Every link as it is now (``host:<name>``, ``uplink:<rack>``)."""
        self._index = {h.name: i for i, h in enumerate(topology.hosts)}
        self._rack_index = {r.name: i for i, r in enumerate(topology.racks)}
        self._procs: list[tuple[str, str, subprocess.Popen[Any]]] = []
        self._delayline: subprocess.Popen[bytes] | None = None
        self._schedule_stop = threading.Event()
        self._schedule_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.caps = netns.capabilities()
        self.built = False

    # -- names and addresses -----------------------------------------------------------------------

    @property
    def switch_ns(self) -> str:
        """The switch namespace."""
        return f"{namespace_prefix(self.run_id)}sw"

    def ns(self, host: str) -> str:
        """The namespace of ``host``."""
        self.topology.host(host)
        return f"{namespace_prefix(self.run_id)}{host}"

    def ip(self, host: str) -> str:
        """The address of ``host``."""
        i = self._index[self.topology.host(host).name]
        return f"10.77.{i // 200}.{i % 200 + 10}"

    @property
    def delay_backend(self) -> str | None:
        """``netem``, ``nfqueue`` (the delay line) or None when no link is impaired."""
        return self.caps.delay if self.topology.needs_delay else None

    def describe(self) -> dict[str, Any]:
        """What the benches record: topology, run id, how links are made, the machine's capabilities."""
        return {
            "network": "netns",
            "run_id": self.run_id,
            "topology": self.topology.to_dict(),
            "delay": self.delay_backend,
            "shaper": "htb",
            "capabilities": self.caps.as_dict(),
            "addresses": {h.name: self.ip(h.name) for h in self.topology.hosts},
        }

    # -- building ----------------------------------------------------------------------------------

    def build(self) -> Testbed:
        """Make the namespaces, bridges, veths, addresses, shaping and delay line.

        Raises:
            TestbedUnavailable: the machine cannot (says what is missing).
            CommandFailed: a command failed (everything made so far is removed).
        """
        netns.require(delay=self.topology.needs_delay)
        self.state.save()  # before the first namespace: a crash from here on is cleanable
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        self.built = True
        return self

    def _add_ns(self, name: str) -> None:
        self.state.namespaces.append(name)
        self.state.save()
        netns.add(name)

    def _build(self) -> None:
        topo, sw, mtu = self.topology, self.switch_ns, str(self.topology.mtu)
        self._add_ns(sw)
        netns.in_ns(sw, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", check=False)
        for r, _ in enumerate(topo.racks):
            netns.ip("link", "add", f"br{r}", "type", "bridge", ns=sw)
            netns.ip("link", "set", f"br{r}", "up", ns=sw)
        if topo.multi_rack:
            netns.ip("link", "add", "brc", "type", "bridge", ns=sw)
            netns.ip("link", "set", "brc", "up", ns=sw)
            for r, _ in enumerate(topo.racks):
                netns.ip("link", "add", f"u{r}", "mtu", mtu, "type", "veth", "peer", "name", f"c{r}", "mtu", mtu, ns=sw)
                netns.ip("link", "set", f"u{r}", "master", f"br{r}", "up", ns=sw)
                netns.ip("link", "set", f"c{r}", "master", "brc", "up", ns=sw)
        for i, host in enumerate(topo.hosts):
            ns = self.ns(host.name)
            self._add_ns(ns)
            netns.in_ns(ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", check=False)
            netns.ip(
                "link",
                "add",
                "eth0",
                "mtu",
                mtu,
                "type",
                "veth",
                "peer",
                "name",
                f"p{i}",
                "netns",
                sw,
                "mtu",
                mtu,
                ns=ns,
            )
            netns.ip("addr", "add", f"{self.ip(host.name)}/16", "dev", "eth0", ns=ns)
            netns.ip("link", "set", "eth0", "up", ns=ns)
            netns.ip("link", "set", f"p{i}", "master", f"br{self._rack_index[host.rack]}", "up", ns=sw)
        if self.delay_backend == "nfqueue":
            self._start_delayline()
        for target in self.topology.targets():
            self._apply(target, self.topology.link(target), None)
        (self.folder / "topology.json").write_text(json.dumps(self.describe(), indent=2))

    def _ends(self, target: str) -> list[tuple[str, str, str]]:
        """(namespace, device, direction) of a link's two queues."""
        kind, _, name = target.partition(":")
        if kind == "host":
            return [(self.ns(name), "eth0", "up"), (self.switch_ns, f"p{self._index[name]}", "down")]
        r = self._rack_index[name]
        return [(self.switch_ns, f"u{r}", "up"), (self.switch_ns, f"c{r}", "down")]

    def _apply(self, target: str, link: LinkSpec, previous: LinkSpec | None) -> None:
        netem = self.caps.netem
        for ns, dev, _ in self._ends(target):
            shaping.apply(ns, dev, link, netem=netem, mtu=self.topology.mtu, previous=previous)
        self.links[target] = link
        if self.delay_backend == "nfqueue":
            self._configure_delayline()
        logger.info("testbed %s: %s %s", self.run_id, target, shaping.describe(link, netem))

    def _delay_ports(self) -> list[tuple[str, str]]:
        """(port, link target) of every switch port the delay line watches: those that may be impaired
        (frames between unimpaired ports never leave the kernel's fast path)."""
        ports = [(f"p{self._index[h.name]}", f"host:{h.name}") for h in self.topology.hosts] + (
            [(f"u{self._rack_index[r.name]}", f"uplink:{r.name}") for r in self.topology.racks]
            if self.topology.multi_rack
            else []
        )
        return [(port, target) for port, target in ports if self.topology.may_impair(target)]

    def _start_delayline(self) -> None:
        sw = self.switch_ns
        binary = netns.iptables_binary()
        if binary is None:
            raise TestbedError("the delay line needs iptables (legacy backend)")
        netns.in_ns(sw, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1")
        log = open(self.folder / "delayline.log", "ab")  # noqa: SIM115 - owned by the process
        self._delayline = subprocess.Popen(
            netns.exec_argv(sw, [sys.executable, "-m", "kvbus.app.testbed.delayline", str(QUEUE)]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )
        self._record(self._delayline.pid)
        assert self._delayline.stdout is not None
        line = self._delayline.stdout.readline()
        if b"ready" not in line:
            raise ProcessFailed("switch", "delay line", (self.folder / "delayline.log").read_text(errors="replace"))
        # Frames entering from or leaving through a watched port go to the queue; the delay
        # line adds both ports' delay. ACCEPT ends the chain, so one rule per packet applies.
        for port, _ in self._delay_ports():
            for flag in ("--physdev-in", "--physdev-out"):
                netns.in_ns(
                    sw,
                    binary,
                    "-A",
                    "FORWARD",
                    "-m",
                    "physdev",
                    flag,
                    port,
                    "-j",
                    "NFQUEUE",
                    "--queue-num",
                    str(QUEUE),
                    "--queue-bypass",
                )

    def _configure_delayline(self) -> None:
        if self._delayline is None or self._delayline.stdin is None:
            return
        ports = {}
        for port, target in self._delay_ports():
            link = self.links.get(target, self.topology.link(target))
            imp = [link.delay_ms, link.jitter_ms, link.loss_pct]
            # A host port: frames *in* come from the host (its upload). An uplink's rack end: frames
            # *out* go up to the core (the rack's upload), frames *in* come down from it.
            ports[port] = {"in": imp, "out": imp}
        self._delayline.stdin.write((json.dumps({"ports": ports}) + "\n").encode())
        self._delayline.stdin.flush()

    def delayline_stats(self) -> dict[str, Any] | None:
        """The delay line's counters (None without one)."""
        proc = self._delayline
        if proc is None or proc.stdin is None or proc.stdout is None or proc.poll() is not None:
            return None
        proc.stdin.write(b'{"stats": true}\n')
        proc.stdin.flush()
        return dict(json.loads(proc.stdout.readline()))

    # -- changing links ----------------------------------------------------------------------------

    def set_link(self, target: str, **changes: float) -> LinkSpec:
        """Change some fields of one link now (``rate_mbit``, ``delay_ms``, ...); returns the new link."""
        with self._lock:
            old = self.links[target]
            new = replace(old, **changes)  # type: ignore[arg-type]
            self._apply(target, new, old)
            return new

    def start_schedule(self) -> None:
        """Play the topology's schedule in a background thread (from now; repeating if it says so)."""
        if not self.topology.schedule or self._schedule_thread is not None:
            return
        self._schedule_stop.clear()
        self._schedule_thread = threading.Thread(target=self._play, name=f"testbed-{self.run_id}-schedule", daemon=True)
        self._schedule_thread.start()

    def _play(self) -> None:
        start = time.monotonic()
        while not self._schedule_stop.is_set():
            for step in self.topology.schedule:
                if self._schedule_stop.wait(max(0.0, start + step.at_s - time.monotonic())):
                    return
                try:
                    self.set_link(step.link, **step.changes)
                except TestbedError:
                    logger.exception("testbed %s: schedule step at %.1f s failed", self.run_id, step.at_s)
            if not self.topology.schedule_repeat_s:
                return
            start += self.topology.schedule_repeat_s
            if self._schedule_stop.wait(max(0.0, start - time.monotonic())):
                return

    def stop_schedule(self) -> None:
        """Stop playing the schedule (links stay as they are)."""
        self._schedule_stop.set()
        if self._schedule_thread is not None:
            self._schedule_thread.join(5)
            self._schedule_thread = None

    # -- processes ---------------------------------------------------------------------------------

    def _record(self, pid: int) -> None:
        self.state.pids.append(pid)
        self.state.save()

    def spawn(
        self,
        host: str,
        argv: Sequence[str],
        *,
        name: str,
        env: Mapping[str, str] | None = None,
        stdin: int | IO[Any] | None = subprocess.DEVNULL,
        stdout: int | IO[Any] | None = None,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``host``'s namespace as its own process (session); stdout and stderr go to
        ``<run folder>/<name>.log`` unless ``stdout`` is given (then only stderr does).

        The process learns which host it is on as a pod does from the chart: ``KVBUS_HOST_ID``
        (the host's own identity, so two hosts never take the ``shm`` path between them although
        they share this machine's ``/dev/shm`` and machine id) and ``KVBUS_PATHS_ADVERTISE_HOST``
        (its address, which the ``tcp`` path offers; the machine's host name resolves to an
        address outside the testbed). ``env`` may set either itself.
        """
        env = {**(os.environ if env is None else env)}
        env.setdefault(HOST_ID_ENV, f"kvbus-testbed-{self.run_id}-{host}")
        env.setdefault(ADVERTISE_ENV, self.ip(host))
        log_path = self.folder / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            proc = subprocess.Popen(
                netns.exec_argv(self.ns(host), list(argv)),
                stdin=stdin,
                stdout=log if stdout is None else stdout,
                stderr=log,
                env=env,
                start_new_session=True,
                cwd=self.folder,
            )
        finally:
            log.close()
        self._record(proc.pid)
        self._procs.append((host, name, proc))
        return proc

    def python(self, host: str, *args: str, name: str, **kwargs: Any) -> subprocess.Popen[Any]:
        """`spawn` this Python (``sys.executable``) with ``args``."""
        return self.spawn(host, [sys.executable, *args], name=name, **kwargs)

    def log(self, name: str) -> str:
        """The log of process ``name`` so far."""
        try:
            return (self.folder / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def wait_for_log(
        self, proc: subprocess.Popen[Any], name: str, needle: str, *, host: str, timeout: float = 60.0
    ) -> None:
        """Wait until process ``name``'s log contains ``needle``.

        Raises:
            ProcessFailed: it exited first, or ``timeout`` passed.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.log(name):
                return
            if proc.poll() is not None:
                raise ProcessFailed(host, name, f"exited with {proc.returncode}: {self.log(name)}")
            time.sleep(0.05)
        raise ProcessFailed(host, name, f"not ready after {timeout:.0f} s: {self.log(name)}")

    def stop(self, proc: subprocess.Popen[Any], timeout: float = 5.0) -> None:
        """Stop one process started here (SIGTERM to its session, then SIGKILL)."""
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()

    # -- tearing down ------------------------------------------------------------------------------

    def teardown(self) -> None:
        """Stop the schedule and every process, delete the namespaces and the run folder."""
        self.stop_schedule()
        for _, _, proc in reversed(self._procs):
            self.stop(proc, timeout=3.0)
        if self._delayline is not None:
            if self._delayline.stdin is not None:
                try:
                    self._delayline.stdin.close()
                except OSError:
                    pass
            self.stop(self._delayline, timeout=3.0)
        keep = os.environ.get("KVBUS_TESTBED_KEEP_LOGS")
        if keep:
            target = Path(keep) / self.run_id
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(self.folder, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("js", "*.rdb"))
        remove_run(self.run_id)
        self.built = False

    def __enter__(self) -> Testbed:
        return self.build()

    def __exit__(self, *exc: object) -> None:
        self.teardown()
