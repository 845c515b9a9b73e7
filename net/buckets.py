"""JetStream KV buckets: get one, creating it on first use with replicas that follow the cluster.

Every bucket kvbus keeps (the agent directory, the coordinator's state and leader leases, the
schedulers' reservations) is made here, with its settings chosen on purpose (`BucketSpec`):

- replicas: ``KVBUS_BUCKET_REPLICAS`` when set, else ``min(3, servers)`` where ``servers`` is the
  size of the NATS cluster the connection is on (the client URLs the server advertises; 1 for a
  server without a cluster). A bucket of R3 survives the loss of any one server.
- storage: file (the state must survive a server restart; it is small).
- TTL: none. Every entry is removed by whoever owns it (an agent deletes its record when it
  closes, a reservation is deleted when cancelled) or ages by a timestamp inside it (leader
  leases, group heartbeats): a bucket TTL would silently drop a live long-lived entry.
- history: 1 (leases use compare-and-set on the revision; no reader needs older values).

A bucket that exists with fewer replicas than wanted is upgraded in place (a JetStream stream
update of ``num_replicas``), or, with ``KVBUS_BUCKET_UPGRADE=refuse``, refused with
`BucketReplicasError`: it is never silently used. A bucket with more replicas than wanted is used
as it is (kvbus never scales one down).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import nats.errors
from nats.js import api
from nats.js.errors import (
    APIError,
    BadRequestError,
    BucketNotFoundError,
    NoStreamResponseError,
    ServiceUnavailableError,
)

from kvbus.errors import ConfigError, KVBusError
from kvbus.net import natspy
from kvbus.net.transport import Transport
from kvbus.protocol import AGENTS_BUCKET, COORD_BUCKET, GROUPS_BUCKET

logger = logging.getLogger(__name__)

__all__ = [
    "BucketReplicasError",
    "BucketSpec",
    "bucket_replicas",
    "bucket_report",
    "cluster_size",
    "key_value",
    "transport_bucket",
    "with_retry",
]

#: Most replicas a bucket gets by default (JetStream's usual R3: one server may be lost).
MAX_DEFAULT_REPLICAS = 3
T = TypeVar("T")

#: What JetStream raises while it cannot answer: no server, no stream leader yet, no reply in time.
UNAVAILABLE = (nats.errors.TimeoutError, nats.errors.NoRespondersError, NoStreamResponseError, ServiceUnavailableError)
#: Seconds `key_value` waits for a JetStream that does not answer (a stream electing a leader).
BUCKET_WAIT_S = 20.0


class BucketReplicasError(KVBusError):
    """A bucket has fewer replicas than the deployment wants and was not (or could not be) upgraded."""

    def __init__(self, bucket: str, have: int, want: int, reason: str) -> None:
        self.bucket = bucket
        self.have = have
        self.want = want
        self.reason = reason
        if have:
            text = (
                f"JetStream bucket {bucket!r} has {have} replica(s), {want} wanted: {reason}. Upgrade it "
                f"(`nats stream edit KV_{bucket} --replicas {want}`, or unset KVBUS_BUCKET_UPGRADE=refuse), "
                f"or set KVBUS_BUCKET_REPLICAS={have} to accept it"
            )
        else:
            text = (
                f"JetStream bucket {bucket!r} with {want} replica(s): {reason}. Give kvbus a cluster of at "
                f"least {want} servers, or set KVBUS_BUCKET_REPLICAS to what the servers can hold"
            )
        super().__init__(text)


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """How one bucket is created (see the module docstring for why each default is what it is)."""

    history: int = 1
    ttl_s: float = 0.0
    """Seconds an entry lives (0: until it is deleted)."""
    storage: api.StorageType = api.StorageType.FILE
    description: str = ""


#: The buckets kvbus creates, by name; any other name gets ``BucketSpec()``.
SPECS: dict[str, BucketSpec] = {
    AGENTS_BUCKET: BucketSpec(description="kvbus agent directory: one record per live agent, deleted when it closes"),
    COORD_BUCKET: BucketSpec(description="kvbus coordinator state and leader leases (leases age by their timestamp)"),
    GROUPS_BUCKET: BucketSpec(description="kvbus group records"),
    "kvbus_sched_reservations": BucketSpec(description="kvbus reservations, deleted when cancelled"),
    "kvbus_sched_learned": BucketSpec(description="kvbus cost-model corrections each group scheduler learned"),
}


def cluster_size(nc: Any) -> int:
    """Servers of the NATS cluster ``nc`` is connected to, as its server advertises them (1 without a cluster)."""
    info = natspy.server_info(nc)
    if not info.get("cluster"):
        return 1
    urls = set(info.get("connect_urls") or [])
    return max(1, len(urls))


def bucket_replicas(nc: Any) -> int:
    """Replicas new buckets get: ``KVBUS_BUCKET_REPLICAS``, else ``min(3, cluster_size(nc))``.

    Raises:
        ConfigError: ``KVBUS_BUCKET_REPLICAS`` is not an integer from 1 to 5 (JetStream's range).
    """
    raw = os.environ.get("KVBUS_BUCKET_REPLICAS", "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            raise ConfigError(f"KVBUS_BUCKET_REPLICAS={raw!r} is not an integer") from None
        if not 1 <= n <= 5:
            raise ConfigError(f"KVBUS_BUCKET_REPLICAS={n} must be from 1 to 5")
        return n
    return min(MAX_DEFAULT_REPLICAS, cluster_size(nc))


def _upgrade_allowed() -> bool:
    mode = os.environ.get("KVBUS_BUCKET_UPGRADE", "upgrade").strip().lower()
    if mode not in ("upgrade", "refuse"):
        raise ConfigError(f"KVBUS_BUCKET_UPGRADE={mode!r}: use 'upgrade' or 'refuse'")
    return mode == "upgrade"


async def key_value(
    js: Any, name: str, *, history: int = 1, replicas: int | None = None, wait_s: float = BUCKET_WAIT_S
) -> Any:
    """The KV bucket ``name`` of the JetStream context ``js``, created (or upgraded) with enough replicas.

    JetStream that does not answer (a server lost, its streams electing new leaders) is asked
    again for up to ``wait_s`` seconds.

    Args:
        history: values kept per key when the bucket is created.
        replicas: replicas wanted (default `bucket_replicas` of the connection).
        wait_s: how long an unavailable JetStream is waited for.

    Raises:
        BucketReplicasError: the bucket has fewer replicas than wanted and is not upgraded.
        ConfigError: bad ``KVBUS_BUCKET_*`` settings.
        nats.errors.TimeoutError: JetStream did not answer within ``wait_s``.
    """
    return await with_retry(
        lambda: _key_value(js, name, history=history, replicas=replicas), f"bucket {name}", wait_s=wait_s
    )


async def _key_value(js: Any, name: str, *, history: int, replicas: int | None) -> Any:
    want = replicas or bucket_replicas(natspy.connection_of(js))
    spec = SPECS.get(name, BucketSpec())
    try:
        kv = await js.key_value(name)
    except BucketNotFoundError:
        try:
            return await js.create_key_value(
                bucket=name,
                history=max(history, spec.history),
                ttl=spec.ttl_s or None,
                storage=spec.storage,
                replicas=want,
                description=spec.description or None,
            )
        except BadRequestError as exc:
            # Another process created it at the same moment with other settings (check that
            # one), or the server cannot have that many replicas (a server without a cluster).
            logger.debug("creating bucket %s: %s; looking for an existing one", name, exc)
            try:
                kv = await js.key_value(name)
            except BucketNotFoundError:
                raise BucketReplicasError(name, 0, want, f"JetStream refused to create it: {exc.description}") from None
        except APIError as exc:
            raise BucketReplicasError(name, 0, want, f"JetStream could not create it: {exc.description}") from None
    await _ensure_replicas(js, name, want)
    return kv


async def _ensure_replicas(js: Any, name: str, want: int) -> None:
    stream = f"KV_{name}"
    info = await js.stream_info(stream)
    have = int(info.config.num_replicas or 1)
    if have >= want:
        return
    if not _upgrade_allowed():
        raise BucketReplicasError(name, have, want, "KVBUS_BUCKET_UPGRADE=refuse")
    config = info.config
    config.num_replicas = want
    try:
        await js.update_stream(config)
    except APIError as exc:
        raise BucketReplicasError(name, have, want, f"the upgrade failed: {exc.description}") from None
    logger.warning("JetStream bucket %s had %d replica(s): upgraded to %d", name, have, want)


async def with_retry(op: Callable[[], Awaitable[T]], what: str, *, wait_s: float = BUCKET_WAIT_S) -> T:
    """``await op()``, asked again while JetStream does not answer (a bucket's stream electing a
    new leader after a server died takes a few seconds), for up to ``wait_s`` seconds.

    Only for operations that are safe to repeat (a put of the same value, a get, a delete).

    Raises:
        nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError: still no answer at the end.
    """
    give_up = time.monotonic() + wait_s
    delay = 0.1
    while True:
        try:
            return await op()
        except UNAVAILABLE as exc:
            if time.monotonic() + delay > give_up:
                raise
            logger.info("%s: JetStream unavailable (%s); asking again", what, type(exc).__name__)
            await asyncio.sleep(delay)
            delay = min(1.0, 2 * delay)


async def transport_bucket(transport: Transport, name: str, *, history: int = 1) -> Any:
    """The bucket ``name`` in ``transport``'s JetStream, or None for a transport without one."""
    js = transport.jetstream()
    if js is None:
        return None
    return await key_value(js, name, history=history)


async def bucket_report(js: Any, names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Per existing kvbus bucket (or each of ``names``): its replicas, the current ones and the leader.

    A bucket that does not exist is left out.
    """
    out: dict[str, dict[str, Any]] = {}
    for name in names or list(SPECS):
        try:
            info = await js.stream_info(f"KV_{name}")
        except APIError:
            continue
        cluster = info.cluster
        peers = list(cluster.replicas or []) if cluster else []
        out[name] = {
            "replicas": int(info.config.num_replicas or 1),
            "current": 1 + sum(1 for p in peers if p.current) if cluster and cluster.leader else 0,
            "leader": cluster.leader if cluster else None,
        }
    return out
