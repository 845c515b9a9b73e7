"""The data plane inside the bus: real nats-server, real scheduler, a receiving agent in another
OS process (`tests/peer.py`) or in this one.

Each path delivers bit-exact across two processes (and the restriction to NATS is obeyed: no
direct listener sees a connection); a direct path cut mid-transfer falls back to NATS and
delivers exactly once; a receiver killed with SIGKILL mid-transfer on ``shm`` leaves no segment
behind and the sender gets an error; a wrong or replayed token delivers nothing; a critical
transfer still overtakes a bulk one on ``tcp``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import secrets
import socket
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from kvbus.bus import Bus, BusConfig, EmulatedLink, ReceiveTimeout, TransferError
from kvbus.bus.chunking import ChunkSource, digest_chunks, digests_root
from kvbus.bus.paths import PathsConfig, TransferSpec
from kvbus.bus.paths.direct import SocketChannel
from kvbus.bus.paths.frames import HEADER_SIZE, RECEIVER, SENDER, FrameType, bind_payload, pack, unpack
from kvbus.codecs import get_codec
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig
from kvbus.protocol import Open, OpenReply, ack_subject, data_subject, inbox_subject
from tests.conftest import FAST
from tests.kvutil import kv_of_bytes
from tests.peer import SIG, Peer, kv_digest

MB = 1 << 20


def memfd_count() -> int:
    """Shared segments (memfd descriptors or mappings) this process holds."""
    gc.collect()
    fds = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fds += "memfd:" in os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        return fds + sum("memfd:" in line for line in f)


def dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


# -- each path, across two processes ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sender_bus", "want"),
    [("shm,tcp,nats", "shm"), ("tcp,nats", "tcp"), ("nats", "nats")],
    indirect=["sender_bus"],
    ids=["shm", "tcp-shm-disallowed", "nats-only"],
)
async def test_each_path_delivers_bit_exact_across_processes(
    nats_url: str, sender_bus: Bus, want: str, scheduler: GroupScheduler
) -> None:
    name = f"paths-rx-{want}-{uuid.uuid4().hex[:6]}"
    peer = await Peer.agent(nats_url, name)
    try:
        tx = await sender_bus.agent(f"paths-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
        for seed in (1, 2):  # the second reuses the connection (and, on shm, a pooled segment)
            kv = kv_of_bytes(SIG, 12 * MB, seed=seed)
            report = await tx.send(name, kv, medium="full")
            got = await peer.line()
            assert got["transfer_id"] == report.transfer_id
            assert got["digest"] == kv_digest(kv)
            assert report.path == want and report.paths == (want,)
            assert report.retransmits == 0
        # The scheduler learnt the link of the path the bytes took, and only that one.
        for _ in range(500):
            if scheduler.state.link(tx.name, name, want).known:
                break
            await asyncio.sleep(0.01)
        assert scheduler.state.link(tx.name, name, want).known
        others = [p for p in ("shm", "tcp", "nats") if p != want]
        assert not any(scheduler.state.link(tx.name, name, p).known for p in others)
        accepted = got["accepted"]
        plane = sender_bus.plane
        assert plane is not None
        if want == "nats":
            # Restricted to NATS: not one connection to a direct listener, from either side.
            assert accepted == {"tcp": 0, "shm": 0}
            assert plane.shm is None and plane.tcp is None
        elif want == "tcp":
            assert accepted["shm"] == 0 and accepted["tcp"] == 1  # one connection, reused
            assert plane.shm is None
        else:
            assert accepted["tcp"] == 0 and accepted["shm"] == 1
    finally:
        await peer.stop()


@pytest.mark.parametrize("sender_bus", ["tcp,nats"], indirect=True)
async def test_a_receiver_restricted_to_nats_gets_every_byte_on_nats(nats_url: str, sender_bus: Bus) -> None:
    name = f"paths-natsrx-{uuid.uuid4().hex[:6]}"
    peer = await Peer.agent(nats_url, name, "--paths", "nats")
    try:
        tx = await sender_bus.agent(f"paths-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
        kv = kv_of_bytes(SIG, 6 * MB, seed=3)
        report = await tx.send(name, kv, medium="full")
        got = await peer.line()
        assert got["digest"] == kv_digest(kv) and report.path == "nats"
        assert got["accepted"] == {"tcp": 0, "shm": 0}
        assert sender_bus.plane is not None and sender_bus.plane.tcp is not None
        assert sender_bus.plane.tcp.connections == 0
    finally:
        await peer.stop()


# -- fall back ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sender_bus", "path"), [("shm,tcp,nats", "shm"), ("tcp,nats", "tcp")], indirect=["sender_bus"], ids=["shm", "tcp"]
)
async def test_a_direct_path_cut_mid_transfer_falls_back_to_nats_and_delivers_once(
    nats_url: str, sender_bus: Bus, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"paths-cut-{path}-{uuid.uuid4().hex[:6]}"
    peer = await Peer.agent(nats_url, name)
    cut: list[int] = []
    original = SocketChannel.send

    async def send(self: SocketChannel, buffers: Any, fds: Any = ()) -> None:
        frame = unpack(bytes(buffers[0][:HEADER_SIZE]), path, RECEIVER) if buffers[0].nbytes >= HEADER_SIZE else None
        if frame is not None and frame.type is FrameType.DATA and frame.index == 2 and not cut:
            cut.append(frame.index)
            self.sock.shutdown(socket.SHUT_RDWR)  # the connection dies under the transfer
        await original(self, buffers, fds)

    monkeypatch.setattr(SocketChannel, "send", send)
    try:
        tx = await sender_bus.agent(f"paths-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
        kv = kv_of_bytes(SIG, 24 * MB, seed=4)
        report = await tx.send(name, kv, medium="full")
        assert cut == [2]
        assert report.paths == (path, "nats") and report.path == "nats"
        got = await peer.line()
        assert got["transfer_id"] == report.transfer_id and got["digest"] == kv_digest(kv)
        # Exactly once: the next delivery is the next transfer, not the first one again.
        monkeypatch.setattr(SocketChannel, "send", original)
        marker = kv_of_bytes(SIG, 4 * MB, seed=5)
        second = await tx.send(name, marker, medium="full")
        got2 = await peer.line()
        assert got2["transfer_id"] == second.transfer_id and got2["digest"] == kv_digest(marker)
        assert second.path == path  # a new connection for the next transfer
    finally:
        await peer.stop()


async def test_a_receiver_killed_mid_transfer_on_shm_leaves_no_segment_and_fails_the_send(
    nats_url: str, sender_bus: Bus
) -> None:
    name = f"paths-kill-{uuid.uuid4().hex[:6]}"
    before_shm = dev_shm()
    peer = await Peer.agent(nats_url, name, "--stall-at-chunk", "6")
    try:
        tx = await sender_bus.agent(f"paths-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
        baseline = memfd_count()
        kv = kv_of_bytes(SIG, 40 * MB, seed=6)
        send = asyncio.create_task(tx.send(name, kv, medium="full"))
        stalled = await peer.line()
        assert stalled["via"] == ["shm"]
        assert memfd_count() > baseline  # the segment is shared right now
        peer.kill9()
        with pytest.raises(TransferError):
            await asyncio.wait_for(send, 60)
        await asyncio.sleep(0.2)  # the session's close runs in the background
        assert memfd_count() == baseline  # the sender let go of the segment: the kernel frees it
        assert dev_shm() == before_shm  # and nothing was ever put in /dev/shm
    finally:
        await peer.stop()


# -- tokens ---------------------------------------------------------------------------------------------


async def _open_by_hand(bus: Bus, rx: str, src: str, nbytes: int) -> tuple[Open, OpenReply]:
    """Announce a transfer to ``rx`` as sender ``src`` would (an `Open` offering ``tcp``); its reply."""
    encoded = get_codec("full").encode(kv_of_bytes(SIG, nbytes, seed=7))
    source = ChunkSource(encoded.buffers, MB)
    digests = digest_chunks([source.chunk(i) for i in range(source.n_chunks)])
    tid = uuid.uuid4().hex
    plane = bus.plane
    assert plane is not None
    msg = Open(
        transfer_id=tid,
        src=src,
        codec=encoded.codec,
        meta=encoded.meta,
        sizes=[b.nbytes for b in source.buffers],
        total=source.total,
        chunk_size=MB,
        n_chunks=source.n_chunks,
        digest=digests_root(digests, source.total),
        window=16,
        data_subject=data_subject(rx, src, tid),
        ack_subject=ack_subject(src, rx),
        paths=["tcp", "nats"],
        host=plane.host,
        digests=digests,
    )
    data = await bus.transport.request(inbox_subject(rx, src), msg.frame(), timeout=5)
    return msg, OpenReply.decode(data)


async def _bind(host: str, port: int, token: str, tid: str) -> tuple[socket.socket, bytes]:
    """Connect to a data listener and BIND stream 1 with ``token``; the first answer (b'' when closed)."""
    loop = asyncio.get_running_loop()
    sock = socket.create_connection((host, port))
    sock.setblocking(False)
    payload = bind_payload(token, tid)
    await loop.sock_sendall(sock, pack(FrameType.BIND, 1, len(payload)) + payload)
    try:
        answer = await asyncio.wait_for(loop.sock_recv(sock, HEADER_SIZE), 10)
    except ConnectionResetError:
        answer = b""
    return sock, answer


async def test_a_wrong_or_replayed_token_delivers_nothing(bus: Bus) -> None:
    rx = await bus.agent(f"paths-tok-{uuid.uuid4().hex[:6]}", signature=SIG)
    msg, reply = await _open_by_hand(bus, rx.name, "paths-stranger", 3 * MB)
    assert reply.ok and "tcp" in reply.paths and reply.offer is not None
    offer = reply.offer
    loop = asyncio.get_running_loop()
    # A wrong token: the connection is closed before any byte is used, whatever follows it.
    sock, answer = await _bind(offer.tcp_host, offer.tcp_port, secrets.token_hex(32), msg.transfer_id)
    try:
        data = b"\0" * MB
        await loop.sock_sendall(sock, pack(FrameType.DATA, 1, len(data), index=0) + data)
    except OSError:
        pass  # already closed
    sock.close()
    assert answer == b""
    # The right token binds once...
    good, answer = await _bind(offer.tcp_host, offer.tcp_port, offer.token, msg.transfer_id)
    assert unpack(answer, "tcp", SENDER).type is FrameType.BOUND
    # ...and a replay of it on another connection gets nothing.
    replay, answer = await _bind(offer.tcp_host, offer.tcp_port, offer.token, msg.transfer_id)
    replay.close()
    good.close()
    assert answer == b""
    assert rx.partial_transfers == 1
    incoming = rx._receiver.incoming.get(msg.transfer_id)
    assert incoming is not None and incoming.count == 0  # not one chunk was taken
    with pytest.raises(ReceiveTimeout):
        await rx.receive(timeout=1.0)


# -- scheduling on a direct path ------------------------------------------------------------------------


async def test_a_critical_transfer_overtakes_a_bulk_one_on_tcp(nats_url: str) -> None:
    group = f"g-tcp-{uuid.uuid4().hex[:6]}"
    paths = PathsConfig(allowed="tcp,nats", tcp_host="127.0.0.1")
    cfg = BusConfig(
        chunk_size=256 * 1024, **{f: getattr(FAST, f) for f in ("ack_timeout", "peer_timeout", "request_timeout")}
    )
    sched = await GroupScheduler.connect(nats_url, group, config=SchedulerConfig())
    tx_bus = await Bus.connect(nats_url, config=cfg, paths=paths)
    rx_bus = await Bus.connect(nats_url, config=cfg, paths=paths)
    try:
        rx = await rx_bus.agent(f"{group}-rx", group=group, signature=SIG, link=EmulatedLink(16_000_000))
        bulk_tx = await tx_bus.agent(f"{group}-bulk", group=group, signature=SIG)
        crit_tx = await tx_bus.agent(f"{group}-crit", group=group, signature=SIG)
        bulk_kv = kv_of_bytes(SIG, 16_000_000, seed=8)
        crit_kv = kv_of_bytes(SIG, 4_000_000, seed=9)
        bulk = asyncio.create_task(bulk_tx.send(rx.name, bulk_kv, medium="full"))
        out = None
        for _ in range(2000):
            out = next(iter(bulk_tx._sender.outgoing.values()), None)
            if out is not None and out.fraction_sent >= 0.05:
                break
            await asyncio.sleep(0.005)
        assert out is not None and out.route is not None and out.route.path == "tcp"
        crit_report = await crit_tx.send(rx.name, crit_kv, medium="full", critical=True)
        bulk_report = await bulk
        first, second = await rx.receive(timeout=10), await rx.receive(timeout=10)
        assert first.transfer_id == crit_report.transfer_id  # the critical one overtook the bulk one
        assert second.transfer_id == bulk_report.transfer_id
        assert first.kv.equal(crit_kv) and second.kv.equal(bulk_kv)
        assert bulk_report.path == "tcp" and crit_report.path == "tcp"
        assert out.stats.pauses == 1 and out.stats.retransmits == 0
        assert out.stats.chunks_sent == out.plan.n_chunks  # resumed where it stopped, on the same path
        assert sched.state.preemptions == 1
    finally:
        await tx_bus.close()
        await rx_bus.close()
        await sched.close()


# -- the cost model sees each path's own link -------------------------------------------------------------


def test_link_estimates_are_kept_per_path_and_the_prediction_uses_the_expected_one() -> None:
    from kvbus.group_scheduler.selection import AdaptiveSelector
    from kvbus.group_scheduler.state import GroupState, Pending
    from kvbus.protocol import TransferRequest

    state = GroupState("g")
    state.link("a", "b", "shm").observe(5_000_000_000, 1.0)
    state.link("a", "b", "nats").observe(500_000_000, 1.0)
    selector = AdaptiveSelector()
    assert selector.link(state, "a", "b", "shm").bandwidth_bps == 5e9  # not averaged with NATS
    assert selector.link(state, "a", "b", "nats").bandwidth_bps == 5e8
    assert selector.link(state, "a", "b", "").bandwidth_bps == 5e8  # an older sender: NATS
    assert selector.link(state, "a", "b", "tcp").source != "estimate"  # nothing measured on tcp yet
    predicted = {}
    for path in ("shm", "nats"):
        request = TransferRequest(
            transfer_id=f"t-{path}",
            src="a",
            dst=["b"],
            group="g",
            n_tokens=4096,
            nbytes=64 * MB,
            signature=SIG.to_dict(),
            medium="full",
            path=path,
        )
        pending = Pending(request, {"b": SIG})
        selector.select(state, pending)
        assert pending.decision["path"] == path
        predicted[path] = pending.predicted_s
    assert predicted["shm"] < predicted["nats"]


async def test_a_transfer_done_feeds_the_estimate_of_its_own_path(
    scheduler: GroupScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvbus.group_scheduler.learning import LearnedCosts
    from kvbus.group_scheduler.state import Pending
    from kvbus.protocol import TransferDone, TransferRequest

    # the session's scheduler has learned the paths' fixed costs from earlier tests' transfers, and
    # a link estimate sees a transfer's wire time less that cost: start this one with nothing learned
    monkeypatch.setattr(scheduler.policy.selector.model, "learned", LearnedCosts())
    state = scheduler.state
    for path, seconds in (("shm", 0.01), ("nats", 0.1), ("mixed", 0.05)):
        tid = uuid.uuid4().hex
        request = TransferRequest(
            transfer_id=tid, src="est-a", dst=["est-b"], group="default", n_tokens=1, nbytes=64 * MB, signature={}
        )
        state.active[tid] = Pending(request, {"est-b": None})
        done = TransferDone(
            transfer_id=tid,
            src="est-a",
            ok=True,
            medium="full",
            nbytes=64 * MB,
            seconds=seconds,
            dst=["est-b"],
            wire_s=seconds,
            path=path,
        )
        scheduler.loop.finished(done)
    assert state.link("est-a", "est-b", "shm").bandwidth_bps == pytest.approx(64 * MB / 0.01)
    assert state.link("est-a", "est-b", "nats").bandwidth_bps == pytest.approx(64 * MB / 0.1)
    assert not state.link("est-a", "est-b", "tcp").samples  # "mixed" (a fall back) fed no estimate


def test_the_delta_base_is_copied_into_the_previous_one_and_never_aliases_the_delivery() -> None:
    from kvbus.bus.bases import base_copy

    first = kv_of_bytes(SIG, 8 * MB, seed=10)
    base = base_copy(first)
    assert base.equal(first) and base.keys[0].data_ptr() != first.keys[0].data_ptr()
    second = kv_of_bytes(SIG, 8 * MB, seed=11)
    again = base_copy(second, base)
    assert again.equal(second)
    assert again.keys[0].data_ptr() == base.keys[0].data_ptr()  # the old base's memory, reused
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(again.values, second.values))
    second.values[0].zero_()  # the application edits its delivery: the base does not change
    assert not torch.equal(again.values[0], second.values[0])
    longer = kv_of_bytes(SIG, 9 * MB, seed=12)
    fresh = base_copy(longer, again)  # another layout: fresh memory
    assert fresh.equal(longer) and fresh.keys[0].data_ptr() != again.keys[0].data_ptr()


async def test_a_context_that_came_on_shm_is_kept_as_the_delta_base_without_a_copy(bus: Bus, sender_bus: Bus) -> None:
    rx = await bus.agent(f"paths-twin-rx-{uuid.uuid4().hex[:6]}", signature=SIG)
    tx = await sender_bus.agent(f"paths-twin-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
    whole = kv_of_bytes(SIG, 12 * MB, seed=31)
    first = whole.slice(0, whole.n_tokens * 3 // 4)
    assert (await tx.send(rx.name, first, medium="full")).path == "shm"
    got = (await rx.receive(timeout=10)).kv
    base = rx._receiver.bases[tx.name]
    assert base.equal(first)
    # Not a copy: the base views a second mapping of the sender's segment, not the delivery's.
    with open("/proc/self/maps") as f:
        memfd = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f if "memfd:" in line]
    for t in (*base.keys, *base.values):
        assert any(lo <= t.data_ptr() < hi for lo, hi in memfd)
        assert t.data_ptr() not in {u.data_ptr() for u in (*got.keys, *got.values)}
    got.values[0].zero_()  # the application edits its delivery: the base stays as it arrived
    assert base.equal(first) and not torch.equal(got.values[0], base.values[0])
    # The next context builds on that base: only its new tokens travel, and it decodes exactly.
    report = await tx.send(rx.name, whole, medium="delta+full")
    assert report.medium.startswith("delta") and report.nbytes < 0.5 * whole.nbytes
    assert (await rx.receive(timeout=10)).kv.equal(whole)


async def test_a_payload_for_a_receiver_reached_on_shm_is_staged_in_a_segment_that_is_reused(
    bus: Bus, sender_bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvbus.bus.outgoing as outgoing

    staged: list[int] = []
    real = outgoing.stage

    async def counting(source: Any, dst: memoryview, **kw: Any) -> bytes:
        staged.append(source.total)
        return await real(source, dst, **kw)

    monkeypatch.setattr(outgoing, "stage", counting)
    rx = await bus.agent(f"paths-stage-rx-{uuid.uuid4().hex[:6]}", signature=SIG)
    tx = await sender_bus.agent(f"paths-stage-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
    plane = sender_bus.plane
    assert plane is not None and plane.shm is not None
    assert rx.name not in tx._sender.paths
    for seed in range(4):
        kv = kv_of_bytes(SIG, 12 * MB, seed=40 + seed)
        report = await tx.send(rx.name, kv, medium="full")
        got = await rx.receive(timeout=10)
        assert report.path == "shm" and got.kv.equal(kv) and kv_digest(got.kv) == kv_digest(kv)
        del got
        # The first went before the sender knew the receiver's host; each later one was
        # copied and hashed straight into a segment in one pass.
        assert len(staged) == seed and tx._sender.paths[rx.name] == "shm"
    # Nothing holds the segments any more (deliveries dropped; the bases keep the last one):
    # they are back in the pool, not new ones each time.
    rx._receiver.bases.clear()
    gc.collect()
    for _ in range(200):
        if plane.shm.pool.free_bytes >= 2 * kv.nbytes:
            break
        await asyncio.sleep(0.02)
    assert 2 * kv.nbytes <= plane.shm.pool.free_bytes <= 4 * kv.nbytes + 4 * MB


def test_a_receiver_keeps_the_segments_it_verified_mapped_within_a_budget() -> None:
    from kvbus.bus.paths.shm import Segment
    from kvbus.bus.paths.shm_server import SegmentMaps

    maps = SegmentMaps(3 * MB)
    conn, other = object(), object()
    a, b, c = Segment(MB), Segment(2 * MB), Segment(MB)
    a.view[:5] = b"first"
    first = maps.view(conn, a.fd, MB)  # type: ignore[arg-type]
    assert first is not None and bytes(first[:5]) == b"first" and first.readonly
    a.view[:5] = b"again"  # the sender reuses its segment: the kept mapping sees its new bytes
    again = maps.view(conn, a.fd, MB)  # type: ignore[arg-type]
    assert again is not None and bytes(again[:5]) == b"again" and len(maps) == 1
    assert maps.view(conn, b.fd, 2 * MB) is not None and maps.bytes == 3 * MB
    assert maps.view(other, c.fd, MB) is not None  # over the budget: the least recently used goes
    assert len(maps) == 2 and maps.bytes == 3 * MB
    assert maps.view(conn, Segment(4 * MB).fd, 4 * MB) is None  # larger than the whole budget
    maps.forget(conn)  # its connection closed
    assert len(maps) == 1 and maps.bytes == MB
    maps.close()
    assert len(maps) == 0 and maps.bytes == 0
    assert SegmentMaps(0).view(conn, c.fd, MB) is None  # 0: nothing is kept  # type: ignore[arg-type]


# -- a sender killed mid-transfer, TLS ----------------------------------------------------------------


@pytest.mark.parametrize("allowed", ["shm,tcp,nats", "tcp,nats"], ids=["shm", "tcp"])
async def test_a_sender_killed_mid_transfer_leaves_nothing_and_delivers_nothing(
    nats_url: str, bus: Bus, allowed: str
) -> None:
    rx = await bus.agent(f"paths-victim-{uuid.uuid4().hex[:6]}", signature=SIG)
    baseline = memfd_count()
    name = f"paths-doomed-{uuid.uuid4().hex[:6]}"
    sender = await Peer.start("sender_peer.py", nats_url, name, rx.name, "40", "3", allowed, name=name)
    try:
        assert sender.hello == {"line": "ready"}
        stalled = await sender.line()
        assert stalled["path"] == allowed.split(",")[0]
        assert rx.partial_transfers == 1
        if stalled["path"] == "shm":
            assert memfd_count() > baseline  # the receiver maps the sender's segment right now
        sender.kill9()
        await sender.exit_code()
        # The receiver drops the partial once it makes no progress (FAST: 2 s), and the memory with it.
        for _ in range(1000):
            if not rx.partial_transfers:
                break
            await asyncio.sleep(0.02)
        assert rx.partial_transfers == 0
        with pytest.raises(ReceiveTimeout):
            await rx.receive(timeout=0.5)
        await asyncio.sleep(0.2)
        assert memfd_count() == baseline  # no mapping of the dead sender's segment is left
        plane = bus.plane
        assert plane is not None and plane.registry is not None and len(plane.registry) == 0
        if plane.tcp is not None and plane.tcp.listener is not None:
            assert not plane.tcp.listener.connections  # its connection is gone too
    finally:
        await sender.stop()


async def test_the_tcp_path_speaks_tls_with_the_deployments_certificates(
    nats_url: str, scheduler: GroupScheduler, tmp_path: Path
) -> None:
    from kvbus.bus.paths import DataTls
    from tests.test_paths import agent_pki

    ca, cert, key, _ = agent_pki(tmp_path)
    tls = DataTls(ca=str(ca), cert=str(cert), key=str(key))
    paths = PathsConfig(allowed="tcp,nats", tcp_host="127.0.0.1")
    tx_bus = await Bus.connect(nats_url, config=FAST, paths=paths, data_tls=tls)
    rx_bus = await Bus.connect(nats_url, config=FAST, paths=paths, data_tls=tls)
    plain_bus = await Bus.connect(nats_url, config=FAST, paths=paths)
    try:
        rx = await rx_bus.agent(f"paths-tls-rx-{uuid.uuid4().hex[:6]}", signature=SIG)
        tx = await tx_bus.agent(f"paths-tls-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
        kv = kv_of_bytes(SIG, 12 * MB, seed=14)
        report = await tx.send(rx.name, kv, medium="full")
        assert report.path == "tcp" and (await rx.receive(timeout=10)).kv.equal(kv)
        # A sender without the certificates does not use the TLS listener: its bytes go on NATS.
        plain = await plain_bus.agent(f"paths-plain-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
        report = await plain.send(rx.name, kv, medium="full")
        assert report.path == "nats" and (await rx.receive(timeout=10)).kv.equal(kv)
    finally:
        for b in (plain_bus, tx_bus, rx_bus):
            await b.close()


async def test_a_tls_deployment_never_sends_kv_in_the_clear_on_the_tcp_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """NATS over TLS and no ``data_tls``: the ``tcp`` path takes the certificates of
    ``KVBUS_NATS_TLS_*`` (the deployment's); given only an SSL context, the bus leaves ``tcp``
    out (and says so) rather than sending plain TCP; ``tcp`` alone is then a configuration error."""
    import ssl

    from kvbus.app.local import NatsServer
    from kvbus.errors import ConfigError
    from kvbus.net.auth import NatsAuth
    from tests.test_paths import agent_pki

    ca, cert, key, _ = agent_pki(tmp_path)
    block = f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n  ca_file: "{ca}"\n  verify: true\n}}\n'
    server = NatsServer(extra_config=block).start()
    env = {"KVBUS_NATS_TLS_CA": str(ca), "KVBUS_NATS_TLS_CERT": str(cert), "KVBUS_NATS_TLS_KEY": str(key)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    options = NatsAuth.from_env().connect_options()
    paths = PathsConfig(allowed="tcp,nats", tcp_host="127.0.0.1")
    sched = await GroupScheduler.connect(server.url, "default", nats_options=options)
    buses: list[Bus] = []
    try:
        tx_bus = await Bus.connect(server.url, config=FAST, paths=paths, **options)
        rx_bus = await Bus.connect(server.url, config=FAST, paths=paths, **options)
        buses += [tx_bus, rx_bus]
        assert tx_bus.transport.uses_tls  # type: ignore[attr-defined]
        rx = await rx_bus.agent(f"tlsdep-rx-{uuid.uuid4().hex[:6]}", signature=SIG)
        tx = await tx_bus.agent(f"tlsdep-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
        kv = kv_of_bytes(SIG, 8 * MB, seed=15)
        report = await tx.send(rx.name, kv, medium="full")
        assert report.path == "tcp" and (await rx.receive(timeout=10)).kv.equal(kv)
        for b in (tx_bus, rx_bus):
            assert b.plane is not None and b.plane.tcp is not None and b.plane.tcp.tls is not None
        # The same deployment's TLS as an SSL context only (no files to serve the tcp path with).
        for name in env:
            monkeypatch.delenv(name)
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
        context.load_cert_chain(str(cert), str(key))
        with caplog.at_level("WARNING", logger="kvbus.bus.client"):
            bare = await Bus.connect(server.url, config=FAST, paths=paths, tls=context)
        buses.append(bare)
        assert bare.paths_config.allowed_paths == ("nats",) and "tcp data path is off" in caplog.text
        other = await bare.agent(f"tlsdep-bare-{uuid.uuid4().hex[:6]}", signature=SIG)
        report = await other.send(rx.name, kv, medium="full")
        assert report.path == "nats" and (await rx.receive(timeout=10)).kv.equal(kv)
        with pytest.raises(ConfigError, match="tcp only"):
            await Bus.connect(server.url, config=FAST, paths=PathsConfig(allowed="tcp"), tls=context)
    finally:
        for b in buses:
            await b.close()
        await sched.close()
        server.stop()


async def test_an_unreachable_tcp_endpoint_is_not_tried_again_for_a_while() -> None:
    from kvbus.bus.paths import PathUnavailable, TcpPath
    from kvbus.bus.paths.tcp import FAILED_ENDPOINT_S
    from kvbus.protocol import PathOffer

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = TcpPath(None, config=PathsConfig(connect_timeout_s=2.0))
    offer = PathOffer(host="0" * 32, token="1" * 64, tcp_host="127.0.0.1", tcp_port=port)
    spec = TransferSpec.of("t-unreachable", "a", "b", [(0, 10)])
    assert path.reachable(offer, "")
    with pytest.raises(PathUnavailable):
        await path.open(spec, offer)
    assert not path.reachable(offer, "")  # the next transfer goes straight to NATS, no connect wait
    path._failed[("127.0.0.1", port)] -= FAILED_ENDPOINT_S + 1
    assert path.reachable(offer, "")  # tried again later
    await path.close()
