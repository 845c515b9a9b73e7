"""The direct paths against hostile peers (issue 31), with real sockets and a real nats-server:

- a receiver that announces a huge frame to its sender makes it allocate nothing: the sender
  drops the connection and the transfer goes on over NATS;
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from kvbus.bus import Bus
from kvbus.bus.paths import PathsConfig
from kvbus.bus.paths.frames import HEADER_SIZE, RECEIVER, FrameType, pack, unpack
from kvbus.group_scheduler import GroupScheduler
from tests.conftest import FAST
from tests.kvutil import kv_of_bytes
from tests.peer import SIG, kv_digest

MB = 1 << 20


def rss_mb() -> float:
    """This process's resident set, in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class GreedyReceiver:
    """A data listener that binds every stream it is asked to and then announces a DATA frame of
    ``announce`` bytes to the sender (which a sender never takes); it reads and drops the rest."""

    def __init__(self, announce: int) -> None:
        self.announce = announce
        self.bound = 0
        self.dropped = asyncio.Event()
        """The sender closed the connection."""
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> GreedyReceiver:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            frame = unpack(await reader.readexactly(HEADER_SIZE), "tcp", RECEIVER)
            await reader.readexactly(frame.length)
            writer.write(pack(FrameType.BOUND, frame.stream) + pack(FrameType.DATA, frame.stream, self.announce))
            await writer.drain()
            self.bound += 1
            while await reader.read(1 << 16):
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        self.dropped.set()
        writer.close()


@pytest.fixture
async def buses(nats_url: str, scheduler: GroupScheduler) -> AsyncIterator[tuple[Bus, Bus]]:
    """A sending and a receiving bus on ``tcp`` and ``nats`` (same host: no ``shm``, so ``tcp`` is tried first)."""
    paths = PathsConfig(allowed="tcp,nats", tcp_host="127.0.0.1")
    tx = await Bus.connect(nats_url, config=FAST, paths=paths)
    rx = await Bus.connect(nats_url, config=FAST, paths=paths)
    try:
        yield tx, rx
    finally:
        await tx.close()
        await rx.close()


# -- 1: a receiver cannot make its sender allocate ------------------------------------------------------


async def test_a_receiver_that_announces_a_gigabyte_makes_its_sender_allocate_nothing(buses: tuple[Bus, Bus]) -> None:
    tx_bus, rx_bus = buses
    rx = await rx_bus.agent(f"greedy-rx-{uuid.uuid4().hex[:6]}", signature=SIG)
    assert rx_bus.plane is not None and rx_bus.plane.tcp is not None and rx_bus.plane.tcp.listener is not None
    tx = await tx_bus.agent(f"greedy-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
    async with GreedyReceiver(announce=1 << 30) as greedy:
        # The receiver's offers name the greedy listener: what an addressee that answers its
        # Open with its own endpoint can do.
        rx_bus.plane.tcp.listener.port = greedy.port
        kv = kv_of_bytes(SIG, 4 * MB, seed=31)
        before = rss_mb()
        report = await asyncio.wait_for(tx.send(rx.name, kv, medium="full"), 30)
        grown = rss_mb() - before
        got = await rx.receive(timeout=10)
        await asyncio.wait_for(greedy.dropped.wait(), 5)
    assert greedy.bound == 1
    # The sender refused the header, dropped the connection and finished the transfer on NATS.
    assert report.paths == ("tcp", "nats") and report.path == "nats"
    assert got.transfer_id == report.transfer_id and kv_digest(got.kv) == kv_digest(kv)
    assert grown < 64, f"the sender's RSS grew by {grown:.0f} MB"
