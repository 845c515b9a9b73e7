"""Embedded clusters for local runs, tests and benches: NATS with JetStream, and Valkey in cluster mode.

`NatsCluster` starts ``size`` real `nats-server` processes on loopback ports, routed to each other
(a full mesh of ``cluster.routes``), each with its own JetStream store: JetStream runs clustered
(a meta leader elected by Raft) and a stream of R3 keeps a copy on every server. A server can be
killed (SIGKILL), stopped (SIGSTOP: a stand-in for a partitioned host on loopback, where no
network namespace is available), resumed and restarted on its ports with its store.

Valkey in cluster mode is `kvbus.app.valkey_cluster`'s `ValkeyCluster`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from kvbus.app.local import FORM_TIMEOUT, START_TIMEOUT, NatsServer
from kvbus.app.processes import free_ports
from kvbus.errors import ServerStartError

__all__ = ["ClusterNatsServer", "NatsCluster"]

logger = logging.getLogger(__name__)


class ClusterNatsServer(NatsServer):
    """One server of a `NatsCluster`: a `NatsServer` with a name, a route port and the routes."""

    def __init__(
        self,
        *,
        server_name: str,
        port: int,
        cluster_port: int,
        http_port: int,
        routes: list[int],
        cluster_name: str,
        extra_config: str = "",
    ) -> None:
        route_list = ", ".join(f"nats-route://127.0.0.1:{p}" for p in routes)
        extra = (
            f"server_name: {server_name}\n"
            f"http_port: {http_port}\n"
            f"cluster {{\n  name: {cluster_name}\n  host: 127.0.0.1\n  port: {cluster_port}\n"
            f"  routes: [{route_list}]\n  connect_retries: 120\n}}\n"
            f"{extra_config}"
        )
        super().__init__(port=port, extra_config=extra)
        self.server_name = server_name
        self.cluster_port = cluster_port
        self.http_port = http_port
        self.stopped = False
        """Whether the process is suspended by `pause` (SIGSTOP)."""

    def monitor(self, path: str, timeout: float = 1.0) -> Any:
        """The JSON of the monitoring endpoint ``path`` (``/jsz``, ``/routez``, ``/healthz`` ...).

        Raises:
            OSError: the server did not answer (stopped, dead or still starting).
        """
        url = f"http://127.0.0.1:{self.http_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # /healthz answers 503 with a JSON body until it is ready
            return json.loads(exc.read() or b"{}")

    def pause(self) -> None:
        """Suspend the process (SIGSTOP): its sockets stay open but it answers nothing."""
        if self.pid is not None and self.running:
            os.kill(self.pid, signal.SIGSTOP)
            self.stopped = True

    def resume(self) -> None:
        """Continue a suspended process (SIGCONT)."""
        if self.pid is not None and self.stopped:
            os.kill(self.pid, signal.SIGCONT)
        self.stopped = False

    def stop(self, timeout: float = 5.0) -> None:
        """Resume it if suspended (a stopped process cannot take SIGTERM), then stop it."""
        self.resume()
        super().stop(timeout)


class NatsCluster:
    """``size`` routed nats-servers with clustered JetStream on loopback; a context manager.

    Args:
        size: servers (3 makes R3 buckets possible).
        name: the cluster's name (``cluster.name``).
        extra_config: more nats-server configuration for every server (``kvbus up --secure``'s users).
    """

    def __init__(self, size: int = 3, *, name: str = "kvbus", extra_config: str = "") -> None:
        if size < 1:
            raise ValueError(f"a cluster has at least one server, not {size}")
        ports = free_ports(3 * size)  # all different: a client port equal to a monitor port fails to start
        cluster_ports, client_ports, http_ports = ports[:size], ports[size : 2 * size], ports[2 * size :]
        self.servers = [
            ClusterNatsServer(
                server_name=f"n{i + 1}",
                port=client_ports[i],
                cluster_port=cluster_ports[i],
                http_port=http_ports[i],
                routes=[p for j, p in enumerate(cluster_ports) if j != i],
                cluster_name=name,
                extra_config=extra_config,
            )
            for i in range(size)
        ]

    @property
    def size(self) -> int:
        """Servers in the cluster (alive or not)."""
        return len(self.servers)

    @property
    def urls(self) -> list[str]:
        """Every server's client URL, in order."""
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        """Every server's client URL, comma-separated (what ``--nats-url`` and `Bus.connect` take)."""
        return ",".join(self.urls)

    def __iter__(self) -> Iterator[ClusterNatsServer]:
        return iter(self.servers)

    def start(self, timeout: float = FORM_TIMEOUT) -> NatsCluster:
        """Start every server, then wait until the routes are up and JetStream has a meta leader."""
        try:
            for s in self.servers:
                s.start(START_TIMEOUT)
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float = FORM_TIMEOUT, *, servers: list[ClusterNatsServer] | None = None) -> None:
        """Wait until each of ``servers`` (default: all that run) has a route to every other running
        server and reports JetStream healthy (``/healthz``: a meta leader, its streams current).

        Raises:
            ServerStartError: not healthy within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            live = [s for s in self.servers if s.running and not s.stopped]
            pending = [s for s in (servers or live) if not self._healthy(s, len(live) - 1)]
            if not pending:
                return
            last = ", ".join(s.server_name for s in pending)
            if time.monotonic() > deadline:
                raise ServerStartError("nats cluster", f"servers not healthy after {timeout:.0f} s: {last}")
            time.sleep(0.1)

    @staticmethod
    def _healthy(server: ClusterNatsServer, peers: int) -> bool:
        try:
            routes = server.monitor("/routez")
            health = server.monitor("/healthz")
        except (OSError, ValueError):
            return False
        names = {r.get("remote_name") for r in routes.get("routes") or []}
        return len(names) >= peers and health.get("status") == "ok"

    def stream_leader(self, stream: str) -> ClusterNatsServer | None:
        """The running server that leads ``stream`` (a KV bucket ``b`` is stream ``KV_b``), if any."""
        for s in self.servers:
            if not s.running or s.stopped:
                continue
            try:
                jsz = s.monitor("/jsz?streams=true&accounts=true")
            except (OSError, ValueError):
                continue
            for account in jsz.get("account_details") or []:
                for detail in account.get("stream_detail") or []:
                    if detail.get("name") == stream:
                        leader = (detail.get("cluster") or {}).get("leader")
                        return next((x for x in self.servers if x.server_name == leader), None)
        return None

    def kill(self, index: int) -> None:
        """SIGKILL server ``index`` (its store stays, so `restart` brings it back with its data)."""
        self.servers[index].kill()

    def restart(self, index: int, timeout: float = FORM_TIMEOUT) -> None:
        """Start server ``index`` again on its ports and store, and wait until it rejoined."""
        s = self.servers[index]
        s.start(START_TIMEOUT)
        self.wait_healthy(timeout, servers=[s])

    def stop(self) -> None:
        """Stop every server and remove their folders."""
        for s in self.servers:
            s.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
