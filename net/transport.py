"""The transport seam: what the bus needs from NATS, as a protocol tests can wrap."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import nats
import nats.js.api
from nats.aio.client import NO_RESPONDERS_STATUS, Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from kvbus.errors import KVBusError
from kvbus.net import natspy
from kvbus.net.servers import reconnect_options, server_urls

logger = logging.getLogger(__name__)

#: Largest chunk kvbus puts in one NATS message, whatever the server's max_payload allows
#: (NATS recommends payloads of at most 8 MB).
MAX_NATS_CHUNK = 8 * 1024 * 1024
#: Bytes of headers and protocol line kept free below max_payload by `NatsTransport.max_chunk_size`.
DEFAULT_HEADER_ROOM = 4096
_CRLF = b"\r\n"
_HEADER_KEY_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE_NEWLINES = str.maketrans({"\r": " ", "\n": " "})

Handler = Callable[[Msg], Awaitable[None]]

#: Subscription buffers: flow control keeps us far below these, they only stop nats-py
#: from dropping a burst of big chunks as a client-side slow consumer.
PENDING_MSGS_LIMIT = 1 << 16
PENDING_BYTES_LIMIT = 1 << 30


class NoResponders(KVBusError):
    """A request found no subscriber on its subject.

    Under the root, not under a bus or transfer error: it says only that nobody listens on
    ``subject`` now, and each caller turns it into what it means there (`ReceiverGone`,
    `SchedulerUnavailable`, a retry). No builtin base: ``except ConnectionError`` / ``OSError``
    handlers (a broken path) must not start catching it.

    Attributes:
        subject: the subject nobody is subscribed to.
    """

    def __init__(self, subject: str) -> None:
        self.subject = subject
        super().__init__(f"no responder on {subject}")


class Transport(Protocol):
    """Publish / subscribe / request over a message broker.

    `NatsTransport` is the one over NATS; `TransportWrapper` is the base of a wrapper that
    changes some calls (fault injection, counting). All members are called on the event loop
    of the connection.
    """

    @property
    def max_payload(self) -> int:
        """The largest message payload the broker accepts, in bytes."""
        ...

    @property
    def uses_tls(self) -> bool:
        """Whether the connection to the broker is encrypted (the bus then keeps its direct
        ``tcp`` path encrypted too, or off)."""
        ...

    def settling(self) -> bool:
        """Whether the connection is down or was just re-established: peers may still be
        reconnecting, so a missing responder or a lost fire-and-forget message may be one of them
        (a report is then said again)."""
        ...

    def jetstream(self) -> JetStreamContext | None:
        """The broker's JetStream (for the KV buckets: agent directory, leases, state), or None
        when this transport has none (the callers then do without a bucket)."""
        ...

    async def publish(self, subject: str, payload: bytes | memoryview, headers: dict[str, str] | None = None) -> None:
        """Publish ``payload`` (with optional NATS headers) on ``subject``, fire and forget."""
        ...

    async def publish_views(
        self, subject: str, views: Sequence[bytes | memoryview], headers: dict[str, str] | None = None
    ) -> None:
        """`publish` one message whose payload is ``views`` back to back (without joining them
        where the transport can: `NatsTransport.publish_views`); the views must stay unchanged
        until the message is flushed."""
        ...

    async def request(self, subject: str, payload: bytes, timeout: float) -> bytes:
        """Send a request and return the reply's payload.

        Raises:
            NoResponders: nobody is subscribed.
            TimeoutError: nobody replied in time.
        """
        ...

    async def request_views(self, subject: str, views: Sequence[bytes | memoryview], timeout: float) -> bytes:
        """`request` with a payload of ``views`` back to back (not joined where the transport can).

        Raises:
            NoResponders, TimeoutError: as `request`.
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

    async def close(self) -> None:
        """Deliver what is buffered (bounded in time), then close the connection; closing twice is harmless."""
        ...


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
    async def connect(
        cls, url: str | Sequence[str], *, reconnect_grace_s: float = RECONNECT_GRACE_S, **options: Any
    ) -> NatsTransport:
        """Connect to one of the servers in ``url`` (a URL, a comma-separated list or a sequence).

        The client reconnects for ever, to any server of the list (or of the cluster, which the
        server tells it about), and notices a stopped server by its pings (`kvbus.net.servers`).
        ``options`` go to `nats.connect` and win over these defaults; a ``reconnected_cb`` among
        them is still called.
        """
        servers = server_urls(url)
        opts: dict[str, Any] = {
            "name": "kvbus",
            "pending_size": 64 * 1024 * 1024,
            **reconnect_options(servers),
        }
        opts.update(options)
        theirs = opts.pop("reconnected_cb", None)
        box: list[NatsTransport] = []

        async def reconnected() -> None:
            if box:
                box[0].reconnected_at = time.monotonic()
            if theirs is not None:
                await theirs()

        nc = await nats.connect(servers, reconnected_cb=reconnected, **opts)
        natspy.install_large_reads(nc)
        transport = cls(nc, reconnect_grace_s=reconnect_grace_s)
        box.append(transport)
        return transport

    def settling(self) -> bool:
        """Whether the connection is down or came back within ``reconnect_grace_s`` (then peers
        may still be reconnecting, and a missing responder may be one of them)."""
        if self.nc.is_reconnecting or not self.nc.is_connected:
            return True
        return time.monotonic() - self.reconnected_at < self.reconnect_grace_s

    @property
    def uses_tls(self) -> bool:
        """Whether this connection runs over TLS (the server requires it, or the handshake comes
        first): nats-py upgrades in exactly these cases."""
        info = natspy.server_info(self.nc)
        return bool(info.get("tls_required")) or bool(self.nc.options.get("tls_handshake_first"))

    @property
    def max_payload(self) -> int:
        """The server's max_payload, as announced when the connection was made."""
        return int(self.nc.max_payload)

    def jetstream(self) -> JetStreamContext:
        """The connection's JetStream context."""
        return self.nc.jetstream()

    def max_chunk_size(self, header_room: int = DEFAULT_HEADER_ROOM) -> int:
        """The largest chunk one message can carry: the server's max_payload less ``header_room``, at most 8 MB."""
        return max(1024, min(MAX_NATS_CHUNK, self.max_payload - header_room))

    async def publish(self, subject: str, payload: bytes | memoryview, headers: dict[str, str] | None = None) -> None:
        """Publish ``payload`` on ``subject``; a memoryview is sent without a copy."""
        # nats-py annotates payload as bytes, but it only takes len() of it and joins it into the
        # write buffer, which any buffer (a memoryview over a chunk) satisfies.
        await self.nc.publish(subject, payload, headers=headers)  # type: ignore[arg-type]

    async def publish_views(
        self,
        subject: str,
        views: Sequence[bytes | memoryview],
        headers: dict[str, str] | None = None,
        *,
        reply: str = "",
    ) -> None:
        """Publish one message whose payload is ``views`` back to back, without joining them.

        nats-py's ``publish`` builds the whole protocol frame as one ``bytes`` (a copy of the
        payload) and its flusher joins the pending frames again (a second copy, on Python 3.11).
        Here the frame's head and the views go into the connection's pending list as they are
        (`kvbus.net.natspy.write_views`: every use of nats-py's internals is there),
        and the connection writes them with one ``sendmsg`` (only what the socket does not take
        at once is copied into asyncio's buffer). Everything else is nats-py's own: the pending
        limit while reconnecting (the views then wait in the pending list and go out after the
        reconnect), the flusher, ``flush()``.

        The views must stay valid and unchanged until the message is flushed.

        Raises:
            nats.errors.ConnectionClosedError, ConnectionDrainingError, OutboundBufferLimitError,
            MaxPayloadError, BadSubjectError, BadHeaderError: as ``nc.publish`` would.
        """
        nc = self.nc
        flat = [memoryview(v).cast("B") if memoryview(v).format != "B" else memoryview(v) for v in views]
        size = sum(v.nbytes for v in flat)
        if not natspy.can_write_views(nc):
            await nc.publish(subject, b"".join(flat), reply=reply, headers=headers)
            return
        if not subject or any(c in subject for c in " \t\r\n") or any(c in reply for c in " \t\r\n"):
            raise nats.errors.BadSubjectError
        if nc.is_closed:
            raise nats.errors.ConnectionClosedError
        if nc.is_draining_pubs:
            raise nats.errors.ConnectionDrainingError
        natspy.check_room(nc, size)
        head = _publish_head(subject, headers, size, reply)
        await natspy.write_views(nc, head, flat, size)

    async def request(self, subject: str, payload: bytes, timeout: float) -> bytes:
        """Send a request and return the reply's payload; "no responders" while the connection is
        `settling` after a reconnection is asked again (within ``timeout``), not believed.

        Raises:
            NoResponders: nobody is subscribed (and the connection was not just re-established).
            TimeoutError: nobody replied in time.
        """
        return await self._request(subject, lambda left: self.nc.request(subject, payload, timeout=left), timeout)

    async def request_views(self, subject: str, views: Sequence[bytes | memoryview], timeout: float) -> bytes:
        """`request` with a payload of ``views`` back to back, published without joining them
        (`publish_views`): a framed `Open` and the inline payload it carries go out as they are,
        where nats-py's ``request`` would copy the payload into new ``bytes`` twice (fresh pages
        that fault in, a millisecond per megabyte on some VMs).

        Raises:
            NoResponders, TimeoutError: as `request`.
        """
        nc = self.nc
        if not natspy.can_request_views(nc):
            return await self.request(subject, b"".join(views), timeout)
        return await self._request(subject, lambda left: self._ask_views(subject, views, left), timeout)

    async def _ask_views(self, subject: str, views: Sequence[bytes | memoryview], timeout: float) -> Msg:
        """nats-py's new-style request (one wildcard reply subscription, a token per request), publishing views."""
        nc = self.nc
        if nc.is_draining_pubs:
            raise nats.errors.ConnectionDrainingError
        inbox, future = await natspy.new_request(nc)
        try:
            await self.publish_views(subject, views, reply=inbox)
            msg = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise nats.errors.TimeoutError from None
        finally:
            if not future.done():
                future.cancel()
        if msg.headers and msg.headers.get(nats.js.api.Header.STATUS) == NO_RESPONDERS_STATUS:
            raise nats.errors.NoRespondersError
        return msg

    async def _request(self, subject: str, ask: Callable[[float], Awaitable[Msg]], timeout: float) -> bytes:
        give_up = time.monotonic() + timeout
        backoff = 0.05
        while True:
            left = give_up - time.monotonic()
            try:
                msg = await ask(max(left, 0.001))
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
        """Publish ``payload`` on the request's reply subject, if it has one."""
        if msg.reply:
            await self.nc.publish(msg.reply, payload)

    async def flush(self, timeout: float = 5.0) -> None:
        """Round-trip a PING to the server, so everything published or subscribed before has reached it (`flush`)."""
        await flush(self.nc, timeout)

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


async def flush(nc: Client, timeout: float = 5.0) -> None:
    """``nc.flush`` that keeps its promise: everything sent before it has reached the server.

    nats-py 2.16 writes the flush's PING straight to the socket, ahead of the commands still
    queued for its flusher task: a SUB just made, or publishes behind a backlog, reach the
    server after the PONG has come back, so "subscribed, flushed, now ask from another
    connection" finds no responder. The queue is written out first (as the flusher does it:
    `kvbus.net.natspy.write_pending`), then the PING goes.

    Raises:
        TimeoutError: the queue was not written, or no PONG came, within ``timeout`` seconds.
    """
    if nc.is_connected and natspy.pending_bytes(nc) > 0:
        give_up = time.monotonic() + timeout
        await natspy.write_pending(nc, timeout)
        timeout = max(give_up - time.monotonic(), 0.001)
    # nats-py annotates timeout as int, but only hands it to asyncio.wait_for (seconds, float).
    await nc.flush(timeout)  # type: ignore[arg-type]  # FlushTimeoutError is a TimeoutError


async def request_views(
    transport: Transport, subject: str, views: Sequence[bytes | memoryview], timeout: float
) -> bytes:
    """``transport.request_views``: a request whose payload is ``views`` back to back."""
    return await transport.request_views(subject, views, timeout)


async def publish_views(
    transport: Transport, subject: str, views: Sequence[bytes | memoryview], headers: dict[str, str] | None = None
) -> None:
    """``transport.publish_views``: publish ``views`` as one message."""
    await transport.publish_views(subject, views, headers=headers)


class TransportWrapper:
    """A `Transport` over another one, the base of a wrapper that changes some of its calls (a
    fault injector, a counter, a recorder in a test or a bench).

    Every member goes to ``inner`` as it is, except the two views methods: they hand their
    payload to this object's own `publish` / `request` (one view as it is, several joined), so a
    subclass that overrides only ``publish`` or ``request`` sees every message the bus sends.

    Args:
        inner: the transport wrapped.
    """

    def __init__(self, inner: Transport) -> None:
        self.inner = inner

    @property
    def max_payload(self) -> int:
        """``inner``'s."""
        return self.inner.max_payload

    @property
    def uses_tls(self) -> bool:
        """``inner``'s."""
        return self.inner.uses_tls

    def settling(self) -> bool:
        """``inner``'s."""
        return self.inner.settling()

    def jetstream(self) -> JetStreamContext | None:
        """``inner``'s."""
        return self.inner.jetstream()

    async def publish(self, subject: str, payload: bytes | memoryview, headers: dict[str, str] | None = None) -> None:
        """``inner``'s."""
        await self.inner.publish(subject, payload, headers)

    async def publish_views(
        self, subject: str, views: Sequence[bytes | memoryview], headers: dict[str, str] | None = None
    ) -> None:
        """Through this object's `publish`: one view as it is, several joined."""
        await self.publish(subject, views[0] if len(views) == 1 else b"".join(views), headers=headers)

    async def request(self, subject: str, payload: bytes, timeout: float) -> bytes:
        """``inner``'s."""
        return await self.inner.request(subject, payload, timeout=timeout)

    async def request_views(self, subject: str, views: Sequence[bytes | memoryview], timeout: float) -> bytes:
        """Through this object's `request`, the views joined."""
        return await self.request(subject, b"".join(views), timeout=timeout)

    async def subscribe(self, subject: str, handler: Handler, *, queue: str = "") -> Subscription:
        """``inner``'s."""
        return await self.inner.subscribe(subject, handler, queue=queue)

    async def reply(self, msg: Msg, payload: bytes) -> None:
        """``inner``'s."""
        await self.inner.reply(msg, payload)

    async def flush(self, timeout: float = 5.0) -> None:
        """``inner``'s."""
        await self.inner.flush(timeout)

    async def close(self) -> None:
        """``inner``'s."""
        await self.inner.close()


def _publish_head(subject: str, headers: dict[str, str] | None, size: int, reply: str = "") -> bytes:
    """The PUB / HPUB line (and the header block) of a message of ``size`` payload bytes, as nats-py builds it."""
    if not headers:
        return f"PUB {subject} {reply} {size}\r\n".encode()
    hdr = bytearray(b"NATS/1.0\r\n")
    for k, v in headers.items():
        key = k.strip()
        if not key:
            continue
        if not _HEADER_KEY_RE.fullmatch(key):
            raise nats.errors.BadHeaderError(key)
        hdr += key.encode() + b": " + v.strip().translate(_HEADER_VALUE_NEWLINES).encode() + _CRLF
    hdr += _CRLF
    return f"HPUB {subject} {reply} {len(hdr)} {len(hdr) + size}\r\n".encode() + bytes(hdr)
