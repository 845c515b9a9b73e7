"""Typed reason codes on the bus: every refusal a receiver sends carries a `Reason`, the sender's
`TransferRejected` has it in ``code``, and the delta fallback is driven by the code, not the text."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvbus.bus import Bus, BusConfig, EmulatedLink, Reason, ReceiveTimeout, TransferRejected
from kvbus.bus.chunking import digests_root
from kvbus.net.transport import TransportWrapper
from kvbus.protocol import Ack, Control, Open, OpenReply, ack_subject, agent_subject, data_subject, inbox_subject
from kvbus.signature import ModelSignature
from tests.conftest import FAST
from tests.kvutil import kv_of_bytes, random_kv
from tests.peer import SIG

OTHER = ModelSignature("other-model", n_layers=2, n_kv_heads=2, head_dim=32, dtype="float32", vocab_size=100)
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


class RefuseFirstOpen(TransportWrapper):
    """Wraps the sender's transport: its first `Open` to ``rx`` never reaches ``rx`` and is
    answered with a refusal of the given code and text; later requests pass through."""

    def __init__(self, inner: Any, subject: str, code: Reason, reason: str) -> None:
        self.inner = inner
        self.subject = subject
        self.code = code
        self.reason = reason
        self.refused: list[str] = []
        """Codecs of the Opens refused."""

    async def request(self, subject: str, payload: bytes, timeout: float) -> bytes:
        if subject == self.subject and not self.refused:
            open_msg, _ = Open.unframe(payload)
            self.refused.append(open_msg.codec)
            return OpenReply(transfer_id=open_msg.transfer_id, ok=False, reason=self.reason, code=self.code).encode()
        return await self.inner.request(subject, payload, timeout=timeout)


def _open(src: str, **fields: Any) -> Open:
    base: dict[str, Any] = dict(
        transfer_id="t1",
        src=src,
        codec="tokens",
        meta={},
        sizes=[4],
        total=4,
        chunk_size=1024,
        n_chunks=1,
        digest="0" * 32,
        window=4,
        data_subject="kvbus.data.x.t1",
        ack_subject="x",
        inline=True,
    )
    base.update(fields)
    return Open(**base)


async def _ask(bus: Bus, rx: str, src: str, frame: bytes) -> OpenReply:
    return OpenReply.decode(await bus.transport.request(inbox_subject(rx, src), frame, timeout=2))


async def test_an_open_from_the_wrong_sender_is_refused_with_wrong_sender(pair: tuple[Any, Any, Bus], bus: Bus) -> None:
    tx, rx, _ = pair
    reply = await _ask(bus, rx.name, "mallory", _open(tx.name).frame(b"abcd"))
    assert not reply.ok and reply.code is Reason.WRONG_SENDER
    with pytest.raises(ReceiveTimeout):
        await rx.receive(timeout=0.3)


@pytest.mark.parametrize(
    ("fields", "payload", "code"),
    [
        ({"codec": "no-such-codec"}, b"abcd", Reason.UNKNOWN_CODEC),
        ({}, b"abcd", Reason.DIGEST_MISMATCH),
        ({}, b"abc", Reason.MALFORMED),
        ({"n_chunks": 2}, b"abcd", Reason.MALFORMED),
        (
            {
                "inline": False,
                "sizes": [2048],
                "total": 2048,
                "n_chunks": 2,
                "digests": b"\0" * 16,
                "digest": digests_root(b"\0" * 16, 2048),
                "data_subject": "kvbus.elsewhere",
            },
            b"",
            Reason.MALFORMED,
        ),
        ({"codec": "full"}, b"abcd", Reason.MALFORMED),
        ({"codec": "full", "meta": {"signature": OTHER.to_dict()}}, b"abcd", Reason.INCOMPATIBLE),
        (
            {"total": 8 << 30, "sizes": [8 << 30], "n_chunks": 8 << 20, "inline": False},
            b"",
            Reason.TOO_LARGE,
        ),
    ],
    ids=[
        "unknown-codec",
        "inline-digest",
        "inline-size",
        "chunk-plan",
        "hostile-subject",
        "no-signature",
        "incompatible-model",
        "too-large",
    ],
)
async def test_every_open_refusal_carries_its_code(
    pair: tuple[Any, Any, Bus], bus: Bus, fields: dict[str, Any], payload: bytes, code: Reason
) -> None:
    tx, rx, _ = pair
    reply = await _ask(bus, rx.name, tx.name, _open(tx.name, **fields).frame(payload))
    assert not reply.ok and reply.code is code, reply.reason
    kv = random_kv(SIG, 3)
    await tx.send(rx.name, kv, medium="full")  # the receiver keeps working
    assert (await rx.receive(timeout=5)).kv.equal(kv)


@pytest.mark.parametrize(
    "split",
    [
        {"prefix": 5, "batch": 1, "ids": b"\0"},
        {"prefix": 5, "batch": 1, "ids": "not bytes"},
        {"prefix": 1 << 40, "batch": 1, "ids": b""},
        {"prefix": 2, "batch": 0, "ids": b"\0" * 8},
        "not a map",
    ],
    ids=["short-ids", "ids-not-bytes", "absurd-prefix", "no-rows", "not-a-map"],
)
async def test_a_split_open_whose_prefix_is_malformed_is_refused_before_any_chunk(
    pair: tuple[Any, Any, Bus], bus: Bus, split: Any
) -> None:
    """A streamed ``split`` Open names the prefix its receiver prefills while the chunks come: a
    malformed one is refused when it arrives (no prefill starts, no subscription is left)."""
    tx, rx, _ = pair
    frame = _open(
        tx.name,
        codec="split+full",
        meta={"signature": SIG.to_dict(), "split": split},
        inline=False,
        sizes=[2048],
        total=2048,
        n_chunks=2,
        digests=b"\0" * 16,
        digest=digests_root(b"\0" * 16, 2048),
        data_subject=data_subject(rx.name, tx.name, "t1"),
        ack_subject=ack_subject(tx.name, rx.name),
    ).frame(b"")
    reply = await _ask(bus, rx.name, tx.name, frame)
    assert not reply.ok and reply.code is Reason.MALFORMED, reply.reason
    assert "split" in reply.reason
    kv = random_kv(SIG, 3)
    await tx.send(rx.name, kv, medium="full")  # the receiver keeps working
    assert (await rx.receive(timeout=5)).kv.equal(kv)


async def test_a_malformed_open_is_refused_with_malformed(pair: tuple[Any, Any, Bus], bus: Bus) -> None:
    tx, rx, _ = pair
    reply = await _ask(bus, rx.name, tx.name, b"\x00\x00\x00\x05junk!")
    assert not reply.ok and reply.code is Reason.MALFORMED


async def test_the_senders_error_carries_the_receivers_code(bus: Bus, nats_url: str) -> None:
    small = await Bus.connect(nats_url, config=BusConfig(max_transfer_bytes=1 << 20, request_timeout=2))
    try:
        await small.agent("rx-small-code", signature=SIG)
        tx = await bus.agent("tx-big-code", signature=SIG)
        with pytest.raises(TransferRejected) as info:
            await tx.send("rx-small-code", kv_of_bytes(SIG, 4 * MB), medium="full")
        assert info.value.code is Reason.TOO_LARGE and info.value.by == "rx-small-code"
    finally:
        await small.close()


async def test_a_delta_base_mismatch_code_triggers_the_whole_resend(pair: tuple[Any, Any, Bus]) -> None:
    tx, rx, _ = pair
    whole = random_kv(SIG, 400, seed=31)
    await tx.send(rx.name, whole.slice(0, 300), medium="full")
    await rx.receive(timeout=5)
    # The refusal's text says nothing of a delta: only its code can trigger the resend.
    forged = RefuseFirstOpen(tx.transport, inbox_subject(rx.name, tx.name), Reason.DELTA_BASE_MISMATCH, "no")
    tx.transport = forged
    report = await tx.send(rx.name, whole, medium="delta+full")
    assert forged.refused == ["delta+full"]
    assert report.medium == "full"
    assert (await rx.receive(timeout=5)).kv.equal(whole)
    with pytest.raises(ReceiveTimeout):
        await rx.receive(timeout=0.3)


async def test_a_refusal_that_only_mentions_a_delta_base_is_not_resent(pair: tuple[Any, Any, Bus]) -> None:
    tx, rx, _ = pair
    whole = random_kv(SIG, 400, seed=32)
    await tx.send(rx.name, whole.slice(0, 300), medium="full")
    await rx.receive(timeout=5)
    text = "cannot decode (DeltaBaseMismatch): delta base is gone"
    tx.transport = RefuseFirstOpen(tx.transport, inbox_subject(rx.name, tx.name), Reason.DECODE_FAILED, text)
    with pytest.raises(TransferRejected) as info:
        await tx.send(rx.name, whole, medium="delta+full")
    assert info.value.code is Reason.DECODE_FAILED
    with pytest.raises(ReceiveTimeout):
        await rx.receive(timeout=0.3)


async def test_a_streamed_delta_without_its_base_gets_the_code_in_the_final_ack(
    pair: tuple[Any, Any, Bus], bus: Bus
) -> None:
    tx, rx, other = pair
    whole = random_kv(SIG, 1000, seed=33)
    base = whole.slice(0, 100)
    await tx.send(rx.name, base, medium="full")
    await rx.receive(timeout=5)
    verdicts: list[Ack] = []

    async def record(msg: Any) -> None:
        ack = Ack.decode(msg.data)
        if ack.done:
            verdicts.append(ack)

    sub = await other.transport.subscribe(ack_subject(tx.name, rx.name), record)
    await other.transport.flush()
    try:
        rx._receiver.bases.clear()  # the receiver lost its base
        report = await tx.send(rx.name, whole, medium="delta+full")  # 900 new tokens: streamed, not inline
        assert report.medium == "full" and report.chunks > 1
        assert (await rx.receive(timeout=5)).kv.equal(whole)
        await other.transport.flush()
        assert [(a.ok, a.code) for a in verdicts][:1] == [(False, Reason.DELTA_BASE_MISMATCH)]
    finally:
        await sub.unsubscribe()


async def test_a_cancel_from_the_scheduler_fails_the_send_with_cancelled(bus: Bus, nats_url: str) -> None:
    other = await Bus.connect(nats_url, config=FAST)
    try:
        rx = await other.agent("rx-cancel", signature=SIG, link=EmulatedLink(8 * MB))  # paced: about 2 s
        tx = await bus.agent("tx-cancel", signature=SIG)
        send = asyncio.create_task(tx.send(rx.name, kv_of_bytes(SIG, 16 * MB), medium="full"))
        while not tx._sender.outgoing and not send.done():
            await asyncio.sleep(0.005)
        for tid in list(tx._sender.outgoing):
            await bus.transport.publish(agent_subject(tx.name, "ctl"), Control(tid, "cancel", reason="test").encode())
        with pytest.raises(TransferRejected) as info:
            await send
        assert info.value.code is Reason.CANCELLED and info.value.by == "scheduler"
    finally:
        await other.close()
