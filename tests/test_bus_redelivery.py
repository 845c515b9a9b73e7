"""Exactly once while a streamed transfer is being decoded (found by `kvbus bench chaos`), against a
real nats-server and a real scheduler: the sender, without its final ack for ``ack_timeout``, asks
the receiver where it stands (the same transfer id, a higher attempt) while the receiver is still
verifying and decoding the last chunk's payload. That transfer is then neither partial nor
completed; the receiver used to take the request for a new transfer, the sender resent its chunk,
and the context was delivered twice by one incarnation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvbus.bus import Bus, BusConfig, ReceiveTimeout
from kvbus.group_scheduler import GroupScheduler
from kvbus.protocol import Open, OpenReply
from tests.kvutil import kv_of_bytes
from tests.peer import SIG

#: Streamed (over the inline limit), and a short ack timeout: the sender asks where the receiver
#: stands soon after its last chunk went out (the chaos bench's setting).
CONFIG = BusConfig(
    chunk_size=256 * 1024,
    inline_limit=64 * 1024,
    ack_timeout=0.2,
    peer_timeout=10.0,
    request_timeout=2.0,
    grant_timeout=10.0,
)


@pytest.fixture
async def buses(nats_url: str, scheduler: GroupScheduler) -> AsyncIterator[tuple[Bus, Bus]]:
    """A sending and a receiving connection (as if two processes)."""
    tx_bus = await Bus.connect(nats_url, config=CONFIG)
    rx_bus = await Bus.connect(nats_url, config=CONFIG)
    try:
        yield tx_bus, rx_bus
    finally:
        await tx_bus.close()
        await rx_bus.close()


async def test_a_status_request_during_the_decode_does_not_deliver_the_transfer_twice(
    buses: tuple[Bus, Bus],
) -> None:
    """The receiver's decode is held until it has answered the sender's status request for that
    transfer: the answer says every chunk is in (no new transfer, nothing resent), and the
    context is delivered once."""
    tx_bus, rx_bus = buses
    tx = await tx_bus.agent(f"redeliver-tx-{time.monotonic_ns()}", signature=SIG)
    rx = await rx_bus.agent(f"redeliver-rx-{time.monotonic_ns()}", signature=SIG)
    receiver = rx._receiver
    gate, decode_started = asyncio.Event(), asyncio.Event()
    replies: list[tuple[Open, OpenReply]] = []
    chunks: list[int] = []
    decode, handle_open = receiver._decode, receiver._handle_open

    async def held_decode(open_msg: Open, *args: Any, **kwargs: Any) -> Any:
        chunks.append(open_msg.n_chunks)
        decode_started.set()
        await gate.wait()
        return await decode(open_msg, *args, **kwargs)

    async def watched_open(msg: Any) -> OpenReply:
        open_msg, _ = Open.unframe(msg.data)
        decoding = open_msg.attempt > 0 and decode_started.is_set() and not gate.is_set()
        reply = await handle_open(msg)
        if decoding:
            replies.append((open_msg, reply))
            gate.set()  # the sender asked where the receiver stands during the decode: let it go on
        return reply

    receiver._decode = held_decode  # type: ignore[method-assign]
    receiver._handle_open = watched_open  # type: ignore[method-assign]
    kv = kv_of_bytes(SIG, 200 * 1024, seed=21)
    report = await tx.send(rx.name, kv, medium="full")
    got = await rx.receive(timeout=10)
    assert got.transfer_id == report.transfer_id and got.kv.equal(kv)
    assert len(replies) == 1, "the sender never asked where the receiver stood during the decode"
    _, status = replies[0]
    assert status.ok and not status.done and status.next == chunks[0]  # every chunk is in: the verdict is coming
    with pytest.raises(ReceiveTimeout):
        await rx.receive(timeout=2.0)  # a second delivery of the same transfer would come here
    assert rx.partial_transfers == 0
