"""The transport seam: what the bus needs from NATS, as a protocol tests can wrap."""

from __future__ import annotations

import asyncio
import logging
import math
import time
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
        """The largest message the broker takes, in bytes."""

    async def publish(self, subject: str, payload: bytes | memoryview, headers: dict[str, str] | None = None) -> None:
        """Publish ``payload`` on ``subject`` (NATS headers optional)."""

    async def request(self, subject: str, payload: bytes, timeout: float) -> bytes:
        """Send a request and return the reply's payload.

        Raises:
            NoResponders: nobody is subscribed.
            TimeoutError: nobody replied in time.
        """
        ...

    async def subscribe(self, subject: str, handler: Handler, *, queue: str = "") -> Subscription:
        """Call ``handler`` for each message on ``subject`` (one of a ``queue`` group, if given)."""

    async def reply(self, msg: Msg, payload: bytes) -> None:
        """Answer a request (nothing for a message without a reply subject)."""

    async def flush(self, timeout: float = 5.0) -> None:
        """Wait until the server has everything published so far."""


#: After this client reconnects, a request that finds no responder is asked again (within its
#: timeout) for this long: the other clients reconnect on their own schedule (every 0.5 s, each
#: with its own phase), so right after a server restart a live peer may not have subscribed again
#: yet, and "no responders" then does not mean it is gone.
RECONNECT_GRACE_S = 2.0


class NatsTransport:
    """`Transport` over a nats-py connection.

    Args:
        nc: the connection.
        reconnect_grace_s: how long after a reconnection "no responders" is asked again
            rather than believed (`RECONNECT_GRACE_S`).
    """

    def __init__(self, nc: Client, *, reconnect_grace_s: float = RECONNECT_GRACE_S) -> None:
        self.nc = nc
        self.reconnect_grace_s = reconnect_grace_s
        self.reconnected_at = float("-inf")
        """Monotonic time of the last reconnection (``-inf``: never reconnected)."""

    @classmethod
    async def connect(cls, url: str, *, reconnect_grace_s: float = RECONNECT_GRACE_S, **options: Any) -> NatsTransport:
        """Connect (reconnecting for ever, every 0.5 s, with a 64 MB buffer while disconnected);
        ``options`` go to `nats.connect`, a ``reconnected_cb`` among them is still called."""
        opts: dict[str, Any] = {
            "name": "kvbus",
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            "pending_size": 64 * 1024 * 1024,
        }
        opts.update(options)
        theirs = opts.pop("reconnected_cb", None)
        box: list[NatsTransport] = []

        async def reconnected() -> None:
            if box:
                box[0].reconnected_at = time.monotonic()
            if theirs is not None:
                await theirs()

        transport = cls(
            await nats.connect(url, reconnected_cb=reconnected, **opts), reconnect_grace_s=reconnect_grace_s
        )
        box.append(transport)
        return transport

    def settling(self) -> bool:
        """Whether the connection is down or came back within ``reconnect_grace_s`` (then peers
        may still be reconnecting, and a missing responder may be one of them)."""
        if self.nc.is_reconnecting or not self.nc.is_connected:
            return True
        return time.monotonic() - self.reconnected_at < self.reconnect_grace_s

    @property
    def max_payload(self) -> int:
        """The server's largest message, in bytes."""
        return int(self.nc.max_payload)

    async def publish(self, subject: str, payload: bytes | memoryview, headers: dict[str, str] | None = None) -> None:
        """Publish ``payload`` on ``subject`` (NATS headers optional)."""
        await self.nc.publish(subject, payload, headers=headers)  # type: ignore[arg-type]

    async def request(self, subject: str, payload: bytes, timeout: float) -> bytes:
        """Send a request and return the reply's payload; "no responders" while the connection is
        `settling` after a reconnection is asked again (within ``timeout``), not believed.

        Raises:
            NoResponders: nobody is subscribed (and the connection was not just re-established).
            TimeoutError: nobody replied in time.
        """
        give_up = time.monotonic() + timeout
        backoff = 0.05
        while True:
            left = give_up - time.monotonic()
            try:
                msg = await self.nc.request(subject, payload, timeout=max(left, 0.001))
            except nats.errors.NoRespondersError:
                left = give_up - time.monotonic()
                if left <= backoff or not self.settling():
                    raise NoResponders(subject) from None
                logger.debug("no responder on %s right after a reconnection; asking again", subject)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 0.5)
                continue
            except nats.errors.TimeoutError:
                raise TimeoutError(f"no reply on {subject} within {timeout} s") from None
            return msg.data

    async def subscribe(self, subject: str, handler: Handler, *, queue: str = "") -> Subscription:
        """Call ``handler`` for each message on ``subject`` (one of a ``queue`` group, if given)."""
        return await self.nc.subscribe(
            subject,
            queue=queue,
            cb=handler,
            pending_msgs_limit=PENDING_MSGS_LIMIT,
            pending_bytes_limit=PENDING_BYTES_LIMIT,
        )

    async def reply(self, msg: Msg, payload: bytes) -> None:
        """Answer a request (nothing for a message without a reply subject)."""
        if msg.reply:
            await self.nc.publish(msg.reply, payload)

    async def flush(self, timeout: float = 5.0) -> None:
        """Wait until the server has everything published so far."""
        await self.nc.flush(math.ceil(timeout))

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
