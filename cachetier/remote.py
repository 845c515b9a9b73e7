"""`RemoteStore`: block records in a Redis-protocol server, read and written in pipelines.

Any server that speaks the Redis protocol works (Redis, Valkey, KeyDB, managed services), by
URL: ``redis://[[user]:password@]host:port/db`` or ``rediss://...`` for TLS (redis-py's URL
options apply, e.g. ``?ssl_cert_reqs=none``). A Redis Cluster (Valkey cluster mode) is reached
with ``redis+cluster://host:port,host:port`` or a URL naming several hosts (`kvbus.cachetier.cluster`):
redis-py's cluster client, and writes confirmed by a replica (``WAIT``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvbus.cachetier.cluster import ClusterWriter, cluster_client, is_cluster_url, wait_replicas
from kvbus.cachetier.config import CacheTierConfig
from kvbus.cachetier.errors import RemoteUnavailable
from kvbus.cachetier.record import META_FIELD

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Failures of a remote call, as the tier sees them: each turns into `RemoteUnavailable`.
REMOTE_ERRORS = (RedisError, OSError)


def redact(url: str) -> str:
    """``url`` without its password (for logs and error messages)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))


class RemoteStore:
    """The remote tier of one agent: a redis-py asyncio client and the key layout.

    A block's record is the hash ``{key_prefix}{codec}:{{block key}}`` (the block key is the hash
    tag: on a cluster, a block's records share a slot): tiers with the same prefix on the same
    server share (and deduplicate) the blocks they store with the same codec.
    """

    def __init__(self, url: str, config: CacheTierConfig) -> None:
        """Create the client (no connection yet; see `connect`)."""
        self.url = redact(url)
        self.config = config
        retry = Retry(
            ExponentialWithJitterBackoff(base=0.01, cap=0.5),
            config.retries,
            # A bare OSError (socket level) must retry too. redis-py before 8 annotated
            # supported_errors as RedisError types only (it catches whatever it is given).
            supported_errors=(RedisConnectionError, RedisTimeoutError, OSError),  # type: ignore[arg-type, unused-ignore]
        )
        self.cluster = config.cluster or is_cluster_url(url)
        """Whether the server is a Redis Cluster (redis-py's cluster client)."""
        self.wait_replicas = wait_replicas(config, self.cluster)
        """Replicas that must have a record before its write counts (0: the primary's word)."""
        self.client: Any
        try:
            if self.cluster:
                cluster_url = url if is_cluster_url(url) else url.replace("://", "+cluster://", 1)
                self.client = cluster_client(cluster_url, config, retry)
            else:
                self.client = aioredis.Redis.from_url(
                    url,
                    socket_connect_timeout=config.connect_timeout,
                    socket_timeout=config.socket_timeout,
                    retry=retry,
                    decode_responses=False,
                )
        except (ValueError, RedisError) as exc:
            raise RemoteUnavailable(self.url, f"bad URL: {exc}") from None
        self.writer: ClusterWriter | None = (
            ClusterWriter(self.client, config, self.wait_replicas, self.url)
            if self.cluster and self.wait_replicas
            else None
        )

    @classmethod
    async def connect(cls, url: str, config: CacheTierConfig) -> RemoteStore:
        """A store whose server answered a ``PING`` (which also checks the password).

        Raises:
            RemoteUnavailable: the URL is malformed, or the server is unreachable or refuses us.
        """
        store = cls(url, config)
        try:
            await store.client.ping()
        except REMOTE_ERRORS as exc:
            await store.close()
            raise RemoteUnavailable(store.url, _describe(exc)) from None
        return store

    def record_key(self, codec: str, key: str) -> str:
        """The Redis key of the record of block ``key`` stored with ``codec``."""
        return f"{self.config.key_prefix}{codec}:{{{key}}}"

    async def _pipeline(
        self, record_keys: Sequence[str], command: Callable[[Any, int, str], object], *, ttl: int = 0, wait: int = 0
    ) -> list[Any]:
        """Run ``command(pipe, i, record_key)`` for each record key in one pipeline, each followed by an
        ``EXPIRE`` of ``ttl`` seconds when ``ttl``; returns the replies of the commands (not those of
        the ``EXPIRE`` commands), a refused command's as its exception. With ``wait`` (one server:
        a standalone pipeline is one connection) a ``WAIT wait`` ends the pipeline and a command
        that fewer replicas confirmed counts as refused.

        Raises:
            RemoteUnavailable: the server could not be reached.
        """
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for i, rk in enumerate(record_keys):
                    command(pipe, i, rk)
                    if ttl:
                        pipe.expire(rk, ttl)
                if wait:
                    pipe.execute_command("WAIT", wait, self.config.wait_timeout_ms)
                replies: list[Any] = await pipe.execute(raise_on_error=False)
        except REMOTE_ERRORS as exc:
            raise RemoteUnavailable(self.url, _describe(exc)) from None
        if wait:
            acked = replies.pop()
            if not isinstance(acked, int) or acked < wait:
                short = RemoteUnavailable(self.url, f"{acked} of {wait} replica(s) confirmed in time")
                replies = [r if isinstance(r, BaseException) else short for r in replies]
        return replies[::2] if ttl else replies

    async def metas(self, record_keys: Sequence[str]) -> list[bytes | None]:
        """The ``meta`` field of each record (None where there is no readable one), in one round trip.

        Raises:
            RemoteUnavailable: the server could not be reached.
        """
        if not record_keys:
            return []
        replies = await self._pipeline(record_keys, lambda pipe, _, rk: pipe.hget(rk, META_FIELD))
        # A refused read (e.g. a key of another type) counts as no record: our write is refused too.
        return [r if isinstance(r, bytes) else None for r in replies]

    async def write(self, records: Sequence[tuple[str, Mapping[bytes, Any]]]) -> list[bool]:
        """Write records (one ``HSET`` each, so each is whole or absent) in one pipeline.

        With a TTL an ``EXPIRE`` follows each ``HSET``; a record whose ``EXPIRE`` failed is
        still whole (it only lives until the server evicts it).

        Returns:
            Per record, whether the server confirmed it.

        Raises:
            RemoteUnavailable: the server could not be reached: none of the records may be
                assumed written.
        """
        if not records:
            return []
        replies: Sequence[Any]
        if self.writer is not None:
            # On a cluster: each primary's records, then WAIT, on one connection to it.
            replies = await self.writer.write(records, self.config.remote_ttl)
        else:
            replies = await self._pipeline(
                [rk for rk, _ in records],
                lambda pipe, i, rk: pipe.hset(rk, mapping=dict(records[i][1])),
                ttl=self.config.remote_ttl,
                wait=self.wait_replicas,
            )
        confirmed = []
        for (rk, _), reply in zip(records, replies):
            ok = not isinstance(reply, BaseException)
            if not ok:
                logger.warning("remote tier refused %s: %s", rk, reply)
            confirmed.append(ok)
        return confirmed

    async def touch(self, record_keys: Sequence[str]) -> None:
        """Restart the TTL of existing records (a no-op without TTL)."""
        ttl = self.config.remote_ttl
        if not ttl or not record_keys:
            return
        await self._pipeline(record_keys, lambda pipe, _, rk: pipe.expire(rk, ttl))

    async def read(self, record_keys: Sequence[str]) -> list[dict[bytes, bytes]]:
        """Every field of each record (an empty dict where there is none), in one pipeline.

        With a TTL, each read also restarts its record's TTL: blocks in use stay.

        Raises:
            RemoteUnavailable: the server could not be reached.
        """
        if not record_keys:
            return []
        replies: Sequence[Any]
        if self.writer is not None:
            # On a cluster: one pipeline per primary; a primary that is down misses only its records.
            replies = await self.writer.read(record_keys, self.config.remote_ttl)
            if all(isinstance(r, RemoteUnavailable) for r in replies):
                raise replies[0]
        else:
            replies = await self._pipeline(
                record_keys, lambda pipe, _, rk: pipe.hgetall(rk), ttl=self.config.remote_ttl
            )
        out: list[dict[bytes, bytes]] = []
        for rk, reply in zip(record_keys, replies):
            if isinstance(reply, BaseException) or not isinstance(reply, dict):
                logger.warning("remote tier could not read %s: %s", rk, reply)
                reply = {}
            out.append(reply)
        return out

    async def close(self) -> None:
        """Close the connections to the server(s)."""
        if self.writer is not None:
            await self.writer.close()
        await self.client.aclose()


def batches(items: list[T], limit: int, *, size: Callable[[T], int]) -> list[list[T]]:
    """``items`` in order, in batches of at most ``limit`` bytes (a bigger item is a batch alone):
    what one pipelined read or write carries."""
    out: list[list[T]] = []
    current: list[T] = []
    total = 0
    for item in items:
        n = size(item)
        if current and total + n > limit:
            out.append(current)
            current, total = [], 0
        current.append(item)
        total += n
    if current:
        out.append(current)
    return out


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text
