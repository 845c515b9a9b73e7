"""The transport seam: what the bus needs from NATS, as a protocol tests can wrap."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

logger = logging.getLogger(__name__)

Handler = Callable[[Msg], Awaitable[None]]

#: Subscription buffers: flow control keeps us far below these, they only stop nats-py
#: from dropping a burst of big chunks as a client-side slow consumer.
PENDING_MSGS_LIMIT = 1 << 16
PENDING_BYTES_LIMIT = 1 << 30


class NoResponders(Exception):
    """A request found no subscriber on its subject."""


class Transport(Protocol):
    """Publish / subscribe / request over a message broker."""

    @property
    def max_payload(self) -> int:
        """The largest message payload the broker accepts, in bytes."""
        ...

    async def publish(self, subject: str, payload: bytes | memoryview, headers: dict[str, str] | None = None) -> None:
        """Publish ``payload`` (with optional NATS headers) on ``subject``, fire and forget."""
        ...

    async def request(self, subject: str, payload: bytes, timeout: float) -> bytes:
        """Send a request and return the reply's payload.

        Raises:
            NoResponders: nobody is subscribed.
            TimeoutError: nobody replied in time.
        """
        ...

    async def subscribe(self, subject: str, handler: Handler, *, queue: str = "") -> Subscription:
        """Call ``handler`` for every message on ``subject`` (one member of ``queue`` per message if set)."""
        ...

    async def reply(self, msg: Msg, payload: bytes) -> None:
        """Answer a request message; a message that carries no reply subject is ignored."""
        ...

    async def flush(self, timeout: float = 5.0) -> None:
        """Wait until the broker has received everything published so far.

        Raises:
            TimeoutError: the broker did not confirm within ``timeout`` seconds.
        """
        ...


class NatsTransport:
    """`Transport` over a nats-py connection."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc

    @classmethod
    async def connect(cls, url: str, **options: Any) -> NatsTransport:
        """Connect to the NATS server at ``url``; ``options`` override kvbus's nats-py defaults.

        The defaults reconnect forever (every 0.5 s) and buffer up to 64 MB while disconnected.
        """
        opts: dict[str, Any] = {
            "name": "kvbus",
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            "pending_size": 64 * 1024 * 1024,
        }
        opts.update(options)
        return cls(await nats.connect(url, **opts))

    @property
    def max_payload(self) -> int:
        """The server's max_payload, as announced when the connection was made."""
        return int(self.nc.max_payload)

    async def publish(self, subject: str, payload: bytes | memoryview, headers: dict[str, str] | None = None) -> None:
        """Publish ``payload`` on ``subject``; a memoryview is sent without a copy."""
        # nats-py annotates payload as bytes, but it only takes len() of it and joins it into the
        # write buffer, which any buffer (a memoryview over a chunk) satisfies.
        await self.nc.publish(subject, payload, headers=headers)  # type: ignore[arg-type]

    async def request(self, subject: str, payload: bytes, timeout: float) -> bytes:
        """Send a request and return the reply's payload, with nats-py's errors mapped to ours.

        Raises:
            NoResponders: nobody is subscribed.
            TimeoutError: nobody replied in time.
        """
        try:
            msg = await self.nc.request(subject, payload, timeout=timeout)
        except nats.errors.NoRespondersError:
            raise NoResponders(subject) from None
        except nats.errors.TimeoutError:
            raise TimeoutError(f"no reply on {subject} within {timeout} s") from None
        return msg.data

    async def subscribe(self, subject: str, handler: Handler, *, queue: str = "") -> Subscription:
        """Subscribe ``handler`` to ``subject`` with pending limits big enough for bursts of chunks."""
        return await self.nc.subscribe(
            subject,
            queue=queue,
            cb=handler,
            pending_msgs_limit=PENDING_MSGS_LIMIT,
            pending_bytes_limit=PENDING_BYTES_LIMIT,
        )

    async def reply(self, msg: Msg, payload: bytes) -> None:
        """Publish ``payload`` on the request's reply subject, if it has one."""
        if msg.reply:
            await self.nc.publish(msg.reply, payload)

    async def flush(self, timeout: float = 5.0) -> None:
        """Round-trip a PING to the server, so everything published before has reached it."""
        # nats-py annotates timeout as int, but only hands it to asyncio.wait_for (seconds, float).
        await self.nc.flush(timeout)  # type: ignore[arg-type]

    async def close(self, timeout: float = 5.0) -> None:
        """Drain (deliver what is buffered), but never wait longer than ``timeout``; then close."""
        if self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.nc.drain(), timeout)
        except (Exception, TimeoutError):
            logger.debug("drain failed or took too long, closing", exc_info=True)
        if not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.close(), timeout)
            except (Exception, TimeoutError):
                logger.debug("close failed", exc_info=True)
