"""The network a bench runs on: the testbed (``netns``) when this machine can build it, else
emulated links (``emulated``); the same bench code drives either.

- ``netns``: a `Testbed` of the topology; nats-server on the topology's NATS host; workers in
  their hosts' namespaces; links are htb (+ netem or the NFQUEUE delay line).
- ``emulated``: a local nats-server; workers are local processes; a host whose link is shaped
  below 2 Gbit/s or impaired (or a rack behind a shaped uplink) reaches the server through a
  paced TCP relay (`kvbus.app.testbed.relay`) with that link's rate and delay, which every
  connection of the host (or rack) shares in arrival order: one bottleneck, as on a real link,
  but paced in user space, without loss or a kernel queue.

``KVBUS_BENCH_NETWORK`` = ``auto`` (default), ``netns`` or ``emulated`` chooses.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from kvbus.app.testbed import netns
from kvbus.app.testbed.errors import TestbedUnavailable
from kvbus.app.testbed.topology import LinkSpec, Topology
from kvbus.app.testbed.worker import Worker

logger = logging.getLogger(__name__)

#: Links at or above this rate are not relayed in emulated mode (a Python relay is slower than them).
RELAY_MAX_MBIT = 2000.0


def choose_network(
    requested: str | None = None,
    topology: Topology | None = None,
    *,
    caps: netns.Capabilities | None = None,
) -> tuple[str, str]:
    """(``netns`` or ``emulated``, why) for ``requested`` (or ``KVBUS_BENCH_NETWORK``; ``auto`` by default).

    ``auto`` takes the testbed only when this machine can build everything ``topology`` needs:
    namespaces, and netem or the NFQUEUE delay line when a link delays, jitters or drops
    packets. Otherwise it takes emulated links, and ``why`` says in one line what was missing and
    how to get it.

    Args:
        requested: ``auto``, ``netns`` or ``emulated``.
        topology: what the bench will build (None: only namespaces and htb are checked).
        caps: the machine's capabilities (default: probed once, `netns.capabilities`).

    Raises:
        TestbedUnavailable: ``netns`` was asked for and this machine cannot build ``topology``.
        ValueError: an unknown choice.
    """
    choice = (requested or os.environ.get("KVBUS_BENCH_NETWORK") or "auto").strip().lower()
    if choice not in ("auto", "netns", "emulated"):
        raise ValueError(f"network {choice!r} must be auto, netns or emulated")
    if choice == "emulated":
        return "emulated", "emulated links were asked for"
    caps = caps or netns.capabilities()
    try:
        netns.check(caps, delay=topology is not None and topology.needs_delay)
    except TestbedUnavailable as exc:
        if choice == "netns":
            raise
        why = f"the testbed is not available here: {exc.reason}" + (f"; to get it: {exc.hint}" if exc.hint else "")
        logger.info("%s", why)
        return "emulated", why
    how = f", delay by {caps.delay}" if topology is not None and topology.needs_delay else ""
    return "netns", f"the testbed is available (root, namespaces, htb{how})"


class BenchNet(ABC):
    """Hosts a bench's processes and links; see the module docstring."""

    mode: str
    topology: Topology
    reason: str = ""
    #: Valkey's URL as the bench's hosts reach it, when the net was opened with ``redis=True``.
    redis_url: str | None = None

    @abstractmethod
    def url(self, host: str) -> str:
        """The NATS URL as ``host`` reaches it."""

    @abstractmethod
    async def worker(self, host: str, name: str, *, env: dict[str, str] | None = None) -> Worker:
        """A worker process on ``host``."""

    @abstractmethod
    def set_link(self, target: str, **changes: float) -> None:
        """Change a link now (``host:<name>`` or ``uplink:<rack>``)."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What the bench records in ``config`` (``network`` first)."""

    @abstractmethod
    async def close(self) -> None:
        """Stop everything."""

    def link(self, target: str) -> LinkSpec:
        """The link as it is now."""
        return self.topology.link(target)


class NetnsNet(BenchNet):
    """The testbed."""

    mode = "netns"

    def __init__(self, topology: Topology, *, redis: bool = False, reason: str = "") -> None:
        from kvbus.app.testbed.fabric import Testbed
        from kvbus.app.testbed.services import start_nats, start_redis

        self.topology = topology
        self.reason = reason
        self.tb = Testbed(topology).build()
        try:
            self.nats_url = start_nats(self.tb)
            self.redis_url = start_redis(self.tb) if redis else None
        except BaseException:
            self.tb.teardown()
            raise
        self.workers: list[Worker] = []

    def url(self, host: str) -> str:
        """The NATS URL as ``host`` reaches it."""
        return self.nats_url

    async def worker(self, host: str, name: str, *, env: dict[str, str] | None = None) -> Worker:
        """A worker process on ``host``."""
        w = await Worker.on_host(self.tb, host, name, env=env)
        self.workers.append(w)
        return w

    def set_link(self, target: str, **changes: float) -> None:
        """Change a link now."""
        self.tb.set_link(target, **changes)

    def link(self, target: str) -> LinkSpec:
        """The link as it is now."""
        return self.tb.links.get(target) or self.topology.link(target)

    def describe(self) -> dict[str, Any]:
        """What the bench records in ``config``."""
        out = self.tb.describe()
        out["why"] = self.reason
        out["links_now"] = {
            t: {
                "rate_mbit": link.rate_mbit,
                "delay_ms": link.delay_ms,
                "jitter_ms": link.jitter_ms,
                "loss_pct": link.loss_pct,
            }
            for t, link in self.tb.links.items()
        }
        return out

    async def close(self) -> None:
        """Stop everything."""
        for w in self.workers:
            await w.close(timeout=10)
        self.tb.teardown()


class EmulatedNet(BenchNet):
    """A local server, local workers, paced relays for the slow links."""

    mode = "emulated"

    def __init__(
        self, topology: Topology, *, nats_url: str | None = None, redis: bool = False, reason: str = ""
    ) -> None:
        from kvbus.app.local import NatsServer, RedisServer

        self.topology = topology
        self.reason = reason
        self.folder = Path(tempfile.mkdtemp(prefix="kvbus-bench-"))
        self._server = None if nats_url else NatsServer().start()
        self.nats_url = nats_url or self._server.url  # type: ignore[union-attr]
        self._redis = RedisServer().start() if redis else None
        self.redis_url = self._redis.url if self._redis else None
        self.links = {t: topology.link(t) for t in topology.targets()}
        self._relays: dict[str, tuple[subprocess.Popen[str], int]] = {}
        self.workers: list[Worker] = []
        nats_rack = topology.host(topology.services.nats).rack
        for target in topology.targets():
            if self._relayed(target, nats_rack):
                self._relays[target] = self._start_relay(self.links[target])

    def _relayed(self, target: str, nats_rack: str) -> bool:
        link = self.links[target]
        slow = (link.shaped and link.rate_mbit < RELAY_MAX_MBIT) or link.impaired
        if target.startswith("uplink:"):
            return slow and target.split(":", 1)[1] != nats_rack
        return slow

    def _start_relay(self, link: LinkSpec) -> tuple[subprocess.Popen[str], int]:
        host, port = self.nats_url.rsplit("//", 1)[1].rsplit(":", 1)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvbus.app.testbed.relay",
                host,
                port,
                str(link.rate_bytes_per_s),
                str(link.delay_ms / 1000),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("port "):
            proc.kill()
            raise RuntimeError(f"the link relay did not start: {line!r}")
        return proc, int(line.split()[1])

    def _route(self, host: str) -> str | None:
        """The relay target ``host``'s traffic goes through (its rack's uplink before its own link)."""
        rack = self.topology.host(host).rack
        if f"uplink:{rack}" in self._relays:
            return f"uplink:{rack}"
        if f"host:{host}" in self._relays:
            return f"host:{host}"
        return None

    def url(self, host: str) -> str:
        """The NATS URL as ``host`` reaches it."""
        route = self._route(host)
        if route is None:
            return self.nats_url
        return f"nats://127.0.0.1:{self._relays[route][1]}"

    async def worker(self, host: str, name: str, *, env: dict[str, str] | None = None) -> Worker:
        """A worker process on ``host``."""
        self.topology.host(host)
        w = await Worker.local(name, folder=self.folder, env=env)
        self.workers.append(w)
        return w

    def set_link(self, target: str, **changes: float) -> None:
        """Change a link now."""
        from dataclasses import replace

        new = replace(self.links[target], **changes)  # type: ignore[arg-type]
        self.links[target] = new
        relay = self._relays.get(target)
        if relay is not None and relay[0].stdin is not None:
            relay[0].stdin.write(json.dumps({"rate_bps": new.rate_bytes_per_s, "delay_s": new.delay_ms / 1000}) + "\n")
            relay[0].stdin.flush()

    def link(self, target: str) -> LinkSpec:
        """The link as it is now."""
        return self.links[target]

    def describe(self) -> dict[str, Any]:
        """What the bench records in ``config``."""
        return {
            "network": "emulated",
            "why": self.reason,
            "topology": self.topology.to_dict(),
            "links": "paced TCP relays in user space for the links listed in relayed (rate and delay; no loss, "
            "no kernel queue); every other path is loopback",
            "relayed": sorted(self._relays),
        }

    async def close(self) -> None:
        """Stop everything."""
        for w in self.workers:
            await w.close(timeout=10)
        for proc, _ in self._relays.values():
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self._redis is not None:
            self._redis.stop()
        if self._server is not None:
            self._server.stop()
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def open_net(
    topology: Topology, *, network: str | None = None, nats_url: str | None = None, redis: bool = False
) -> BenchNet:
    """The bench network for ``topology``: the testbed or emulated links (see `choose_network`)."""
    mode, why = choose_network(network, topology)
    if mode == "netns":
        return NetnsNet(topology, redis=redis, reason=why)
    return EmulatedNet(topology, nats_url=nats_url, redis=redis, reason=why)
