"""The nats-py adapter (`kvbus.net.natspy`) against the nats-py it was written for, on a live
connection to a real nats-server.

A new nats-py release fails the version test first: read what the adapter relies on (its
docstring), check each attribute in the new release, then move `SUPPORTED_VERSION`.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import inspect
import types
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.msg import Msg
from nats.aio.transport import TcpTransport

from kvbus.net import natspy
from kvbus.net.transport import NatsTransport, flush


@pytest.fixture
async def transport(nats_url: str) -> AsyncIterator[NatsTransport]:
    t = await NatsTransport.connect(nats_url)
    try:
        yield t
    finally:
        await t.close()


def test_the_installed_nats_py_is_the_one_the_adapter_supports() -> None:
    assert importlib.metadata.version("nats-py") == natspy.SUPPORTED_VERSION


async def test_every_private_attribute_relied_on_is_there_with_its_type(transport: NatsTransport) -> None:
    nc = transport.nc
    # The server's INFO.
    assert isinstance(nc._server_info, dict) and isinstance(nc._server_info.get("max_payload"), int)
    assert natspy.server_info(nc) is nc._server_info
    # The write buffer and its flusher (`write_views`, `pending_bytes`, `write_pending`).
    assert isinstance(nc._pending, list)
    assert isinstance(nc._pending_data_size, int)
    assert nc._max_pending_size == 64 * 1024 * 1024  # NatsTransport.connect's pending_size
    assert isinstance(nc._max_payload, int) and nc._max_payload == nc.max_payload
    assert inspect.iscoroutinefunction(nc._flush_pending)
    assert "force_flush" in inspect.signature(nc._flush_pending).parameters
    assert isinstance(nc._flusher_task, asyncio.Task) and not nc._flusher_task.done()
    assert isinstance(nc._flush_queue, asyncio.Queue)
    assert isinstance(nc._transport, TcpTransport)
    assert callable(nc._transport.writelines)
    assert isinstance(nc._transport._io_writer, asyncio.StreamWriter)
    assert natspy.can_write_views(nc)
    # The read loop's stream (`install_large_reads`).
    assert isinstance(nc._transport._io_reader, asyncio.StreamReader)
    assert isinstance(nc._transport._io_reader._limit, int)
    assert "buffer_size" in inspect.signature(TcpTransport.read).parameters
    # The new-style request's wildcard reply subscription (`new_request`).
    assert isinstance(nc._resp_map, dict)
    assert nc._resp_sub_prefix is None or isinstance(nc._resp_sub_prefix, bytearray)
    assert inspect.iscoroutinefunction(nc._init_request_sub)
    assert isinstance(nc._nuid.next(), bytearray)
    assert natspy.can_request_views(nc)
    # The connection under a JetStream context.
    assert natspy.connection_of(nc.jetstream()) is nc


async def test_a_request_made_by_the_adapter_gets_its_reply_and_leaves_no_entry(transport: NatsTransport) -> None:
    nc = transport.nc

    async def answer(msg: Msg) -> None:
        await transport.reply(msg, msg.data[::-1])

    sub = await transport.subscribe("kvbus.test.natspy.ask", answer)
    await transport.flush()
    try:
        inbox, future = await natspy.new_request(nc)
        assert isinstance(nc._resp_sub_prefix, bytearray) and inbox.startswith(nc._resp_sub_prefix.decode())
        await transport.publish_views("kvbus.test.natspy.ask", [b"ab", memoryview(b"cd")], reply=inbox)
        reply = await asyncio.wait_for(future, 5)
        assert reply.data == b"dcba"
        await asyncio.sleep(0)  # the done callback runs
        assert all(f is not future for f in nc._resp_map.values())
    finally:
        await sub.unsubscribe()


async def test_flush_writes_the_queued_views_through_the_flusher(transport: NatsTransport) -> None:
    nc = transport.nc
    got: list[bytes] = []

    async def take(msg: Msg) -> None:
        got.append(msg.data)

    sub = await transport.subscribe("kvbus.test.natspy.flush", take)
    await transport.flush()
    try:
        for i in range(8):
            await transport.publish_views("kvbus.test.natspy.flush", [bytes([i]) * 4096])
        await flush(nc, 5.0)
        assert natspy.pending_bytes(nc) == 0
        await transport.flush()
        for _ in range(100):
            if len(got) == 8:
                break
            await asyncio.sleep(0.01)
        assert got == [bytes([i]) * 4096 for i in range(8)]
    finally:
        await sub.unsubscribe()


async def test_a_large_message_reaches_the_parser_in_a_few_reads_and_whole(transport: NatsTransport) -> None:
    """nats-py alone feeds its parser 32 KB per turn of its read loop (32 turns for a 1 MB `Open`)."""
    nc = transport.nc
    size = min(1 << 20, transport.max_payload) - 4096
    payload = bytes(range(256)) * (size // 256)
    got: list[bytes] = []
    arrived = asyncio.Event()

    async def take(msg: Msg) -> None:
        got.append(msg.data)
        arrived.set()

    sub = await transport.subscribe("kvbus.test.natspy.large", take)
    await transport.flush()
    parses = 0
    parse = nc._ps.parse

    async def counting(data: bytes = b"") -> None:
        nonlocal parses
        parses += 1
        await parse(data)

    nc._ps.parse = counting
    try:
        await transport.publish_views("kvbus.test.natspy.large", [memoryview(payload)])
        await transport.flush()
        await asyncio.wait_for(arrived.wait(), 10)
    finally:
        nc._ps.parse = parse
        await sub.unsubscribe()
    assert got == [payload]
    assert parses <= 12, f"{parses} reads for one message of {size} bytes"
    assert nc._transport._io_reader._limit >= natspy.READ_BYTES
    assert natspy.install_large_reads(nc)  # again: already there, not wrapped twice
    assert natspy.install_large_reads(types.SimpleNamespace()) is False


@pytest.mark.parametrize("missing", [types.SimpleNamespace(), None], ids=["no-attributes", "none"])
def test_without_the_attributes_it_falls_back(missing: Any) -> None:
    assert natspy.server_info(missing) == {}
    assert natspy.connection_of(missing) is None
    assert not natspy.can_write_views(missing)
    assert not natspy.can_request_views(missing)
    assert natspy.pending_bytes(missing) == 0


async def test_a_transport_without_the_internals_joins_and_uses_nats_py_s_public_calls(
    transport: NatsTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As over a nats-py whose internals moved: publish_views and request_views still deliver."""
    monkeypatch.setattr(natspy, "can_write_views", lambda nc: False)

    async def echo(msg: Msg) -> None:
        await transport.reply(msg, msg.data)

    sub = await transport.subscribe("kvbus.test.natspy.public", echo)
    await transport.flush()
    try:
        assert not natspy.can_request_views(transport.nc)
        assert await transport.request_views("kvbus.test.natspy.public", [b"x", memoryview(b"yz")], 5) == b"xyz"
        assert natspy.pending_bytes(transport.nc) == 0
    finally:
        await sub.unsubscribe()
    monkeypatch.setattr(transport.nc, "_server_info", None)
    assert transport.uses_tls is False
