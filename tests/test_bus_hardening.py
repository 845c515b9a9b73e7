"""Issue 18 (hardening), the bus's findings, each against a real nats-server and a real scheduler:
forged chunks repaired from the sender (2), exactly once across a receiver's kill -9 and restart
(3), hostile Opens refused before anything is allocated (4), partial transfers capped and idle
ones freed from their last valid chunk (6), fidelity that follows the delta base (7), NaN and inf
(8), dtype against the signature (9), deliveries that never alias the delta base (12) and the
leave message of a closing agent (13). Secure-mode findings (1) are in test_secure_hardening.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from kvbus.app.local import NatsServer
from kvbus.bus import Bus, BusConfig, ReceiveTimeout, TransferError, TransferInDoubt, TransferRejected
from kvbus.bus.chunking import ChunkSource, digest_chunks, digests_root, tree_digest
from kvbus.codecs import NonFiniteValues, get_codec
from kvbus.errors import SignatureMismatch
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig, StaticSelector, make_policy
from kvbus.net.transport import TransportWrapper
from kvbus.protocol import (
    CHUNK_INDEX_HEADER,
    MAX_BUFFERS,
    MAX_CHUNKS,
    Ack,
    AgentLeave,
    Open,
    OpenReply,
    Reason,
    ack_subject,
    data_subject,
    inbox_subject,
    sched_subject,
)
from tests.conftest import FAST
from tests.kvutil import kv_of_bytes, random_kv
from tests.peer import SIG, Peer, kv_digest

MB = 1 << 20


@pytest.fixture
async def pair(bus: Bus, nats_url: str) -> AsyncIterator[tuple[Any, Any, Bus]]:
    """Sender on ``bus``, receiver on a second connection (as if another process)."""
    other = await Bus.connect(nats_url, config=FAST)
    tx = await bus.agent(f"tx-{time.monotonic_ns()}", signature=SIG)
    rx = await other.agent(f"rx-{time.monotonic_ns()}", signature=SIG)
    try:
        yield tx, rx, other
    finally:
        await other.close()


class Rogue:
    """A client that speaks the protocol by hand: opens transfers to a receiver, sends chunks, reads acks."""

    def __init__(self, bus: Bus, name: str) -> None:
        self.bus = bus
        self.name = name
        self.acks: list[Ack] = []

    async def listen(self) -> None:
        async def record(msg: Any) -> None:
            self.acks.append(Ack.decode(msg.data))

        await self.bus.transport.subscribe(ack_subject(self.name, "*"), record)
        await self.bus.transport.flush()

    def streamed_open(self, rx: str, tid: str, payload: bytes, *, chunk: int = 1024) -> tuple[Open, list[bytes]]:
        """A valid streamed `Open` for ``payload`` (one buffer) and its chunks."""
        source = ChunkSource([memoryview(payload)], chunk)
        chunks = [bytes(source.chunk(i)) for i in range(source.n_chunks)]
        digests = digest_chunks(chunks)
        open_msg = Open(
            transfer_id=tid,
            src=self.name,
            codec="full",
            meta={"signature": SIG.to_dict()},
            sizes=[len(payload)],
            total=len(payload),
            chunk_size=chunk,
            n_chunks=len(chunks),
            digest=digests_root(digests, len(payload)),
            window=16,
            data_subject=data_subject(rx, self.name, tid),
            ack_subject=ack_subject(self.name, rx),
            digests=digests,
        )
        return open_msg, chunks

    async def ask(self, rx: str, frame: bytes) -> OpenReply:
        return OpenReply.decode(await self.bus.transport.request(inbox_subject(rx, self.name), frame, timeout=5))

    async def chunk(self, subject: str, index: int, data: bytes) -> None:
        await self.bus.transport.publish(subject, data, headers={CHUNK_INDEX_HEADER: str(index)})


async def _until(check: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


# -- 2: forged chunks injected by another client ----------------------------------------------------


@pytest.mark.usefixtures("nats_only")
async def test_chunks_injected_by_another_client_never_reach_the_delivery(
    pair: tuple[Any, Any, Bus], nats_url: str
) -> None:
    """Finding 2, from outside: a client floods the receiver's data subject with forged chunks
    (matching digest and root headers of its own) while the real sender streams; what is
    delivered is the sender's context, bit for bit, once."""
    tx, rx, _ = pair
    kv = kv_of_bytes(SIG, 6 * MB, seed=8)
    rogue = await Bus.connect(nats_url, config=FAST)
    injected = 0

    async def inject(subject: str) -> None:
        nonlocal injected
        junk = bytes(1024 * 1024)
        for i in range(6):
            await rogue.transport.publish(subject, junk, headers={CHUNK_INDEX_HEADER: str(i)})
            injected += 1

    class Spy(TransportWrapper):
        """Forwards the sender's publishes, and has the rogue inject before each real chunk."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def publish(self, subject: str, payload: Any, headers: dict[str, str] | None = None) -> None:
            if headers and headers.get(CHUNK_INDEX_HEADER) == "0" and not injected:
                await inject(subject)
                await rogue.transport.flush()
            await self.inner.publish(subject, payload, headers)

    tx.transport = Spy(tx.transport)
    try:
        report = await tx.send(rx.name, kv, medium="full")
        got = await rx.receive(timeout=10)
        assert injected == 6
        assert got.transfer_id == report.transfer_id and got.kv.equal(kv)
        with pytest.raises(ReceiveTimeout):
            await rx.receive(timeout=0.5)
    finally:
        await rogue.close()


# -- 3: exactly once across a kill -9 and a restart of the receiver ---------------------------------------


async def test_receiver_killed_between_delivery_and_final_ack_and_restarted_never_delivers_twice(
    nats_url: str, scheduler: GroupScheduler
) -> None:
    """Finding 3: the receiver process delivers a streamed transfer and is `kill -9`ed before its
    final ack; a new process under the same name starts at once. The sender's status request (the
    same transfer id) reaches the new incarnation, which refuses it (`RECEIVER_RESTARTED`): the
    sender gets an error (in doubt: the first one delivered it), and the transfer is delivered once,
    by the first incarnation only."""
    name = f"restart-rx-{time.monotonic_ns()}"
    first = await Peer.agent(nats_url, name, "--hang-after-delivery")
    second = await Peer.agent(nats_url, name, "--wait")  # warm: it only has to connect when told
    cfg = BusConfig(ack_timeout=3.0, peer_timeout=10.0, request_timeout=2.0, grant_timeout=10.0)
    tx_bus = await Bus.connect(nats_url, config=cfg)
    try:
        assert first.hello == {"line": "ready"}
        assert second.hello == {"line": "waiting"}
        tx = await tx_bus.agent(f"restart-tx-{time.monotonic_ns()}", signature=SIG)
        kv = kv_of_bytes(SIG, 8 * MB, seed=13)  # streamed: 8 chunks
        send = asyncio.create_task(tx.send(name, kv, medium="full"))
        delivered = await first.line()
        assert delivered["digest"] == kv_digest(kv)
        first.kill9()  # between the delivery and its final ack
        assert await first.exit_code(10) == -9
        await second.send(go=True)
        assert await second.line() == {"line": "ready"}
        # In doubt (issue 31 finding 4): the first incarnation may have delivered it, and did.
        with pytest.raises(TransferInDoubt) as info:
            await send
        cause = info.value.cause
        assert isinstance(cause, TransferRejected) and cause.code is Reason.RECEIVER_RESTARTED, info.value
        assert info.value.transfer_id == delivered["transfer_id"]
        # The new incarnation delivered nothing (a second delivery would print a line).
        with pytest.raises(TimeoutError):
            await second.line(timeout=2.0)
        # It works for new transfers (new ids) at once.
        again = kv_of_bytes(SIG, 4 * MB, seed=14)
        report = await tx.send(name, again, medium="full")
        line = await second.line()
        assert line["transfer_id"] == report.transfer_id and line["digest"] == kv_digest(again)
    finally:
        await first.stop()
        await second.stop()
        await tx_bus.close()


async def test_a_retry_naming_no_incarnation_is_refused_by_a_younger_one(pair: tuple[Any, Any, Bus], bus: Bus) -> None:
    """A retried Open whose sender never got a reply names no incarnation: a receiver started after
    the first attempt was sent refuses it; one running since before takes it."""
    tx, rx, _ = pair
    rogue = Rogue(bus, tx.name)
    open_msg, _ = rogue.streamed_open(rx.name, "r" * 32, bytes(4096))
    young = dataclasses.replace(open_msg, attempt=1, retry_age=3600.0)
    reply = await rogue.ask(rx.name, young.frame())
    assert not reply.ok and reply.code is Reason.RECEIVER_RESTARTED
    assert reply.incarnation == rx._receiver.incarnation
    wrong = dataclasses.replace(open_msg, attempt=2, incarnation="0" * 16)
    reply = await rogue.ask(rx.name, wrong.frame())
    assert not reply.ok and reply.code is Reason.RECEIVER_RESTARTED
    right = dataclasses.replace(open_msg, attempt=3, incarnation=rx._receiver.incarnation)
    reply = await rogue.ask(rx.name, right.frame())
    assert reply.ok and rx.partial_transfers == 1


# -- 4: hostile Opens --------------------------------------------------------------------------------


def _hostile(src: str, rx: str, **fields: Any) -> Open:
    base: dict[str, Any] = dict(
        transfer_id="h" * 32,
        src=src,
        codec="full",
        meta={"signature": SIG.to_dict()},
        sizes=[MB],
        total=MB,
        chunk_size=1,
        n_chunks=MB,
        digest="0" * 32,
        window=16,
        data_subject=f"kvbus.agent.{rx}.data.{'h' * 32}",
        ack_subject=f"kvbus.agent.{src}.ack",
    )
    base.update(fields)
    return Open(**base)


async def test_an_open_claiming_a_big_kv_in_tiny_chunks_is_refused_before_any_chunk_plan(
    pair: tuple[Any, Any, Bus], bus: Bus
) -> None:
    """Finding 4: a small Open announcing 1 MB in 1-byte chunks (a million-entry chunk plan) was
    accepted after the receiver built the plan; it is refused on its chunk size, O(1) work. So are
    Opens over the chunk, buffer or byte limits, and a maximal legal Open costs one partial."""
    tx, rx, _ = pair
    rogue = Rogue(bus, tx.name)
    for hostile in (_hostile(tx.name, rx.name), _hostile(tx.name, rx.name, n_chunks=1)):
        frame = hostile.frame()
        assert len(frame) < 1024  # a few hundred bytes
        reply = await rogue.ask(rx.name, frame)
        assert not reply.ok and reply.code in (Reason.MALFORMED, Reason.TOO_LARGE), reply.reason
        assert "n_chunks" in reply.reason or "chunk_size" in reply.reason, reply.reason
    over = [
        _hostile(tx.name, rx.name, chunk_size=1024, n_chunks=MAX_CHUNKS + 1, total=64 * MB, sizes=[64 * MB]),
        _hostile(tx.name, rx.name, chunk_size=1024, n_chunks=1024, sizes=[1024] * (MAX_BUFFERS + 1)),
        _hostile(  # over the receiver's max_transfer_bytes (4 GB)
            tx.name,
            rx.name,
            chunk_size=1 << 20,
            n_chunks=8192,
            total=8 << 30,
            sizes=[8 << 30],
            digests=bytes(8 * 8192),
            digest=digests_root(bytes(8 * 8192), 8 << 30),
        ),
    ]
    for hostile in over:
        reply = await rogue.ask(rx.name, hostile.frame())
        assert not reply.ok and reply.code is Reason.TOO_LARGE, reply.reason
    # The largest Open the protocol allows: accepted, one partial, dropped when idle.
    payload = bytes(MAX_CHUNKS * 1024)
    biggest, _ = rogue.streamed_open(rx.name, "b" * 32, payload)
    reply = await rogue.ask(rx.name, biggest.frame())
    assert reply.ok and rx.partial_transfers == 1
    await _until(lambda: rx.partial_transfers == 0, "the idle partial to be dropped")
    kv = random_kv(SIG, 3)
    await tx.send(rx.name, kv, medium="full")
    assert (await rx.receive(timeout=5)).kv.equal(kv)


# -- 6: partial transfers ----------------------------------------------------------------------------


@pytest.fixture
async def capped(
    request: pytest.FixtureRequest, nats_url: str, scheduler: GroupScheduler
) -> AsyncIterator[tuple[Any, Rogue]]:
    """A receiver with small partial caps and an idle deadline of ``request.param`` seconds, and a
    rogue sender listening for its acks."""
    cfg = dataclasses.replace(FAST, max_partials=2, max_partial_bytes=10_000, partial_timeout=request.param)
    rx_bus = await Bus.connect(nats_url, config=cfg)
    rogue_bus = await Bus.connect(nats_url, config=FAST)
    try:
        rx = await rx_bus.agent(f"capped-{time.monotonic_ns()}", signature=SIG)
        rogue = Rogue(rogue_bus, f"rogue-{time.monotonic_ns()}")
        await rogue.listen()
        yield rx, rogue
    finally:
        await rx_bus.close()
        await rogue_bus.close()


@pytest.mark.parametrize("capped", [1.0], indirect=True)
async def test_junk_chunks_do_not_keep_a_partial_transfer_alive(capped: tuple[Any, Rogue]) -> None:
    """Finding 6: 1-byte junk chunks kept a partial transfer alive for ever; its idle deadline now
    runs from its last valid chunk, and its sender gets a final ack saying it was dropped."""
    rx, rogue = capped
    open_msg, chunks = rogue.streamed_open(rx.name, "j" * 32, bytes(range(256)) * 16)
    assert (await rogue.ask(rx.name, open_msg.frame())).ok
    await rogue.chunk(open_msg.data_subject, 0, chunks[0])  # one valid chunk
    for _ in range(40):  # 4 s of junk, four idle deadlines
        await rogue.chunk(open_msg.data_subject, 1, b"x")
        await asyncio.sleep(0.1)
    assert rx.partial_transfers == 0
    await _until(lambda: any(a.done for a in rogue.acks), "the final ack")
    final = [a for a in rogue.acks if a.done]
    assert [(a.transfer_id, a.ok, a.code) for a in final] == [(open_msg.transfer_id, False, Reason.PARTIAL_DROPPED)]


@pytest.mark.parametrize("capped", [60.0], indirect=True)
async def test_partial_transfers_over_the_caps_drop_the_least_recently_progressed(capped: tuple[Any, Rogue]) -> None:
    """Finding 6: caps on the number and bytes of partial transfers; over them, the partial with the
    oldest valid progress is dropped and its sender told (`PARTIAL_DROPPED`); one transfer over the
    byte cap alone is refused (`TOO_LARGE`)."""
    rx, rogue = capped
    opens = [rogue.streamed_open(rx.name, c * 32, bytes(3000))[0] for c in "abc"]
    for i, open_msg in enumerate(opens):
        assert (await rogue.ask(rx.name, open_msg.frame())).ok
        assert rx.partial_transfers == min(i + 1, 2)
    await _until(lambda: rogue.acks, "the eviction ack")
    assert [(a.transfer_id, a.done, a.code) for a in rogue.acks] == [("a" * 32, True, Reason.PARTIAL_DROPPED)]
    # Bytes: two of 3000 held; one of 6000 more goes over 10,000, so the oldest ("b") goes.
    bigger, _ = rogue.streamed_open(rx.name, "d" * 32, bytes(6000))
    assert (await rogue.ask(rx.name, bigger.frame())).ok
    await _until(lambda: len(rogue.acks) == 2, "the second eviction ack")
    assert rogue.acks[1].transfer_id == "b" * 32 and rogue.acks[1].code is Reason.PARTIAL_DROPPED
    assert rx.partial_transfers == 2
    huge, _ = rogue.streamed_open(rx.name, "e" * 32, bytes(20_000))
    reply = await rogue.ask(rx.name, huge.frame())
    assert not reply.ok and reply.code is Reason.TOO_LARGE


@pytest.mark.usefixtures("nats_only")
async def test_an_evicted_transfer_fails_its_real_sender(nats_url: str, scheduler: GroupScheduler) -> None:
    """A real sender whose partial transfer is evicted gets `PARTIAL_DROPPED` at once."""
    cfg = dataclasses.replace(FAST, max_partials=1)
    rx_bus = await Bus.connect(nats_url, config=cfg)
    tx_bus = await Bus.connect(nats_url, config=FAST)
    try:
        rx = await rx_bus.agent(f"evict-rx-{time.monotonic_ns()}", signature=SIG)
        tx = await tx_bus.agent(f"evict-tx-{time.monotonic_ns()}", signature=SIG)

        class Stall(TransportWrapper):
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            async def publish(self, subject: str, payload: Any, headers: dict[str, str] | None = None) -> None:
                if headers and CHUNK_INDEX_HEADER in headers and headers[CHUNK_INDEX_HEADER] != "0":
                    return  # only the first chunk ever goes out
                await self.inner.publish(subject, payload, headers)

        tx.transport = Stall(tx.transport)
        send = asyncio.create_task(tx.send(rx.name, kv_of_bytes(SIG, 4 * MB, seed=2), medium="full"))
        await _until(lambda: rx.partial_transfers == 1, "the partial transfer")
        rogue = Rogue(tx_bus, f"rogue-{time.monotonic_ns()}")
        newer, _ = rogue.streamed_open(rx.name, "n" * 32, bytes(3000))
        assert (await rogue.ask(rx.name, newer.frame())).ok
        with pytest.raises(TransferRejected) as info:
            await asyncio.wait_for(send, 10)
        assert info.value.code is Reason.PARTIAL_DROPPED
    finally:
        await rx_bus.close()
        await tx_bus.close()


# -- 7: fidelity follows the base ------------------------------------------------------------------------


async def test_a_delta_over_a_lossy_base_is_never_reported_lossless(pair: tuple[Any, Any, Bus]) -> None:
    """Finding 7: after an int8 send, a `delta+full` send delivered the receiver's int8 prefix while
    the medium said lossless. A lossless delta is now never built on a lossy base: it goes whole
    (as `full`) and arrives bit-exact; that precision refresh makes later deltas lossless again. A
    lossy delta the caller asks for over the lossy base is reported lossy, as delivered."""
    tx, rx, _ = pair
    whole = random_kv(SIG, 500, seed=41)
    await tx.send(rx.name, whole.slice(0, 300), medium="int8")
    assert (await rx.receive(timeout=5)).kv.fidelity < 1.0
    grown = whole.slice(0, 400)
    report = await tx.send(rx.name, grown, medium="delta+full")
    got = await rx.receive(timeout=5)
    assert got.kv.equal(grown), "a lossless medium delivered a lossy prefix"
    assert report.medium == "full" and report.fidelity == 1.0 and got.kv.fidelity == 1.0
    # The receiver now holds a lossless base: a delta sends only the new part, still bit-exact.
    report = await tx.send(rx.name, whole, medium="delta+full")
    got = await rx.receive(timeout=5)
    assert report.medium == "delta+full" and report.nbytes < 0.4 * whole.nbytes
    assert got.kv.equal(whole) and report.fidelity == 1.0
    # A lossy delta over a lossy base, asked for: lossy, and the report says so.
    other = random_kv(SIG, 400, seed=42)
    await tx.send(rx.name, other.slice(0, 300), medium="int8")
    base_fidelity = (await rx.receive(timeout=5)).kv.fidelity
    report = await tx.send(rx.name, other, medium="delta+int8")
    got = await rx.receive(timeout=5)
    assert report.medium == "delta+int8" and report.nbytes < 0.3 * other.nbytes
    assert report.fidelity <= base_fidelity < 1.0
    assert got.kv.fidelity == pytest.approx(report.fidelity)
    # Left to the scheduler after a lossy send, the context arrives as lossless as its medium says.
    await tx.send(rx.name, other.slice(0, 300), medium="int8")
    await rx.receive(timeout=5)
    report = await tx.send(rx.name, other)
    got = await rx.receive(timeout=5)
    if get_codec(report.medium).is_lossless:
        assert got.kv.equal(other) and report.fidelity == 1.0
    assert got.kv.fidelity == pytest.approx(report.fidelity)


# -- 8: NaN and inf ------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


async def test_nan_and_inf_are_refused_by_lossy_media_and_carried_exactly_otherwise(nats_url: str, bus: Bus) -> None:
    """Finding 8: int8 and int4 silently corrupted a KV holding NaN or inf while its fidelity said
    0.99. A lossy medium the caller asks for refuses it (`NonFiniteValues`); when the scheduler
    chose the lossy medium, the bus sends the context with `full`, which carries it bit for bit."""
    group = f"g-int8-{time.monotonic_ns()}"
    config = SchedulerConfig(max_active=4)
    sched = await GroupScheduler.connect(
        nats_url, group, config=config, policy=make_policy(config, StaticSelector(default="int8"))
    )
    other = await Bus.connect(nats_url, config=FAST)
    try:
        tx = await bus.agent(f"nan-tx-{time.monotonic_ns()}", group=group, signature=SIG)
        rx = await other.agent(f"nan-rx-{time.monotonic_ns()}", group=group, signature=SIG)
        kv = random_kv(SIG, 64, seed=5)
        kv.keys[1][0, 2, 10, 7] = float("nan")
        kv.values[3][0, 0, 63, 0] = float("-inf")
        for medium in ("int8", "int4", "delta+int8", "lowrank(8)"):
            with pytest.raises(NonFiniteValues, match="NaN or infinite"):
                await tx.send(rx.name, kv, medium=medium)
        finite = random_kv(SIG, 64, seed=6)
        assert (await tx.send(rx.name, finite)).medium == "int8"  # what this scheduler picks
        await rx.receive(timeout=5)
        report = await tx.send(rx.name, kv)
        got = await rx.receive(timeout=5)
        assert report.medium == "full" and report.fidelity == 1.0
        for a, b in zip((*got.kv.keys, *got.kv.values), (*kv.keys, *kv.values)):
            assert torch.equal(_bits(a), _bits(b))
    finally:
        await other.close()
        await sched.close()


# -- 9: dtype against the signature ----------------------------------------------------------------------


async def test_a_kv_in_another_dtype_than_its_signature_is_refused_on_send_and_on_receive(
    pair: tuple[Any, Any, Bus], bus: Bus
) -> None:
    """Finding 9: a KV whose dtype differs from its model signature's was sent and delivered. The
    sender refuses it; a receiver refuses such a payload from anyone else (`DECODE_FAILED`)."""
    tx, rx, _ = pair
    kv32 = random_kv(SIG, 8, seed=1).to(torch.float32)  # the signature still says bfloat16
    with pytest.raises(SignatureMismatch, match="bfloat16"):
        await tx.send(rx.name, kv32, medium="full")
    encoded = get_codec("full").encode(kv32)
    source = ChunkSource(encoded.buffers, 1 << 20)
    from kvbus.bus.chunking import chunk_digest

    digest = tree_digest([chunk_digest(source.chunk(i)) for i in range(source.n_chunks)], source.total)
    forged = Open(
        transfer_id="d" * 32,
        src=tx.name,
        codec="full",
        meta=encoded.meta,
        sizes=encoded.sizes,
        total=encoded.nbytes,
        chunk_size=1 << 20,
        n_chunks=source.n_chunks,
        digest=digest,
        window=16,
        data_subject="-",
        ack_subject="-",
        inline=True,
    )
    reply = await Rogue(bus, tx.name).ask(rx.name, forged.frame(b"".join(bytes(b) for b in encoded.buffers)))
    assert not reply.ok and reply.code is Reason.DECODE_FAILED and "bfloat16" in reply.reason
    with pytest.raises(ReceiveTimeout):
        await rx.receive(timeout=0.3)


async def test_a_receiver_whose_model_computes_in_another_dtype_gets_the_kv_cast(bus: Bus, nats_url: str) -> None:
    """Compatible models in other float dtypes: the KV arrives in the receiver's, signature and all."""
    other = await Bus.connect(nats_url, config=FAST)
    try:
        tx = await bus.agent(f"cast-tx-{time.monotonic_ns()}", signature=SIG)
        rx = await other.agent(f"cast-rx-{time.monotonic_ns()}", signature=dataclasses.replace(SIG, dtype="float32"))
        kv = random_kv(SIG, 16, seed=2)
        await tx.send(rx.name, kv, medium="full")
        got = (await rx.receive(timeout=5)).kv
        assert got.dtype == torch.float32 and got.signature.dtype == "float32"
        assert all(torch.equal(a, b.float()) for a, b in zip(got.keys, kv.keys))
        got.validate(rx.signature, dtype=True)
    finally:
        await other.close()


# -- 12: deliveries never alias what the receiver keeps ------------------------------------------------------


@pytest.mark.parametrize("n_tokens", [100, 300], ids=["0.4MB-copied-inline", "1.2MB-copied-in-a-thread"])
async def test_editing_a_delivery_in_place_does_not_change_the_next_delta(
    pair: tuple[Any, Any, Bus], n_tokens: int
) -> None:
    """Finding 12: a delivered KV shared storage with the receiver's delta base, so editing it in
    place changed what the next delta was joined to. The receiver keeps a private copy."""
    tx, rx, _ = pair
    whole = random_kv(SIG, n_tokens + 100, seed=51)
    await tx.send(rx.name, whole.slice(0, n_tokens), medium="full")
    got = await rx.receive(timeout=5)
    for t in (*got.kv.keys, *got.kv.values):
        t.zero_()  # the application's to edit
    got.kv.tokens.zero_()
    report = await tx.send(rx.name, whole, medium="delta+full")
    assert report.medium == "delta+full"
    assert (await rx.receive(timeout=5)).kv.equal(whole)


# -- 13: an agent that closes says so --------------------------------------------------------------------------


async def test_a_closing_agent_says_it_leaves_within_a_bounded_time(
    bus: Bus, nats_url: str, fresh_nats: NatsServer
) -> None:
    """Finding 13 (agent side): `close` publishes `AgentLeave` on the agent's own leave subject; and
    closes within a bounded time when the server is gone."""
    name = f"leaver-{time.monotonic_ns()}"
    heard: list[AgentLeave] = []

    async def record(msg: Any) -> None:
        heard.append(AgentLeave.decode(msg.data))

    sub = await bus.transport.subscribe(sched_subject("default", "leave", name), record)
    await bus.transport.flush()
    other = await Bus.connect(nats_url, config=FAST)
    try:
        agent = await other.agent(name, signature=SIG)
        await agent.close()
        await _until(lambda: heard, "the leave message")
        assert [(m.agent, m.group) for m in heard] == [(name, "default")]
    finally:
        await sub.unsubscribe()
        await other.close()
    server = fresh_nats  # stopped under the agent
    try:
        lonely = await Bus.connect(server.url, config=FAST, max_reconnect_attempts=-1)
        await lonely.agent("lonely", signature=SIG)
    finally:
        server.stop()
    await asyncio.wait_for(lonely.close(), 30)  # no server to hear it: closes all the same


@pytest.mark.usefixtures("nats_only")
async def test_a_forged_ack_naming_another_receiver_is_dropped(pair: tuple[Any, Any, Bus], bus: Bus) -> None:
    """The sender takes an ack's receiver from the subject: one on another agent's ack subject
    that names the real receiver does not complete the transfer."""
    tx, rx, _ = pair
    forged: list[str] = []

    class Forger(TransportWrapper):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def publish(self, subject: str, payload: Any, headers: dict[str, str] | None = None) -> None:
            if headers and CHUNK_INDEX_HEADER in headers:
                tid = subject.rsplit(".", 1)[-1]
                if not forged:
                    forged.append(tid)
                    done = Ack(transfer_id=tid, rx=rx.name, next=99, received=99, done=True, ok=True)
                    await bus.transport.publish(ack_subject(tx.name, "mallory"), done.encode())
                    await bus.transport.flush()
                return  # no chunk ever reaches the receiver
            await self.inner.publish(subject, payload, headers)

    tx.transport = Forger(tx.transport)
    with pytest.raises(TransferError):
        await tx.send(rx.name, kv_of_bytes(SIG, 4 * MB, seed=3), medium="full")
    assert forged
    with pytest.raises(ReceiveTimeout):
        await rx.receive(timeout=0.3)
