"""The transport seam: what the bus needs from NATS, as a protocol tests can wrap."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvbus.net.servers import reconnect_options, server_urls

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

    max_payload: int

    async def publish(
        self, subject: str, payload: bytes | memoryview, headers: dict[str, str] | None = None
    ) -> None: ...

    async def request(self, subject: str, payload: bytes, timeout: float) -> bytes:
        """Send a request and return the reply's payload.

        Raises:
            NoResponders: nobody is subscribed.
            TimeoutError: nobody replied in time.
        """
        ...

    async def subscribe(self, subject: str, handler: Handler, *, queue: str = "") -> Subscription: ...

    async def reply(self, msg: Msg, payload: bytes) -> None: ...

    async def flush(self, timeout: float = 5.0) -> None: ...


class NatsTransport:
    """`Transport` over a nats-py connection."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc

    @classmethod
    async def connect(cls, url: str | Sequence[str], **options: Any) -> NatsTransport:
        """Connect to one of the servers in ``url`` (a URL, a comma-separated list or a sequence).

        The client reconnects for ever, to any server of the list (or of the cluster, which the
        server tells it about), and notices a stopped server by its pings (`kvbus.net.servers`).
        ``options`` go to `nats.connect` and win over these defaults.
        """
        servers = server_urls(url)
        opts: dict[str, Any] = {
            "name": "kvbus",
            "pending_size": 64 * 1024 * 1024,
            **reconnect_options(servers),
        }
        opts.update(options)
        return cls(await nats.connect(servers, **opts))

    @property
    def max_payload(self) -> int:
        return int(self.nc.max_payload)

    async def publish(self, subject: str, payload: bytes | memoryview, headers: dict[str, str] | None = None) -> None:
        await self.nc.publish(subject, payload, headers=headers)  # type: ignore[arg-type]

    async def request(self, subject: str, payload: bytes, timeout: float) -> bytes:
        try:
            msg = await self.nc.request(subject, payload, timeout=timeout)
        except nats.errors.NoRespondersError:
            raise NoResponders(subject) from None
        except nats.errors.TimeoutError:
            raise TimeoutError(f"no reply on {subject} within {timeout} s") from None
        return msg.data

    async def subscribe(self, subject: str, handler: Handler, *, queue: str = "") -> Subscription:
        return await self.nc.subscribe(
            subject,
            queue=queue,
            cb=handler,
            pending_msgs_limit=PENDING_MSGS_LIMIT,
            pending_bytes_limit=PENDING_BYTES_LIMIT,
        )

    async def reply(self, msg: Msg, payload: bytes) -> None:
        if msg.reply:
            await self.nc.publish(msg.reply, payload)

    async def flush(self, timeout: float = 5.0) -> None:
        await self.nc.flush(timeout)

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
