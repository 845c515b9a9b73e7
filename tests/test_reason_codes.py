"""Every refusal the group scheduler and the coordinator send carries the fitting `Reason` code.

Real nats-server, a real scheduler and coordinator; the requests are sent raw (as an agent would
send them) so that each refusal can be provoked exactly. No timing is asserted: where an agent must
be down, the test waits past a short probe TTL and then checks what the scheduler answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvbus.app.local import NatsServer
from kvbus.coordinator import Coordinator, CoordinatorConfig
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig
from kvbus.net.buckets import key_value
from kvbus.net.transport import NatsTransport
from kvbus.protocol import (
    AGENTS_BUCKET,
    COORD_RESERVE,
    AgentRecord,
    FlowReservation,
    Grant,
    Probe,
    Reason,
    RequestAck,
    ReservationReply,
    ReservationRequest,
    TransferRequest,
    decode_message,
    sched_subject,
)
from kvbus.signature import ModelSignature
from tests.peer import SIG

OTHER = ModelSignature("other-model", n_layers=2, n_kv_heads=2, head_dim=32, dtype="float16", vocab_size=1000)
TTL = 0.3
_ids = itertools.count()


@contextlib.asynccontextmanager
async def scheduled(url: str, **config: Any) -> AsyncIterator[tuple[GroupScheduler, NatsTransport, str]]:
    """A scheduler for a fresh group and a raw connection to speak for its agents."""
    group = f"codes{next(_ids)}"
    sched = await GroupScheduler.connect(url, group, config=SchedulerConfig(probe_ttl_s=TTL, **config))
    raw = await NatsTransport.connect(url)
    try:
        yield sched, raw, group
    finally:
        await raw.close()
        await sched.close()


async def register(raw: NatsTransport, name: str, group: str, signature: ModelSignature | None = SIG) -> None:
    """Put an agent's record in the directory (as `Bus.agent` does)."""
    bucket = await key_value(raw.nc.jetstream(), AGENTS_BUCKET)
    record = AgentRecord(name, group, "agent", 1.0, signature.to_dict() if signature else None)
    await bucket.put(name, record.encode())


async def probe(raw: NatsTransport, name: str, group: str) -> None:
    await raw.publish(sched_subject(group, "probe", name), Probe(name, group, 0, 0, 0.0, 1.0).encode())
    await raw.flush()


async def ask(
    raw: NatsTransport, group: str, src: str, dst: list[str], *, on: str | None = None, medium: str | None = None
) -> RequestAck | Grant:
    """Send a transfer request as ``on`` (default ``src``) and decode the scheduler's reply."""
    req = TransferRequest(
        transfer_id=f"t{next(_ids)}",
        src=src,
        dst=dst,
        group=group,
        n_tokens=16,
        nbytes=16 * SIG.kv_bytes_per_token(),
        signature=SIG.to_dict(),
        medium=medium,
    )
    data = await raw.request(sched_subject(group, "request", on or src), req.encode(), timeout=5.0)
    return decode_message(data, RequestAck, Grant)


def refused(answer: RequestAck | Grant) -> Reason:
    """The code of a refusal (a refused RequestAck, or a Grant without a medium)."""
    if isinstance(answer, RequestAck):
        assert not answer.ok, answer
    else:
        assert not answer.medium, answer
    assert answer.reason  # and a sentence for people
    return answer.code


async def test_malformed_and_wrong_sender_requests(nats_url: str) -> None:
    async with scheduled(nats_url) as (_, raw, group):
        data = await raw.request(sched_subject(group, "request", "tx"), b"\x00not msgpack", timeout=5.0)
        answer = RequestAck.decode(data)
        assert refused(answer) == Reason.MALFORMED
        await register(raw, "rx", group)
        assert refused(await ask(raw, group, "tx", ["not a name!"])) == Reason.MALFORMED
        assert refused(await ask(raw, group, "tx", ["rx"], on="mallory")) == Reason.WRONG_SENDER


async def test_unknown_receiver(nats_url: str) -> None:
    async with scheduled(nats_url) as (_, raw, group):
        answer = await ask(raw, group, "tx", ["nobody-registered-this"])
        assert isinstance(answer, RequestAck) and refused(answer) == Reason.UNKNOWN_RECEIVER


async def test_receiver_and_sender_down(nats_url: str) -> None:
    async with scheduled(nats_url) as (_, raw, group):
        for name in ("tx", "rx", "tx2", "rx2"):
            await register(raw, name, group)
        await probe(raw, "rx", group)  # then silent: down once TTL passes
        await probe(raw, "tx2", group)
        await asyncio.sleep(2 * TTL)
        # The first pass after the TTL marks them down and refuses the queued request in its grant ...
        first = await ask(raw, group, "tx", ["rx"])
        assert isinstance(first, Grant) and refused(first) == Reason.RECEIVER_DOWN
        # ... later requests are refused on arrival.
        again = await ask(raw, group, "tx", ["rx"])
        assert isinstance(again, RequestAck) and refused(again) == Reason.RECEIVER_DOWN

    async with scheduled(nats_url) as (sched, raw, group):
        for name in ("tx2", "rx2"):
            await register(raw, name, group)
            await probe(raw, name, group)
        await asyncio.sleep(2 * TTL)  # both silent past the TTL
        # A request is proof of life, like a probe (issue 29: a sender whose event loop was held
        # past the TTL was refused as "down" while it was asking): the refusal names the receiver,
        # which is silent, and the sender is up.
        assert refused(await ask(raw, group, "tx2", ["rx2"])) == Reason.RECEIVER_DOWN
        assert not sched.state.is_down("tx2")
        await probe(raw, "rx2", group)
        await asyncio.sleep(0.05)
        answer = await ask(raw, group, "tx2", ["rx2"])
        assert answer.medium if isinstance(answer, Grant) else answer.ok, answer


@pytest.mark.parametrize("selector", ["adaptive", "static"])
async def test_incompatible_receiver_and_unknown_codec(nats_url: str, selector: str) -> None:
    async with scheduled(nats_url, selector=selector) as (_, raw, group):
        await register(raw, "rx-other", group, OTHER)
        await register(raw, "rx-same", group, SIG)
        answer = await ask(raw, group, "tx", ["rx-other"], medium="full")
        assert isinstance(answer, Grant) and refused(answer) == Reason.INCOMPATIBLE
        answer = await ask(raw, group, "tx", ["rx-same"], medium="no-such-codec")
        assert isinstance(answer, Grant) and refused(answer) == Reason.UNKNOWN_CODEC
        granted = await ask(raw, group, "tx", ["rx-same"], medium="full")
        assert isinstance(granted, Grant) and granted.medium == "full" and granted.code == Reason.NONE


async def reserve(
    raw: NatsTransport, group: str, src: str, *, on: str | None = None, **fields: Any
) -> ReservationReply:
    msg = FlowReservation(
        **{
            "reservation_id": f"r{next(_ids)}",
            "src": src,
            "dst": ["rx"],
            "group": group,
            "period_s": 1.0,
            "size_bytes": 1000,
            "deadline_s": 0.5,
            **fields,
        }
    )
    data = await raw.request(sched_subject(group, "reserve", on or src), msg.encode(), timeout=5.0)
    return ReservationReply.decode(data)


async def test_reservation_refusals_of_the_scheduler(nats_url: str) -> None:
    async with scheduled(nats_url, bandwidth_bps=1e6) as (_, raw, group):
        ok = await reserve(raw, group, "tx")
        assert ok.ok and ok.code == Reason.NONE
        assert (await reserve(raw, group, "tx", size_bytes=10**9)).code == Reason.REFUSED
        assert (await reserve(raw, group, "tx", deadline_s=5.0)).code == Reason.MALFORMED
        assert (await reserve(raw, group, "tx", dst=[])).code == Reason.MALFORMED
        assert (await reserve(raw, group, "tx", on="mallory")).code == Reason.WRONG_SENDER
        assert (await reserve(raw, group, "tx", reservation_id="never-made", cancel=True)).code == Reason.NOT_FOUND
        gone = await reserve(raw, group, "tx", reservation_id=ok.reservation_id, cancel=True)
        assert gone.ok and gone.code == Reason.NONE


async def test_coordinator_refusals(fresh_nats: NatsServer) -> None:
    url = fresh_nats.url
    # Without a coordinator, a deployment-wide admission cannot be made.
    async with scheduled(url, admission="coordinator") as (sched, raw, _):
        verdict = await sched.reserve("tx", ["rx"], period_s=1.0, size_bytes=1000, deadline_s=0.5)
        assert not verdict.ok and verdict.code == Reason.UNAVAILABLE
        coord = await Coordinator.connect(url, config=CoordinatorConfig(capacity_bps=1000.0, leader_ttl_s=0.6))
        try:

            async def coordinate(payload: bytes) -> ReservationReply:
                return ReservationReply.decode(await raw.request(COORD_RESERVE, payload, timeout=5.0))

            assert (await coordinate(b"\x93junk")).code == Reason.MALFORMED
            bad = ReservationRequest("c1", "g", "w", period_s=1.0, size_bytes=100, deadline_s=2.0)
            assert (await coordinate(bad.encode())).code == Reason.MALFORMED
            big = ReservationRequest("c2", "g", "w", period_s=1.0, size_bytes=10_000, deadline_s=0.5)
            assert (await coordinate(big.encode())).code == Reason.REFUSED
            fits = ReservationRequest("c3", "g", "w", period_s=1.0, size_bytes=100, deadline_s=0.5)
            assert (await coordinate(fits.encode())).code == Reason.NONE
            # The scheduler passes the coordinator's code on.
            verdict = await sched.reserve("tx", ["rx"], period_s=1.0, size_bytes=10_000, deadline_s=0.5)
            assert not verdict.ok and verdict.code == Reason.REFUSED
        finally:
            await coord.close()
