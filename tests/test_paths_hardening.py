"""The direct paths against hostile peers (issue 31), with real sockets and a real nats-server:

- a receiver that announces a huge frame to its sender makes it allocate nothing: the sender
  drops the connection and the transfer goes on over NATS;
- the data port listens where it is advertised (or where the configuration says), on no other
  interface;
- 1,100 connections that never bind cost the receiver a few hundred bytes each, at most 64 of
  them (32 per address) are kept, a sender still gets through, and a slowloris is closed at its
  deadline;
- a receiver that holds shm deliveries holds their mappings and not one descriptor.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvbus.bus import Bus
from kvbus.bus.paths import DataPlane, PathsConfig
from kvbus.bus.paths.frames import HEADER_SIZE, RECEIVER, FrameType, pack, unpack
from kvbus.bus.paths.shm import Segment
from kvbus.bus.paths.shm_server import map_fd
from kvbus.errors import ConfigError
from kvbus.group_scheduler import GroupScheduler
from tests.conftest import FAST
from tests.kvutil import kv_of_bytes
from tests.peer import SIG, kv_digest
from tests.test_paths import Peer, agent_pki, transfer

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


# -- 3: the data port listens where it is advertised ---------------------------------------------------


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


async def test_the_data_port_listens_only_where_it_is_advertised(
    nats_url: str, scheduler: GroupScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As the chart and the testbed configure a pod: only the advertised address is set.
    monkeypatch.setenv("KVBUS_PATHS_ADVERTISE_HOST", "127.0.0.3")
    monkeypatch.setenv("KVBUS_PATHS_ALLOWED", "tcp,nats")
    rx_bus = await Bus.connect(nats_url, config=FAST)
    tx_bus = await Bus.connect(nats_url, config=FAST, paths=PathsConfig(allowed="tcp,nats", tcp_host="127.0.0.1"))
    try:
        rx = await rx_bus.agent(f"bind-rx-{uuid.uuid4().hex[:6]}", signature=SIG)
        tx = await tx_bus.agent(f"bind-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
        plane = rx_bus.plane
        assert plane is not None and plane.tcp is not None and plane.tcp.endpoint is not None
        host, port = plane.tcp.endpoint
        assert host == "127.0.0.3"
        assert plane.tcp.listener is not None and plane.tcp.listener.host == "127.0.0.3"
        # Another address of this machine (loopback, and any other interface) finds nothing there.
        assert _refused("127.0.0.1", port) and _refused("127.0.0.2", port)
        # The advertised one works, for a transfer too.
        kv = kv_of_bytes(SIG, 4 * MB, seed=33)
        report = await tx.send(rx.name, kv, medium="full")
        got = await rx.receive(timeout=10)
        assert report.path == "tcp" and kv_digest(got.kv) == kv_digest(kv)
    finally:
        await tx_bus.close()
        await rx_bus.close()


@pytest.mark.parametrize(
    ("config", "bound"),
    [
        (PathsConfig(allowed="tcp"), None),  # nothing set: where it is advertised (this host's address)
        (PathsConfig(allowed="tcp", tcp_host="127.0.0.4"), "127.0.0.4"),
        (PathsConfig(allowed="tcp", tcp_host="0.0.0.0", advertise_host="127.0.0.5"), "0.0.0.0"),  # on purpose
    ],
    ids=["default", "tcp-host", "every-interface"],
)
async def test_the_data_port_binds_the_configured_address_else_the_advertised_one(
    config: PathsConfig, bound: str | None
) -> None:
    plane = DataPlane(None, config=config)
    await plane.start()
    try:
        assert plane.tcp is not None and plane.tcp.listener is not None and plane.tcp.endpoint is not None
        advertised, _ = plane.tcp.endpoint
        server = plane.tcp.listener._server
        assert server is not None
        names = {s.getsockname()[0] for s in server.sockets}
        assert names == {bound or advertised}
        assert advertised not in ("", "0.0.0.0", "::")
    finally:
        await plane.close()


async def test_an_advertised_address_of_another_machine_is_a_config_error() -> None:
    plane = DataPlane(None, config=PathsConfig(allowed="tcp", advertise_host="192.0.2.77"))
    with pytest.raises(ConfigError, match="paths.tcp_host"):
        await plane.start()
    await plane.close()


# -- 2: strangers on the data port cost (almost) nothing ----------------------------------------------


async def _connect_from(source: str, host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.bind((source, 0))
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except OSError:
        pass  # turned away already: what the receiver's books say is what counts
    return sock


async def _books(rx: Peer, attempts: int) -> dict[str, Any]:
    """The receiver's status once its listener took or turned away ``attempts`` connections."""
    for _ in range(600):
        status = await rx.status()
        if status["tcp_accepted"] + status["tcp_refused"] >= attempts:
            return status
    raise AssertionError(f"the listener saw fewer than {attempts} connections: {status}")


async def test_eleven_hundred_strangers_cost_the_receiver_little_and_a_sender_still_gets_through() -> None:
    rx = await Peer.paths("rx", "--paths", "tcp", "--bind-deadline", "60")
    tx = await Peer.paths("tx", "--paths", "tcp")
    socks: list[socket.socket] = []
    try:
        assert rx.tcp is not None
        host, port = rx.tcp
        before = await rx.status()
        # 100 idle connections from one address (over the per-source cap), then 1,000 from 40
        # others (over the total cap), and 30 that trickle a header a byte at a time.
        sources = ["127.0.0.1"] * 100 + [f"127.0.1.{i % 40 + 1}" for i in range(1000)]
        for source in sources:
            socks.append(await _connect_from(source, host, port))
        trickle = [await _connect_from(f"127.0.2.{i + 1}", host, port) for i in range(30)]
        socks += trickle
        for sock in trickle:
            sock.send(pack(FrameType.BIND, 1, 40)[:1])
        after = await _books(rx, len(socks))
        grown_mb = (after["rss_kb"] - before["rss_kb"]) / 1024
        print(f"{len(socks)} pre-BIND connections: receiver RSS +{grown_mb:.1f} MB; books {after}")
        assert grown_mb < 64, f"{len(socks)} pre-BIND connections grew the receiver by {grown_mb:.0f} MB"
        # The listener's own books: the caps hold, and an unbound connection holds a header's worth.
        assert after["tcp_unbound"] == 64
        assert all(n <= 32 for n in after["tcp_unbound_by_source"].values())
        assert after["tcp_accepted"] - after["tcp_evicted"] == 64
        assert after["tcp_refused"] >= 68  # 100 - 32 from 127.0.0.1 at least
        assert 0 < after["tcp_unbound_max_buffer"] <= 256
        # A sender still binds: the stranger that waited longest makes room.
        _, sent, done = await transfer(rx, tx, ["tcp"], total=8 * MB)
        assert sent["path"] == "tcp" and done["digest"] == sent["digest"] and done["via"] == ["tcp"]
    finally:
        for sock in socks:
            sock.close()
        await tx.stop()
        await rx.stop()


async def test_a_connection_that_does_not_bind_in_time_is_closed() -> None:
    rx = await Peer.paths("rx", "--paths", "tcp", "--bind-deadline", "1")
    try:
        assert rx.tcp is not None
        host, port = rx.tcp
        loop = asyncio.get_running_loop()
        sock = await _connect_from("127.0.0.1", host, port)
        header = pack(FrameType.BIND, 1, 40)
        closed = False
        started = loop.time()
        for i in range(len(header)):  # slowloris: a byte every 0.2 s, never a whole BIND
            try:
                sock.send(header[i : i + 1])
                await asyncio.sleep(0.2)
                if await asyncio.wait_for(loop.sock_recv(sock, 1), 0.01) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        took = loop.time() - started
        sock.close()
        assert closed and took < 5, f"closed={closed} after {took:.1f} s"
        status = await rx.status()
        assert status["tcp_unbound"] == 0
    finally:
        await rx.stop()


async def test_tls_handshakes_in_progress_count_against_the_caps_and_a_sender_still_gets_through(
    tmp_path: Path,
) -> None:
    ca, agent, key, _ = agent_pki(tmp_path)
    tls = ("--tls-ca", str(ca), "--tls-cert", str(agent), "--tls-key", str(key))
    rx = await Peer.paths("rx", "--paths", "tcp", "--bind-deadline", "60", *tls)
    tx = await Peer.paths("tx", "--paths", "tcp", *tls)
    socks: list[socket.socket] = []
    try:
        assert rx.tcp is not None
        host, port = rx.tcp
        before = await rx.status()
        # Strangers that connect and never say a word of TLS (each would hold asyncio's TLS buffer).
        for i in range(1100):
            socks.append(await _connect_from(f"127.0.3.{i % 10 + 1}", host, port))
        after = await _books(rx, len(socks))
        assert after["tcp_unbound"] == 64 and after["tcp_accepted"] - after["tcp_evicted"] == 64
        grown_mb = (after["rss_kb"] - before["rss_kb"]) / 1024
        print(f"{len(socks)} TLS strangers: receiver RSS +{grown_mb:.1f} MB")
        assert grown_mb < 64
        _, sent, done = await transfer(rx, tx, ["tcp"], total=4 * MB)
        assert sent["path"] == "tcp" and done["digest"] == sent["digest"]
    finally:
        for sock in socks:
            sock.close()
        await tx.stop()
        await rx.stop()


# -- 8: held shm deliveries hold no descriptors -------------------------------------------------------


def memfd_descriptors(pid: int) -> int:
    """Descriptors of process ``pid`` that are shared segments."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += "memfd:" in os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    return n


async def test_held_shm_deliveries_hold_mappings_and_no_descriptors() -> None:
    rx = await Peer.paths("rx", "--paths", "shm")
    tx = await Peer.paths("tx", "--paths", "shm")
    try:
        held = 6
        fds_before = len(os.listdir(f"/proc/{rx.pid}/fd"))
        digests = set()
        for _ in range(held):  # the receiver keeps every chunk view: the deliveries are held
            _, sent, done = await transfer(rx, tx, ["shm"], total=4 * MB)
            assert done["via"] == ["shm"] and done["digest"] == sent["digest"]
            digests.add(done["digest"])
        status = await rx.status()
        fds_after = len(os.listdir(f"/proc/{rx.pid}/fd"))
        print(f"{held} held shm deliveries: receiver fds {fds_before} -> {fds_after}, {status}")
        assert status["sinks"] == held and status["memfd_maps"] >= held  # still mapped...
        assert status["memfd_fds"] == 0 and memfd_descriptors(rx.pid) == 0  # ...without a descriptor
        assert fds_after - fds_before <= 1  # the one connection from the sender
        # Each segment the sender made holds one descriptor there (the one it passes), no more.
        assert memfd_descriptors(tx.pid) <= held
    finally:
        await tx.stop()
        await rx.stop()


def test_a_mapping_without_a_descriptor_behaves_as_mmap_does() -> None:
    seg = Segment(MB)
    try:
        seg.view[:5] = b"hello"
        before = memfd_descriptors(os.getpid())
        private = map_fd(seg.fd, MB, shared=False, writable=True)
        shared = map_fd(seg.fd, MB, shared=True, writable=False)
        assert memfd_descriptors(os.getpid()) == before  # neither holds a descriptor
        assert len(private) == len(shared) == MB and bytes(shared[:5]) == bytes(private[:5]) == b"hello"
        private[:5] = b"HELLO"  # copy-on-write: the segment keeps its bytes
        assert bytes(seg.view[:5]) == bytes(shared[:5]) == b"hello"
        seg.view[5:10] = b"world"  # shared: the receiver sees what is in the segment
        assert bytes(shared[5:10]) == b"world"
        with pytest.raises(TypeError):
            shared[:1] = b"x"
        assert memoryview(shared).readonly and not memoryview(private).readonly
        with open("/proc/self/maps") as f:
            mapped = sum("memfd:" in line for line in f)
        private.close()
        shared.close()
        with open("/proc/self/maps") as f:
            assert sum("memfd:" in line for line in f) == mapped - 2  # unmapped on close
        with pytest.raises(OSError):
            map_fd(-1, MB, shared=True, writable=False)  # no descriptor: the kernel refuses
    finally:
        seg.close()
