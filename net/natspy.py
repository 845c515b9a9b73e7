"""Every use kvbus makes of what nats-py keeps private, in one module.

Written against nats-py 2.16.0 (`SUPPORTED_VERSION`). ``tests/test_natspy_adapter.py`` checks,
on a live connection to a real nats-server, that the installed nats-py is that version and that
every attribute listed here is there with the type relied on; a new nats-py starts there.

What is relied on, of ``nats.aio.client.Client``:

- ``_server_info`` (dict): the server's INFO (``tls_required``, ``cluster``, ``connect_urls``);
- ``_pending`` (list of bytes), ``_pending_data_size``, ``_max_pending_size``, ``_max_payload``
  (int), ``_flush_pending()``, ``_flusher_task`` (an asyncio task or None), ``_flush_queue`` (an
  asyncio queue or None), ``_transport`` (a ``nats.aio.transport.TcpTransport``, whose
  ``writelines`` and ``_io_writer`` are used): the write buffer `write_views` puts a message's
  pieces in without joining them, and the flusher that writes it out;
- ``_resp_map`` (dict of futures), ``_resp_sub_prefix`` (bytearray or None),
  ``_init_request_sub()``, ``_nuid``: the one wildcard reply subscription of nats-py's
  new-style requests (`new_request`);

- ``_transport.read`` and ``_transport._io_reader`` (an ``asyncio.StreamReader``, whose ``_limit``
  is used): the read loop's reads (`install_large_reads`);

and of ``nats.js.JetStreamContext``: ``_nc``, the connection under it (`connection_of`).

Every function falls back to what nats-py's public API gives when an attribute is missing (an
other version): `can_write_views` and `can_request_views` say False and the transport joins the
pieces and calls ``publish`` / ``request``; `server_info` is empty (no TLS seen from INFO, a
cluster of one); `pending_bytes` is 0 (``flush`` is nats-py's own); `connection_of` is None.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
from collections.abc import Sequence
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

#: The nats-py release this module was written against and is tested with.
SUPPORTED_VERSION = "2.16.0"
#: Most buffers one ``sendmsg`` takes (Linux IOV_MAX).
_IOV_MAX = 1024
#: Bytes nats-py's read loop takes from its stream at once, and what the stream may buffer before
#: it stops reading the socket (half of it; nats-py: 32 KB reads, a pause past 64 KB).
READ_BYTES = 1 << 20


def server_info(nc: Any) -> dict[str, Any]:
    """The INFO the server of ``nc`` sent when the connection was made ({} if unknown)."""
    info = getattr(nc, "_server_info", None)
    return info if isinstance(info, dict) else {}


def connection_of(js: Any) -> Any:
    """The nats-py connection (a ``Client``) a JetStream context runs over (None if unknown)."""
    return getattr(js, "_nc", None)


# -- messages of several pieces, not joined ---------------------------------------------------------


def can_write_views(nc: Client) -> bool:
    """Whether `write_views` can put pieces in this client's write buffer (its internals are as expected)."""
    from nats.aio.transport import TcpTransport

    return (
        isinstance(getattr(nc, "_pending", None), list)
        and hasattr(nc, "_pending_data_size")
        and hasattr(nc, "_flush_pending")
        and isinstance(getattr(nc, "_transport", None), TcpTransport)
    )


def check_room(nc: Client, size: int) -> None:
    """Raise as ``nc.publish`` would for a payload of ``size`` bytes that cannot go out.

    Raises:
        nats.errors.OutboundBufferLimitError: disconnected, and the reconnect buffer is off or full.
        nats.errors.MaxPayloadError: larger than the server's max_payload.
    """
    if not nc.is_connected and (nc._max_pending_size <= 0 or size + nc._pending_data_size > nc._max_pending_size):
        raise nats.errors.OutboundBufferLimitError
    if size > nc._max_payload:
        raise nats.errors.MaxPayloadError


async def write_views(nc: Client, head: bytes, views: Sequence[memoryview], size: int) -> None:
    """Queue one message (its PUB line ``head``, the payload ``views`` of ``size`` bytes, CRLF)
    for nats-py's flusher, as ``nc.publish`` queues its one frame, and kick the flusher.

    Call `can_write_views` and `check_room` first. The views go into the write buffer as they
    are; the connection writes them with one ``sendmsg`` (`install_gather_writes`).
    """
    _install_gather_writes(nc._transport)
    # One synchronous step, so no other publish can put a frame between our pieces.
    nc._pending.append(head)
    nc._pending.extend(v for v in views if v.nbytes)  # type: ignore[misc]  # it writes any buffer
    nc._pending.append(b"\r\n")
    nc._pending_data_size += len(head) + size + 2
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += size
    if nc._max_pending_size > 0 and nc._pending_data_size > nc._max_pending_size:
        await nc._flush_pending(force_flush=True)
    elif nc._flush_queue is not None and nc._flush_queue.empty():
        await nc._flush_pending()


def can_request_views(nc: Client) -> bool:
    """Whether `new_request` works on this client (and `write_views` for the request itself)."""
    return can_write_views(nc) and isinstance(getattr(nc, "_resp_map", None), dict)


async def new_request(nc: Client) -> tuple[str, asyncio.Future[Msg]]:
    """A reply subject on nats-py's wildcard reply subscription (made on first use), and the
    future its reply resolves, as nats-py's new-style ``request`` makes them.

    The future leaves nats-py's map once done: cancel it if the reply is not waited for.
    """
    if not nc._resp_sub_prefix:
        await nc._init_request_sub()
    assert nc._resp_sub_prefix
    token = nc._nuid.next()
    token.extend(secrets.token_hex(2).encode())
    inbox = nc._resp_sub_prefix[:]
    inbox.extend(token)
    key = token.decode()
    future: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
    future.add_done_callback(lambda _: nc._resp_map.pop(key, None))
    nc._resp_map[key] = future
    return inbox.decode(), future


# -- the reads ------------------------------------------------------------------------------------


def install_large_reads(nc: Client) -> bool:
    """Have the read loop of ``nc`` take up to `READ_BYTES` per turn instead of nats-py's 32 KB.

    nats-py reads its stream 32 KB at a time and stops reading the socket while 64 KB wait in it:
    a 1 MB message (an inline `Open`) took 32 turns of its read loop, each a read, a copy into the
    parser's buffer and a parse (under cProfile, 0.75 ms per MB received: as much as the bus's own
    work on an inline `Open`). A read returns what is there at once either way, so small messages are not
    delayed. The stream made again on a reconnect gets its limit at its first read. Returns
    whether it is installed (False: not a transport this module knows).
    """
    from nats.aio.transport import TcpTransport

    tcp = getattr(nc, "_transport", None)
    if not isinstance(tcp, TcpTransport):
        return False
    if getattr(tcp, "_kvbus_reads", False):
        return True
    original = tcp.read

    async def read(buffer_size: int) -> bytes:
        reader = getattr(tcp, "_io_reader", None)
        if reader is not None and isinstance(getattr(reader, "_limit", None), int) and reader._limit < READ_BYTES:
            reader._limit = READ_BYTES
        data: bytes = await original(max(buffer_size, READ_BYTES))
        return data

    tcp.read = read  # type: ignore[method-assign]
    tcp._kvbus_reads = True  # type: ignore[attr-defined]
    return True


# -- the write buffer -------------------------------------------------------------------------------


def pending_bytes(nc: Client) -> int:
    """Bytes queued for nats-py's flusher and not written yet (0 if unknown)."""
    return int(nc._pending_data_size) if can_write_views(nc) else 0


async def write_pending(nc: Client, timeout: float) -> None:
    """Have nats-py's flusher write what is queued (inline if the flusher is gone), within ``timeout``.

    Raises:
        TimeoutError: the flusher did not get to it within ``timeout`` seconds.
    """
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    flusher, queue = getattr(nc, "_flusher_task", None), nc._flush_queue
    if flusher is None or flusher.done() or queue is None:
        await nc._flush_pending()
        return
    await queue.put(done)  # the flusher writes what is queued, then resolves it
    try:
        await asyncio.wait_for(asyncio.shield(done), timeout)
    except TimeoutError:
        raise TimeoutError(f"nats-py's flusher did not write within {timeout} s") from None


def _install_gather_writes(tcp: Any) -> None:
    """Make nats-py's transport write its pending list scatter-gather instead of joining it (Python < 3.12)."""
    if sys.version_info >= (3, 12) or getattr(tcp, "_kvbus_gather", False):
        return  # 3.12+: asyncio's own writelines already uses sendmsg without joining
    original = tcp.writelines

    def writelines(items: Sequence[bytes | memoryview]) -> None:
        writer = tcp._io_writer
        transport = getattr(writer, "transport", None)
        sock = getattr(transport, "_sock", None)
        if transport is None or sock is None or not hasattr(sock, "sendmsg") or not hasattr(transport, "_buffer"):
            original(items)  # TLS (encrypts each item, no join) or an asyncio we do not know
            return
        _gather_write(transport, sock, items)

    tcp.writelines = writelines
    tcp._kvbus_gather = True


def _gather_write(transport: Any, sock: Any, items: Sequence[bytes | memoryview]) -> None:
    views = [memoryview(i) for i in items if len(i)]
    n = 0
    if not (
        transport._buffer
        or transport.is_closing()
        or getattr(transport, "_conn_lost", 0)
        or getattr(transport, "_empty_waiter", None) is not None
    ):
        try:
            n = sock.sendmsg(views[:_IOV_MAX])
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            n = 0  # transport.write below meets the same error and reports it its own way
    for v in views:
        if n >= v.nbytes:
            n -= v.nbytes
            continue
        transport.write(v[n:] if n else v)  # asyncio keeps (copies) only what the socket did not take
        n = 0
