"""The remote tier on a Redis Cluster (Valkey cluster mode): the client, and writes a replica confirmed.

A cluster URL is ``redis+cluster://[[user]:password@]host:port[,host:port...]`` (``rediss+cluster``
for TLS), or any ``redis://`` URL naming several hosts; any node bootstraps the client, which
learns the others (and every failover) from the cluster itself.

A block's record is one hash (payload and metadata are fields of one key, written by one
``HSET``), so both live in the same hash slot by construction; the key's hash tag is the block
key (``kvbus:kv:int8:{<block key>}``), so the records of one block under every codec share a slot
too, and any future multi-key operation on one block (``MULTI``) stays on one node.

Durability across a failover: Redis replication is asynchronous, so a write a primary
acknowledged can still be lost when it dies before its replica got it. A write therefore goes
to the block's primary on one connection followed by ``WAIT replicas timeout``: the primary
answers how many replicas have everything that connection wrote. Only when that reaches
``wait_replicas`` is the block confirmed (and its memory freed); otherwise it stays resident and
is offloaded again later. A replica promoted after the primary died holds every confirmed block.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import unquote

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import AskError, ClusterDownError, MovedError, RedisError, TryAgainError

from kvbus.cachetier.config import CacheTierConfig
from kvbus.cachetier.errors import RemoteUnavailable

logger = logging.getLogger(__name__)

#: Replies that mean "the slot is elsewhere now, or being failed over": ask again after a refresh.
REROUTE = (MovedError, AskError, ClusterDownError, TryAgainError)
#: ``WAIT`` timeout (ms) on a primary whose last ``WAIT`` fell short (it has lost its replica):
#: its writes cannot be confirmed until a replica is back, so they do not each wait the full time.
SHORT_WAIT_MS = 20


class NotReplicated(RemoteUnavailable):
    """A primary wrote the record but too few replicas confirmed it in time: it is not acknowledged."""


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a cluster (a ``+cluster`` scheme, or several hosts)."""
    scheme, _, rest = url.partition("://")
    netloc = rest.split("/", 1)[0].split("?", 1)[0]
    return scheme.endswith("+cluster") or "," in netloc.rpartition("@")[2]


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """The nodes of a cluster URL and the client options it carries (user, password, TLS).

    Raises:
        ValueError: the URL names no node or a port that is not a number.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError("a cluster URL looks like redis+cluster://host:port,host:port")
    netloc = rest.split("/", 1)[0].split("?", 1)[0]
    userinfo, at, hosts = netloc.rpartition("@")
    options: dict[str, Any] = {"ssl": scheme.split("+", 1)[0] == "rediss"}
    if at:
        user, colon, password = userinfo.partition(":")
        if user:
            options["username"] = unquote(user)
        if colon:
            options["password"] = unquote(password)
    nodes = []
    for part in hosts.split(","):
        part = part.strip()
        if not part:
            continue
        if part.startswith("["):
            host, _, port_text = part[1:].partition("]")
            port_text = port_text.lstrip(":")
        else:
            host, _, port_text = part.rpartition(":") if ":" in part else (part, "", "")
        try:
            port = int(port_text) if port_text else 6379
        except ValueError:
            raise ValueError(f"bad port in {part!r}") from None
        nodes.append((host, port))
    if not nodes:
        raise ValueError("the cluster URL names no node")
    return nodes, options


def cluster_client(url: str, config: CacheTierConfig, retry: Any) -> RedisCluster:
    """A redis-py asyncio cluster client for the cluster URL ``url``."""
    nodes, options = parse_cluster_url(url)
    return RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in nodes],
        socket_connect_timeout=config.connect_timeout,
        socket_timeout=config.socket_timeout,
        retry=retry,
        decode_responses=False,
        # The other shards serve while one fails over (blocks there miss and are recomputed).
        require_full_coverage=False,
        **options,
    )


class ClusterWriter:
    """Writes records to their primaries, each batch followed by ``WAIT`` on the same connection;
    reads them from their primaries, one pipeline per primary.

    One plain client per primary (by ``host:port``): a standalone pipeline runs on one
    connection, which is what ``WAIT`` counts.
    """

    def __init__(self, client: RedisCluster, config: CacheTierConfig, replicas: int, url: str) -> None:
        self.client = client
        self.config = config
        self.replicas = replicas
        self.url = url
        self._nodes: dict[str, aioredis.Redis] = {}
        self._short: set[str] = set()
        """Primaries whose last WAIT fell short (their next one waits `SHORT_WAIT_MS`)."""
        self.waits = 0
        """WAIT round trips made (for the benches)."""
        self.unconfirmed = 0
        """Records a primary wrote but not enough replicas confirmed in time."""

    def _node_client(self, node: ClusterNode) -> aioredis.Redis:
        c = self._nodes.get(node.name)
        if c is None:
            kwargs = self.client.get_connection_kwargs()
            c = aioredis.Redis(
                host=node.host,
                port=int(node.port),
                username=kwargs.get("username"),
                password=kwargs.get("password"),
                ssl=bool(kwargs.get("ssl", False)),
                socket_connect_timeout=self.config.connect_timeout,
                socket_timeout=self.config.socket_timeout,
                decode_responses=False,
            )
            self._nodes[node.name] = c
        return c

    async def write(
        self, records: Sequence[tuple[str, Mapping[bytes, Any]]], ttl: int, rounds: int = 4
    ) -> list[BaseException | None]:
        """Write every record; per record None when its primary and ``replicas`` replicas have it,
        else the reason it is not confirmed.

        Records whose slot moved (a failover) are routed again after a topology refresh, up to
        ``rounds`` times with a growing pause (a failover takes the cluster's node timeout).
        """
        result: list[BaseException | None] = [RemoteUnavailable(self.url, "not written")] * len(records)
        todo = list(range(len(records)))
        delay = 0.25
        for attempt in range(rounds):
            await self.client.initialize()
            by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
            for i in todo:
                try:
                    node = self.client.get_node_from_key(records[i][0])
                except RedisError as exc:  # a slot nobody covers (failing over)
                    result[i] = exc
                    continue
                if node is None:
                    continue
                by_node.setdefault(node.name, (node, []))[1].append(i)
            outcomes = await asyncio.gather(
                *(self._write_node(node, [records[i] for i in idx], ttl) for node, idx in by_node.values())
            )
            again: list[int] = [i for i in todo if not any(i in idx for _, idx in by_node.values())]
            for (_, idx), replies in zip(by_node.values(), outcomes):
                for i, reply in zip(idx, replies):
                    result[i] = reply
                    if isinstance(reply, REROUTE) or (
                        isinstance(reply, RemoteUnavailable) and not isinstance(reply, NotReplicated)
                    ):
                        again.append(i)
            if not again or attempt == rounds - 1:
                break
            todo = again
            logger.info("remote tier: %d record(s) to route again after a topology change", len(todo))
            await self.client.nodes_manager.initialize()
            await asyncio.sleep(delay)
            delay *= 2
        return result

    async def _write_node(
        self, node: ClusterNode, records: Sequence[tuple[str, Mapping[bytes, Any]]], ttl: int
    ) -> list[BaseException | None]:
        client = self._node_client(node)
        try:
            async with client.pipeline(transaction=False) as pipe:
                for rk, fields in records:
                    mapping: Any = dict(fields)  # redis-py's annotation leaves out bytes keys, which it takes
                    pipe.hset(rk, mapping=mapping)
                    if ttl:
                        pipe.expire(rk, ttl)
                timeout = SHORT_WAIT_MS if node.name in self._short else self.config.wait_timeout_ms
                pipe.execute_command("WAIT", self.replicas, timeout)
                replies = await pipe.execute(raise_on_error=False)
        except (RedisError, OSError) as exc:
            # The node died or went away mid-batch: none of its records may be assumed written.
            self._nodes.pop(node.name, None)
            return [RemoteUnavailable(self.url, f"{node.name}: {type(exc).__name__}: {exc}")] * len(records)
        self.waits += 1
        acked = replies[-1]
        short = not isinstance(acked, int) or acked < self.replicas
        if short:
            self._short.add(node.name)
            self.unconfirmed += len(records)
            logger.warning(
                "remote tier: %s confirmed %s of %d replica(s): %d block(s) stay in memory",
                node.name,
                acked,
                self.replicas,
                len(records),
            )
        else:
            self._short.discard(node.name)
        step = 2 if ttl else 1
        out: list[BaseException | None] = []
        for k in range(len(records)):
            reply = replies[k * step]
            if isinstance(reply, BaseException):
                out.append(reply)
            elif short:
                out.append(NotReplicated(self.url, f"{node.name}: {acked} of {self.replicas} replica(s) confirmed"))
            else:
                out.append(None)
        return out

    async def read(self, record_keys: Sequence[str], ttl: int) -> list[Any]:
        """``HGETALL`` (and ``EXPIRE`` with ``ttl``) of each record on its primary, one pipeline per
        primary at once: per record its fields, or the exception that kept it from being read.

        A primary that is down or failing over fails only its own records (they miss and are
        recomputed); the others are read as usual.
        """
        await self.client.initialize()
        out: list[Any] = [None] * len(record_keys)
        by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
        for i, rk in enumerate(record_keys):
            try:
                node = self.client.get_node_from_key(rk)
            except RedisError as exc:
                out[i] = exc
                continue
            if node is None:
                out[i] = RemoteUnavailable(self.url, f"no node serves {rk}")
                continue
            by_node.setdefault(node.name, (node, []))[1].append(i)
        results = await asyncio.gather(
            *(self._read_node(node, [record_keys[i] for i in idx], ttl) for node, idx in by_node.values())
        )
        refresh = False
        for (_, idx), replies in zip(by_node.values(), results):
            for i, reply in zip(idx, replies):
                out[i] = reply
                refresh = refresh or isinstance(reply, (*REROUTE, RemoteUnavailable))
        if refresh:
            # The next call routes by the cluster's current view (a failover moved slots).
            try:
                await self.client.nodes_manager.initialize()
            except (RedisError, OSError):
                logger.debug("cluster topology refresh failed", exc_info=True)
        return out

    async def _read_node(self, node: ClusterNode, record_keys: Sequence[str], ttl: int) -> list[Any]:
        client = self._node_client(node)
        try:
            async with client.pipeline(transaction=False) as pipe:
                for rk in record_keys:
                    pipe.hgetall(rk)
                    if ttl:
                        pipe.expire(rk, ttl)
                replies = await pipe.execute(raise_on_error=False)
        except (RedisError, OSError) as exc:
            self._nodes.pop(node.name, None)
            return [RemoteUnavailable(self.url, f"{node.name}: {type(exc).__name__}: {exc}")] * len(record_keys)
        return list(replies[::2] if ttl else replies)

    async def close(self) -> None:
        """Close the per-node clients."""
        for c in self._nodes.values():
            await c.aclose()
        self._nodes.clear()


def wait_replicas(config: CacheTierConfig, cluster: bool) -> int:
    """Replicas a write must reach: the configured count, or 1 on a cluster and 0 otherwise."""
    if config.wait_replicas >= 0:
        return config.wait_replicas
    return 1 if cluster else 0


PipelineCommand = Callable[[Any, int, str], object]
