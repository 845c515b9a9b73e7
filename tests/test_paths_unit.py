"""The data paths' pieces in one process: frame and offer decoders under hostile input, tokens,
the receivers' rules (no byte over a verified chunk, superseded streams write nothing, bad
frames close the connection), control messages, segment reuse, and the zero-copy NATS publish
(reconnect buffering included) against a real nats-server."""

from __future__ import annotations

import array
import asyncio
import fcntl
import math
import os
import socket
import struct
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbus.app.local import NatsServer
from kvbus.bus.pacing import TokenBucket
from kvbus.bus.paths import (
    Claim,
    DataPlane,
    PathBroken,
    PathProtocolError,
    PathsConfig,
    PathUnavailable,
    Segment,
    TokenTable,
    TransferSpec,
    chunk_digest,
)
from kvbus.bus.paths.direct import SO_MAX_PACING_RATE, UNPACED
from kvbus.bus.paths.frames import (
    HEADER_SIZE,
    MAX_CTRL,
    RECEIVER,
    SENDER,
    FrameType,
    Side,
    bind_payload,
    pack,
    parse_bind,
    unpack,
)
from kvbus.bus.paths.tcp import WIRE_OVERHEAD
from kvbus.errors import ConfigError, WireFormatError
from kvbus.net.transport import MAX_NATS_CHUNK, NatsTransport
from kvbus.protocol import Open, OpenReply, PathName, PathOffer

CI = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MB = 1 << 20
HOST = "a" * 32
TOKEN = "b" * 64


# -- decoders of wire input -------------------------------------------------------------------------


@CI
@given(data=st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE), side=st.sampled_from([RECEIVER, SENDER]))
def test_frame_headers_decode_or_raise_a_protocol_error(data: bytes, side: Side) -> None:
    try:
        frame = unpack(data, "tcp", side)
    except PathProtocolError:
        return
    assert frame.type in side.limits and frame.length <= side.limits[frame.type] and frame.flags & ~3 == 0
    assert frame.length <= 1 << 32


@CI
@given(
    kind=st.sampled_from(list(FrameType)),
    length=st.one_of(st.integers(0, 2 * MAX_CTRL), st.integers(0, 2**64 - 1)),
)
def test_a_sender_takes_no_frame_that_announces_more_than_a_control_message(kind: FrameType, length: int) -> None:
    header = pack(kind, 1, length)
    if kind in SENDER.limits and length <= SENDER.limits[kind]:
        assert unpack(header, "tcp", SENDER).length == length
        return
    with pytest.raises(PathProtocolError) as err:
        unpack(header, "tcp", SENDER)
    assert kind.name in err.value.detail
    assert length > MAX_CTRL or kind is not FrameType.CTRL


@CI
@given(
    kind=st.sampled_from(list(FrameType)),
    stream=st.integers(0, 2**32 - 1),
    index=st.integers(0, 2**32 - 1),
    digest=st.integers(0, 2**64 - 1),
    root=st.sampled_from(["", "ab" * 16]),
)
def test_frame_headers_round_trip(kind: FrameType, stream: int, index: int, digest: int, root: str) -> None:
    side = RECEIVER if kind in RECEIVER.limits else SENDER
    frame = unpack(pack(kind, stream, 0, index=index, digest=digest, root=root), "shm", side)
    assert (frame.type, frame.stream, frame.index, frame.digest, frame.root_hex) == (kind, stream, index, digest, root)


@CI
@given(data=st.binary(max_size=200))
def test_bind_payloads_parse_or_raise_a_protocol_error(data: bytes) -> None:
    try:
        token, tid = parse_bind(data, "tcp")
    except PathProtocolError:
        return
    assert len(token) == 32 and tid.isascii()


_FIELD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=80),
    st.sampled_from(["127.0.0.1", HOST, TOKEN, "shm-x", "tcp"]),
    st.lists(st.sampled_from(["shm", "tcp", "nats", "udp", 3]), max_size=4),
)


@CI
@given(
    fields=st.dictionaries(
        st.sampled_from(["host", "shm", "tcp_host", "tcp_port", "tls", "token", "token_ttl_s", "paths"]),
        _FIELD_VALUES,
        max_size=8,
    )
)
def test_open_replies_with_any_path_fields_decode_or_raise_a_wire_error(fields: dict[str, Any]) -> None:
    body = {"t": "open_reply", "v": 1, "transfer_id": "t", "ok": True, **fields}
    try:
        reply = OpenReply.decode(msgpack.packb(body))
    except WireFormatError:
        return
    offer = reply.offer
    if offer is not None:
        assert 0 < offer.token_ttl_s <= 3600 and math.isfinite(offer.token_ttl_s)
        assert not offer.tcp_host or 1 <= offer.tcp_port <= 65535


@pytest.mark.parametrize(
    "fields",
    [
        {"tcp_host": "127.0.0.1", "tcp_port": 0},
        {"tcp_host": "127.0.0.1", "tcp_port": 70000},
        {"tcp_host": "127.0.0.1", "tcp_port": 5, "token_ttl_s": float("nan")},
        {"tcp_host": "127.0.0.1", "tcp_port": 5, "token_ttl_s": float("inf")},
        {"tcp_host": "127.0.0.1", "tcp_port": 5, "token_ttl_s": -1.0},
        {"tcp_host": "127.0.0.1", "tcp_port": 5, "token": "xyz"},
        {"tcp_host": "bad host", "tcp_port": 5},
        {"shm": "no/slash"},
        {"tcp_port": 5},
        {},
    ],
)
def test_malformed_offers_are_refused(fields: dict[str, Any]) -> None:
    values = {"host": HOST, "token": TOKEN, "token_ttl_s": 30.0, **fields}
    with pytest.raises(WireFormatError):
        PathOffer(**values)
    with pytest.raises(WireFormatError):
        OpenReply.decode(msgpack.packb({"t": "open_reply", "v": 1, "transfer_id": "t", "ok": True, **values}))


def test_offers_round_trip_through_the_reply_and_never_show_the_token() -> None:
    offer = PathOffer(host=HOST, token=TOKEN, shm="kvbus-shm-1", tcp_host="10.0.0.7", tcp_port=7000, tls=True)
    reply = OpenReply.decode(OpenReply("t", True, paths=["shm", "tcp", "nats"], **offer.reply_fields()).encode())
    assert reply.offer == offer and offer.paths == ("shm", "tcp") and reply.paths == ["shm", "tcp", "nats"]
    assert TOKEN not in repr(offer)
    assert OpenReply.decode(OpenReply("t", True).encode()).offer is None  # an older receiver: no offer


@pytest.mark.parametrize("paths, host", [(["udp"], ""), (["tcp", "tcp"], ""), (["shm"], "XYZ"), ("tcp", "")])
def test_opens_with_bad_path_fields_are_refused(paths: Any, host: str) -> None:
    msg = Open("t", "a", "full", {}, [1], 1, 1024, 1, "0" * 32, 4, "d", "a", paths=paths, host=host)
    with pytest.raises(WireFormatError):
        Open.unframe(msg.frame())


def test_transfer_specs_need_contiguous_ranges() -> None:
    assert TransferSpec.of("t", "a", "b", [(0, 3), (3, 5)]).total == 5
    for bad in ([(1, 3)], [(0, 3), (4, 5)], [(0, 0)]):
        with pytest.raises(ValueError):
            TransferSpec.of("t", "a", "b", bad)


def test_tokens_work_once_for_their_transfer_until_they_expire() -> None:
    now = [0.0]
    table = TokenTable(clock=lambda: now[0])
    token = bytes.fromhex(table.issue("t1", ttl=5.0))
    assert table.claim("t2", token) is Claim.UNKNOWN
    assert table.claim("t1", bytes(32)) is Claim.WRONG
    assert table.claim("t1", token[:5]) is Claim.WRONG
    assert table.claim("t1", token) is Claim.OK  # a wrong try did not burn it
    assert table.claim("t1", token) is Claim.REPLAYED
    fresh = bytes.fromhex(table.issue("t1", ttl=5.0))
    assert table.claim("t1", token) is Claim.WRONG  # the new token replaced the old
    now[0] = 6.0
    assert table.claim("t1", fresh) is Claim.EXPIRED
    table.revoke("t1")
    assert table.claim("t1", fresh) is Claim.UNKNOWN and len(table) == 0


def test_the_allowed_paths_come_from_config_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBUS_PATHS_ALLOWED", "nats")
    assert PathsConfig.from_env().allowed_paths == ("nats",)
    plane = DataPlane(None, config=PathsConfig.from_env(), receive=False)
    assert plane.paths == [] and plane.open_fields()["paths"] == []
    assert PathsConfig(allowed="nats, TCP").allowed_paths == ("tcp", "nats")
    for bad in ("udp", "", " , "):
        with pytest.raises(ConfigError):
            PathsConfig(allowed=bad)
    with pytest.raises(ConfigError):
        PathsConfig(token_ttl_s=float("nan"))


# -- receivers' rules, in one process --------------------------------------------------------------


class Sink:
    def __init__(self) -> None:
        self.arrived: dict[int, memoryview] = {}
        self.corrupt: list[int] = []
        self.opened: list[Any] = []
        self.lost: list[Any] = []
        self.event = asyncio.Event()

    def chunk_arrived(self, index: int, data: memoryview, digest: str, root: str) -> None:
        self.arrived.setdefault(index, data)
        self.event.set()

    def chunk_corrupt(self, index: int, path: PathName) -> None:
        self.corrupt.append(index)
        self.event.set()

    def path_opened(self, session: Any) -> None:
        self.opened.append(session)

    def path_lost(self, session: Any, error: Any) -> None:
        self.lost.append(error)
        self.event.set()

    async def until(self, cond: Any, timeout: float = 10.0) -> None:
        async def loop() -> None:
            while not cond():
                self.event.clear()
                await self.event.wait()

        await asyncio.wait_for(loop(), timeout)


@pytest.fixture
async def planes() -> AsyncIterator[tuple[DataPlane, DataPlane]]:
    config = PathsConfig(allowed="shm,tcp", tcp_host="127.0.0.1", connect_timeout_s=2.0)
    rx = DataPlane(None, config=config)
    tx = DataPlane(None, config=config, receive=False)
    await rx.start()
    await tx.start()
    try:
        yield rx, tx
    finally:
        await tx.close()
        await rx.close()


def _spec(n: int = 4, size: int = 64 * 1024) -> TransferSpec:
    return TransferSpec.of(uuid.uuid4().hex, "tx", "rx", [(i * size, (i + 1) * size) for i in range(n)])


async def _stream(port: int, token: str, tid: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = bind_payload(token, tid)
    writer.write(pack(FrameType.BIND, 1, len(payload)) + payload)
    header = unpack(await reader.readexactly(HEADER_SIZE), "tcp", SENDER)
    assert header.type is FrameType.BOUND
    return reader, writer


def _data(stream: int, index: int, data: bytes, digest: int | None = None) -> bytes:
    value = xxhash.xxh3_64_intdigest(data) if digest is None else digest
    return pack(FrameType.DATA, stream, len(data), index=index, digest=value) + data


async def test_a_corrupt_chunk_is_reported_and_a_repair_is_taken(planes: tuple[DataPlane, DataPlane]) -> None:
    rx, _ = planes
    spec, sink = _spec(), Sink()
    offer = await rx.accept(spec, sink, peer_paths=["tcp"], peer_host=rx.host)
    assert offer is not None
    _reader, writer = await _stream(offer.tcp_port, offer.token, spec.transfer_id)
    good = os.urandom(spec.chunk_len(0))
    writer.write(_data(1, 0, good, digest=xxhash.xxh3_64_intdigest(good) ^ 1))
    await sink.until(lambda: sink.corrupt)
    assert sink.corrupt == [0] and not sink.arrived
    writer.write(_data(1, 0, good))
    await sink.until(lambda: 0 in sink.arrived)
    assert bytes(sink.arrived[0]) == good
    writer.close()


async def test_a_chunk_already_verified_is_never_written_over(planes: tuple[DataPlane, DataPlane]) -> None:
    rx, _ = planes
    spec, sink = _spec(), Sink()
    offer = await rx.accept(spec, sink, peer_paths=["tcp"], peer_host=rx.host)
    assert offer is not None
    _reader, writer = await _stream(offer.tcp_port, offer.token, spec.transfer_id)
    first, other = os.urandom(spec.chunk_len(1)), os.urandom(spec.chunk_len(1))
    writer.write(_data(1, 1, first) + _data(1, 1, other) + _data(1, 2, first))
    await sink.until(lambda: 2 in sink.arrived)
    # The second copy of chunk 1 (valid digest of other bytes) was read and dropped.
    assert bytes(sink.arrived[1]) == first and not sink.corrupt
    writer.close()


async def test_a_superseded_stream_writes_nothing_more(planes: tuple[DataPlane, DataPlane]) -> None:
    rx, _ = planes
    spec, sink = _spec(), Sink()
    offer = await rx.accept(spec, sink, peer_paths=["tcp"], peer_host=rx.host)
    assert offer is not None
    _, old = await _stream(offer.tcp_port, offer.token, spec.transfer_id)
    again = rx.reoffer(spec.transfer_id)  # the sender re-sent its Open: a new token
    assert again is not None and again.token != offer.token
    _, new = await _stream(again.tcp_port, again.token, spec.transfer_id)
    stale = os.urandom(spec.chunk_len(0))
    old.write(_data(1, 0, stale))
    fresh = os.urandom(spec.chunk_len(3))
    new.write(_data(1, 3, fresh))
    await sink.until(lambda: 3 in sink.arrived)
    await asyncio.sleep(0.1)
    assert list(sink.arrived) == [3]  # nothing from the old stream
    old.close()
    new.close()


@pytest.mark.parametrize("bad", ["unbound", "length", "index", "bind-twice"])
async def test_bad_frames_close_the_connection(planes: tuple[DataPlane, DataPlane], bad: str) -> None:
    rx, _ = planes
    spec, sink = _spec(), Sink()
    offer = await rx.accept(spec, sink, peer_paths=["tcp"], peer_host=rx.host)
    assert offer is not None
    reader, writer = await _stream(offer.tcp_port, offer.token, spec.transfer_id)
    frame = {
        "unbound": _data(9, 0, b"x" * spec.chunk_len(0)),
        "length": _data(1, 0, b"x" * 10),
        "index": _data(1, 99, b"x" * spec.chunk_len(0)),
        "bind-twice": pack(FrameType.BIND, 1, 40) + bind_payload(TOKEN, "t-xxxxxx"),
    }[bad]
    writer.write(frame)
    try:
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed
    except ConnectionResetError:
        pass  # closed (aborted: a reset)
    await sink.until(lambda: sink.lost)
    assert isinstance(sink.lost[0], PathBroken) and not sink.arrived
    writer.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
async def test_control_messages_flow_back_to_the_sender(planes: tuple[DataPlane, DataPlane], kind: str) -> None:
    rx, tx = planes
    spec, sink = _spec(), Sink()
    offer = await rx.accept(spec, sink, peer_paths=[kind], peer_host=tx.host)
    got: list[bytes] = []
    session = await tx.connect(spec, [kind], offer, on_control=got.append)
    assert session.kind.value == kind
    data = os.urandom(spec.chunk_len(0))
    await session.send_chunk(0, [memoryview(data)], chunk_digest(data))
    await sink.until(lambda: 0 in sink.arrived)
    await sink.opened[0].send_control(b"ack 1")
    for _ in range(100):
        if got:
            break
        await asyncio.sleep(0.02)
    assert got == [b"ack 1"] and bytes(sink.arrived[0]) == data
    await session.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
async def test_concurrent_transfers_to_one_receiver_share_one_connection(
    planes: tuple[DataPlane, DataPlane], kind: str
) -> None:
    """The direct paths' pool (`DirectPath`): opens racing to one endpoint dial it once, and the
    receiver sees one connection carrying every transfer as a stream; a closed path forgets it."""
    rx, tx = planes
    specs, sinks = [_spec() for _ in range(4)], [Sink() for _ in range(4)]
    offers = [await rx.accept(s, k, peer_paths=[kind], peer_host=tx.host) for s, k in zip(specs, sinks, strict=True)]
    sessions = await asyncio.gather(*(tx.connect(s, [kind], o) for s, o in zip(specs, offers, strict=True)))
    path, listener = (tx.tcp, rx.tcp) if kind == "tcp" else (tx.shm, rx.shm)
    assert path is not None and listener is not None and listener.listener is not None
    assert path.connections == 1 and listener.listener.accepted == 1
    assert len({s.stream for s in sessions}) == 4  # one stream each
    for spec, session, sink in zip(specs, sessions, sinks, strict=True):
        data = os.urandom(spec.chunk_len(0))
        await session.send_chunk(0, [memoryview(data)], chunk_digest(data))
        await sink.until(lambda sink=sink: 0 in sink.arrived)
        assert bytes(sink.arrived[0]) == data and sink.opened[0].kind.value == kind
        await session.close()
    await path.close()
    assert path.connections == 0


async def test_shm_segments_are_reused_once_the_receiver_lets_go(planes: tuple[DataPlane, DataPlane]) -> None:
    rx, tx = planes
    assert tx.shm is not None
    for round_ in range(2):
        spec, sink = _spec(n=2, size=MB), Sink()
        offer = await rx.accept(spec, sink, peer_paths=["shm"], peer_host=tx.host)
        seg = tx.segment(spec.total)
        assert seg is not None
        seg.view[:] = os.urandom(spec.total)  # "encode" straight into the shared segment
        session = await tx.connect(spec, ["shm"], offer, segment=seg)
        assert session.segment is not None
        for i, (lo, hi) in enumerate(spec.ranges):
            await session.send_chunk(i, [seg.view[lo:hi]], chunk_digest(seg.view[lo:hi]))
        await sink.until(lambda s=sink: len(s.arrived) == 2)
        assert bytes(sink.arrived[1]) == bytes(seg.view[MB:])
        await session.close()
        await rx.withdraw(spec.transfer_id)
        del sink  # the receiver drops its views: the mapping goes and it tells the sender
        if round_ == 0:
            # A segment the caller passed stays the caller's; one the session took goes to the pool.
            spec2, sink2 = _spec(n=1, size=MB), Sink()
            offer2 = await rx.accept(spec2, sink2, peer_paths=["shm"], peer_host=tx.host)
            s2 = await tx.connect(spec2, ["shm"], offer2)
            data = os.urandom(MB)
            await s2.send_chunk(0, [memoryview(data)], chunk_digest(data))
            await sink2.until(lambda s=sink2: 0 in s.arrived)
            await s2.close()
            await rx.withdraw(spec2.transfer_id)
            del sink2
            for _ in range(100):
                if tx.shm.pool.free_bytes:
                    break
                await asyncio.sleep(0.02)
            assert tx.shm.pool.free_bytes == MB
            assert tx.segment(MB) is not None and tx.shm.pool.free_bytes == 0  # taken again


_WRITER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
out = []
try:
    os.pwrite(fd, b"forged", 0)
    out.append("write went through")
except PermissionError:
    out.append("write refused")
try:
    m = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    m[:6] = b"forged"
    out.append("mapping went through")
except PermissionError:
    out.append("mapping refused")
print(";".join(out))
"""


async def test_no_other_process_can_change_what_a_receiver_verified_on_shm(planes: tuple[DataPlane, DataPlane]) -> None:
    # Red team (issue 34): another process of the same user opened the sender's segment through
    # /proc/<pid>/fd after the receiver verified it and wrote into it: the send had succeeded and
    # the delivery the receiver held (a view of the segment) changed under it. Segments are now
    # sealed against every write access but the sender's own mapping, before a byte is written.
    rx, tx = planes
    spec, sink = _spec(n=1, size=MB), Sink()
    offer = await rx.accept(spec, sink, peer_paths=["shm"], peer_host=tx.host)
    seg = tx.segment(spec.total)
    assert seg is not None
    data = os.urandom(MB)
    seg.view[:] = data
    session = await tx.connect(spec, ["shm"], offer, segment=seg)
    await session.send_chunk(0, [seg.view[:]], chunk_digest(data))
    await sink.until(lambda: 0 in sink.arrived)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _WRITER, f"/proc/{os.getpid()}/fd/{seg.fd}", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    assert out.decode().strip() == "write refused;mapping refused"
    assert bytes(sink.arrived[0]) == data  # the held delivery is what was verified
    seals = fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & 0x0010  # F_SEAL_FUTURE_WRITE
    await session.close()
    await rx.withdraw(spec.transfer_id)


@pytest.mark.parametrize("inline_bytes", [0, 1 << 40], ids=["worker-threads", "event-loop"])
async def test_shm_verifies_a_batch_of_chunks_in_order_and_reports_the_corrupt_one(
    planes: tuple[DataPlane, DataPlane], inline_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvbus.bus.paths import shm_server

    monkeypatch.setattr(shm_server, "INLINE_CHECK_BYTES", inline_bytes)  # 0: every batch goes to threads
    rx, tx = planes
    spec, sink = _spec(n=12, size=256 * 1024), Sink()
    offer = await rx.accept(spec, sink, peer_paths=["shm"], peer_host=tx.host)
    seg = tx.segment(spec.total)
    assert seg is not None
    seg.view[:] = os.urandom(spec.total)
    session = await tx.connect(spec, ["shm"], offer, segment=seg)
    bad = 7
    for i, (lo, hi) in enumerate(spec.ranges):  # all twelve headers at once: one or more batches
        digest = chunk_digest(seg.view[lo:hi])
        await session.send_chunk(i, [seg.view[lo:hi]], digest if i != bad else f"{int(digest, 16) ^ 1:016x}")
    await session.close()  # its END comes right behind the DATA frames: they still count
    await sink.until(lambda: len(sink.arrived) == spec.n_chunks - 1 and sink.corrupt)
    assert sink.corrupt == [bad]
    assert list(sink.arrived) == [i for i in range(spec.n_chunks) if i != bad]  # in the order they came
    for i, (lo, hi) in enumerate(spec.ranges):
        if i != bad:
            assert bytes(sink.arrived[i]) == bytes(seg.view[lo:hi])
    await rx.withdraw(spec.transfer_id)


async def test_shm_refuses_a_segment_that_is_not_sealed_or_too_small(planes: tuple[DataPlane, DataPlane]) -> None:
    rx, _ = planes
    assert rx.shm is not None
    size_seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    # unsealed; sealed but too small; sealed against resizing but open to writes by anyone
    for size, seal in ((MB, 0), (MB // 2, size_seals | 0x0010), (MB, size_seals)):
        spec, sink = _spec(n=1, size=MB), Sink()
        offer = await rx.accept(spec, sink, peer_paths=["shm"], peer_host=rx.host)
        assert offer is not None
        fd = os.memfd_create("probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        if seal:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seal)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(s, "\0" + offer.shm)
        payload = bind_payload(offer.token, spec.transfer_id)
        s.sendmsg(
            [pack(FrameType.BIND, 1, len(payload)) + payload],
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())],
        )
        os.close(fd)
        reply = await asyncio.wait_for(loop.sock_recv(s, 1024), 5)
        assert unpack(reply, "shm", SENDER).type is FrameType.REFUSED and not sink.opened
        s.close()


async def test_connect_falls_back_when_a_direct_path_is_refused(planes: tuple[DataPlane, DataPlane]) -> None:
    rx, tx = planes
    spec, sink = _spec(), Sink()
    offer = await rx.accept(spec, sink, peer_paths=["shm", "tcp"], peer_host=tx.host)
    assert offer is not None
    await rx.withdraw(spec.transfer_id)  # the token stops working on both paths
    with pytest.raises(PathUnavailable, match="no data path could be opened"):  # closed: strangers learn nothing
        await tx.connect(spec, ["shm", "tcp"], offer)
    spec2, sink2 = _spec(), Sink()
    offer2 = await rx.accept(spec2, sink2, peer_paths=["shm", "tcp"], peer_host=tx.host)
    session = await tx.connect(spec2, ["shm", "tcp"], offer2, exclude=[PathName.SHM])
    assert session.kind is PathName.TCP
    await session.close()


def test_segments_are_anonymous_and_sealed() -> None:
    seg = Segment(MB)
    try:
        assert os.readlink(f"/proc/self/fd/{seg.fd}").startswith("/memfd:")
        seals = fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
        with pytest.raises(OSError):
            os.ftruncate(seg.fd, 10)
        t = seg.tensor(16, 8)
        t.fill_(7)
        assert bytes(seg.view[16:24]) == b"\x07" * 8
    finally:
        seg.close()


# -- zero-copy publish on NATS ------------------------------------------------------------------------


async def test_publish_views_delivers_pieces_and_headers_and_checks_limits(nats_url: str) -> None:
    tx, rx = await NatsTransport.connect(nats_url), await NatsTransport.connect(nats_url)
    try:
        assert tx.max_chunk_size() == min(MAX_NATS_CHUNK, tx.max_payload - 4096)
        got: list[Any] = []
        await rx.subscribe("kvbus.test.views", _appender(got))
        await rx.flush()
        a, b = os.urandom(3 * MB), os.urandom(2 * MB + 5)
        await tx.publish_views("kvbus.test.views", [memoryview(a), memoryview(b)], headers={"Kvbus-Chunk": "3"})
        await tx.publish_views("kvbus.test.views", [b"", memoryview(a)[:7]])
        await tx.flush()
        for _ in range(200):
            if len(got) == 2:
                break
            await asyncio.sleep(0.02)
        assert got[0].data == a + b and got[0].headers == {"Kvbus-Chunk": "3"}
        assert got[1].data == a[:7] and not got[1].headers
        import nats.errors

        with pytest.raises(nats.errors.MaxPayloadError):
            await tx.publish_views("kvbus.test.views", [memoryview(bytes(tx.max_payload + 1))])
    finally:
        await tx.close()
        await rx.close()


async def test_request_views_sends_pieces_uncopied_and_reads_the_reply_or_no_responders(nats_url: str) -> None:
    from kvbus.net.transport import NoResponders, TransportWrapper

    tx, rx = await NatsTransport.connect(nats_url), await NatsTransport.connect(nats_url)
    try:
        seen: list[bytes] = []

        async def answer(msg: Any) -> None:
            seen.append(msg.data)
            await rx.reply(msg, xxhash.xxh3_64_digest(msg.data))

        await rx.subscribe("kvbus.test.ask", answer)
        await rx.flush()
        a, b = os.urandom(MB + 3), os.urandom(1000)
        got = await asyncio.gather(
            *(tx.request_views("kvbus.test.ask", [b"head", memoryview(a), memoryview(b)[:i]], 5) for i in range(5))
        )
        assert sorted(got) == sorted(xxhash.xxh3_64_digest(b"head" + a + b[:i]) for i in range(5))  # each its own
        assert sorted(seen) == sorted(b"head" + a + b[:i] for i in range(5))
        with pytest.raises(NoResponders):
            await tx.request_views("kvbus.test.nobody", [b"x"], 2)
        await _silent(rx)
        with pytest.raises(TimeoutError):
            await tx.request_views("kvbus.test.silent", [b"x"], 0.2)

        class Counting(TransportWrapper):  # a wrapper defining only `request` sees the joined payload
            def __init__(self) -> None:
                super().__init__(tx)
                self.asked: list[bytes] = []

            async def request(self, subject: str, payload: bytes, timeout: float) -> bytes:
                self.asked.append(payload)
                return await tx.request(subject, payload, timeout)

        wrapper = Counting()
        reply = await wrapper.request_views("kvbus.test.ask", [b"a", memoryview(b"bc")], 5)
        assert wrapper.asked == [b"abc"] and reply == xxhash.xxh3_64_digest(b"abc")
    finally:
        await tx.close()
        await rx.close()


async def test_a_flushed_subscription_is_at_the_server_even_behind_a_backlog(nats_url: str) -> None:
    """Subscribed and flushed, the subject has a responder for another connection at once, even
    when the subscription was queued behind megabytes of publishes (nats-py writes its flush's
    PING ahead of its queue: the PONG came back before the SUB had reached the server)."""
    from kvbus.net import transport

    a, b = await NatsTransport.connect(nats_url), await NatsTransport.connect(nats_url)
    try:

        async def answer(msg: Any) -> None:
            await a.reply(msg, b"here")

        for i in range(3):
            for _ in range(32):
                await a.nc.publish("kvbus.test.backlog", b"x" * 512 * 1024)
            sub = await a.subscribe(f"kvbus.test.flushed.{i}", answer)
            # The transport's flush, and the module's for a bare nats-py connection (the benchmarks').
            await (a.flush() if i < 2 else transport.flush(a.nc, 5.0))
            try:
                assert await b.request(f"kvbus.test.flushed.{i}", b"?", 5) == b"here"
            except transport.NoResponders:
                pytest.fail("the flush returned before the subscription reached the server")
            await sub.unsubscribe()
    finally:
        await a.close()
        await b.close()


async def _silent(t: NatsTransport) -> None:
    """Subscribe to a subject that never answers."""

    async def ignore(msg: Any) -> None:
        pass

    await t.subscribe("kvbus.test.silent", ignore)
    await t.flush()


def _appender(out: list[Any]) -> Any:
    async def append(msg: Any) -> None:
        out.append(msg)

    return append


class _CuttableLink:
    """A TCP relay to a server that the test can cut and restore on the same port: the client
    behind it is disconnected while the server and its other clients stay up."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        """Listen (on the port of the first start, after a cut)."""
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        """Stop listening and drop every relayed connection."""
        assert self._server is not None
        self._server.close()
        for w in self._writers:
            w.transport.abort()
        self._writers.clear()
        await self._server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [writer, up_writer]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(1 << 20):
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))


async def test_publish_views_while_the_server_is_down_goes_out_after_the_reconnect(fresh_nats: NatsServer) -> None:
    # The sender alone loses its server (a relay between them is cut); the subscriber stays
    # connected, so what the sender buffered while disconnected must arrive once it reconnects.
    # (Killing the server instead raced: the sender could flush its buffer before the
    # subscriber had subscribed again, and core NATS drops a message nobody is subscribed to.)
    server = fresh_nats
    link = _CuttableLink(server.port)
    await link.start()
    rx = await NatsTransport.connect(server.url)
    tx = await NatsTransport.connect(f"nats://127.0.0.1:{link.port}")
    got: list[Any] = []
    await rx.subscribe("kvbus.test.reconnect", _appender(got))
    await rx.flush()
    payload = os.urandom(4 * MB)
    await link.cut()
    for _ in range(250):
        if not tx.nc.is_connected:
            break
        await asyncio.sleep(0.02)
    assert not tx.nc.is_connected  # what follows waits in nats-py's pending buffer
    await tx.publish_views(
        "kvbus.test.reconnect", [memoryview(payload)[:MB], memoryview(payload)[MB:]], headers={"Kvbus-Chunk": "0"}
    )
    await link.start()
    for _ in range(500):
        if got:
            break
        await asyncio.sleep(0.02)
    assert len(got) == 1 and got[0].data == payload
    await tx.close()
    await rx.close()


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=3000), min_size=1, max_size=8),
    chunk=st.integers(min_value=64, max_value=4096),
    workers=st.integers(min_value=1, max_value=3),
    slack=st.integers(min_value=0, max_value=100),
)
def test_staging_copies_every_buffer_to_its_offset_and_hashes_each_chunk_as_the_open_announces(
    sizes: list[int], chunk: int, workers: int, slack: int
) -> None:
    from kvbus.bus.chunking import ChunkSource, digest_chunks, stage

    buffers = [memoryview(os.urandom(n)) for n in sizes]
    source = ChunkSource(buffers, chunk)
    dst = memoryview(bytearray(source.total + slack))
    digests = asyncio.run(stage(source, dst, workers=workers))
    assert bytes(dst[: source.total]) == b"".join(bytes(b) for b in buffers)
    assert digests == digest_chunks([source.chunk(i) for i in range(source.n_chunks)])
    if source.total:
        with pytest.raises(ValueError, match="cannot hold"):
            asyncio.run(stage(source, dst[: source.total - 1]))


def _kernel_pacing(path: Any) -> int:
    (conn,) = path._conns.values()
    sock = conn.channel.sock
    return struct.unpack("Q", sock.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 8))[0]


async def test_the_kernel_paces_a_tcp_connection_at_the_rates_of_its_transfers(
    planes: tuple[DataPlane, DataPlane],
) -> None:
    """The tcp connection's ``SO_MAX_PACING_RATE`` is the sum of its transfers' rates (one rate
    budget's pacer counted once) times the headers, follows a rate change before the next
    chunk, is lifted while an unpaced transfer runs and comes back when it ends: without it a
    paced transfer's chunk leaves in one burst and queues at the bottleneck."""
    rx, tx = planes
    specs, sinks = [_spec() for _ in range(4)], [Sink() for _ in range(4)]
    offers = [await rx.accept(s, k, peer_paths=["tcp"], peer_host=tx.host) for s, k in zip(specs, sinks, strict=True)]
    sessions = await asyncio.gather(*(tx.connect(s, ["tcp"], o) for s, o in zip(specs, offers, strict=True)))
    assert tx.tcp is not None
    budget, own = TokenBucket(2e6), TokenBucket(5e6)
    sessions[0].pace(budget)
    sessions[1].pace(budget)
    sessions[2].pace(own)
    assert _kernel_pacing(tx.tcp) == int(WIRE_OVERHEAD * 7e6)
    own.set_rate(1e6)
    data = os.urandom(specs[2].chunk_len(0))
    await sessions[2].send_chunk(0, [memoryview(data)], chunk_digest(data))
    assert _kernel_pacing(tx.tcp) == int(WIRE_OVERHEAD * 3e6)
    sessions[3].pace(None)  # unpaced: no limit while it runs
    assert _kernel_pacing(tx.tcp) == UNPACED
    await sessions[3].close()
    assert _kernel_pacing(tx.tcp) == int(WIRE_OVERHEAD * 3e6)
    for session in sessions[:3]:
        await session.close()
    assert _kernel_pacing(tx.tcp) == UNPACED
