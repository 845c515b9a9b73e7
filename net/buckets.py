"""JetStream KV buckets: get one, creating it on first use."""

from __future__ import annotations

from typing import Any

from nats.js.errors import BucketNotFoundError


async def key_value(js: Any, name: str, *, history: int = 1) -> Any:
    """The KV bucket ``name`` of the JetStream context ``js``, created with ``history`` if missing."""
    try:
        return await js.key_value(name)
    except BucketNotFoundError:
        return await js.create_key_value(bucket=name, history=history)


async def transport_bucket(transport: Any, name: str, *, history: int = 1) -> Any:
    """The bucket ``name`` over ``transport``'s NATS connection, or None for a transport without one."""
    nc = getattr(transport, "nc", None)
    if nc is None:
        return None
    return await key_value(nc.jetstream(), name, history=history)
