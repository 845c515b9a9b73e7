"""The group scheduler under hostile or departing agents (issue 18, findings 5, 10, 13 and the
tokens-to-a-receiver-without-a-model case): real nats-server, real schedulers, real agents.

Nothing here asserts a time: the stall test counts the grants given while a hostile request
waits for its directory lookups (which it cannot finish until the test lets it), the cost tests
count the directory lookups a request causes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvbus.bus import Bus, EmulatedLink, ReceiverGone, TransferError
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig
from kvbus.group_scheduler.cost_model import Endpoint, Link
from kvbus.protocol import AgentLeave, Grant, Reason, RequestAck, TransferRequest, decode_message, sched_subject
from tests.conftest import FAST
from tests.kvutil import kv_of_bytes, random_kv
from tests.peer import SIG
from tests.test_selection import COSTS, FIGS, MEDIA, SMOL, model


@contextlib.asynccontextmanager
async def stack(
    nats_url: str, group: str, n_buses: int = 2, **config: Any
) -> AsyncIterator[tuple[GroupScheduler, list[Bus]]]:
    """A scheduler of ``group`` and ``n_buses`` buses with short timeouts."""
    sched = await GroupScheduler.connect(nats_url, group, config=SchedulerConfig(**config))
    buses = [await Bus.connect(nats_url, config=FAST) for _ in range(n_buses)]
    try:
        yield sched, buses
    finally:
        for b in buses:
            await b.close()
        await sched.close()


async def until(predicate: Any, what: str, timeout: float = 20.0) -> None:
    """Wait for ``predicate`` (the timeout only ends a test that would otherwise hang)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def raw_request(
    bus: Bus, group: str, src: str, dst: list[str], *, timeout: float = 10.0, **fields: Any
) -> RequestAck | Grant:
    """A transfer request as a misbehaving client sends it (any sender name, any numbers)."""
    req = TransferRequest(
        transfer_id=fields.pop("transfer_id", f"{src}-{time.monotonic_ns()}"),
        src=src,
        dst=dst,
        group=group,
        n_tokens=fields.pop("n_tokens", 4),
        nbytes=fields.pop("nbytes", 4 * SIG.kv_bytes_per_token()),
        signature=SIG.to_dict(),
        **fields,
    )
    data = await bus.transport.request(sched_subject(group, "request", src), req.encode(), timeout=timeout)
    return decode_message(data, RequestAck, Grant)


class GatedBucket:
    """The scheduler's real directory bucket, counting its lookups; while ``gate`` is clear a
    lookup waits (as a directory that does not answer would)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.gets = 0
        self.gate = asyncio.Event()
        self.gate.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def get(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self.gets += 1
        await self.gate.wait()
        return await self.inner.get(key, *args, **kwargs)


async def gate_directory(sched: GroupScheduler, *known: str) -> GatedBucket:
    """Wrap the scheduler's directory bucket once the watch has delivered ``known``."""
    await until(lambda: all(sched.directory.cached(a) is not None for a in known), f"the directory watch ({known})")
    gated = GatedBucket(await sched.directory.bucket())
    sched.directory._bucket = gated
    return gated


# -- finding 5: one request must not stall the group ------------------------------------------------------


async def test_a_request_waiting_for_its_lookups_holds_up_no_other_grant(nats_url: str) -> None:
    """A request naming receivers the cache does not know waits for its directory lookups aside:
    while its lookups cannot finish, every other agent's transfer is granted and delivered."""
    async with stack(nats_url, "g-stall", admit_timeout_s=120.0) as (sched, (a, b)):
        tx = await a.agent("stall-tx", group="g-stall", signature=SIG)
        rx = await b.agent("stall-rx", group="g-stall", signature=SIG)
        gated = await gate_directory(sched, "stall-rx")
        gated.gate.clear()
        names = [f"stall-nobody-{i}" for i in range(10)]
        hostile = asyncio.create_task(raw_request(a, "g-stall", "stall-mallory", names, timeout=120))
        await until(lambda: gated.gets == len(names), "the hostile request's lookups")
        kv = random_kv(SIG, 4)
        delivered = 0
        for _ in range(5):
            report = await tx.send("stall-rx", kv, medium="full")
            assert (await rx.receive(timeout=10)).transfer_id == report.transfer_id
            delivered += 1
        assert delivered == 5 and not hostile.done(), "other grants waited for the hostile request"
        assert gated.gets == len(names), "the hostile request looked its receivers up more than once"
        gated.gate.set()
        ack = await hostile
        assert isinstance(ack, RequestAck) and ack.code == Reason.UNKNOWN_RECEIVER, ack


async def test_what_one_request_may_cost_is_bounded(nats_url: str) -> None:
    """60,000 receivers: refused at once (TOO_LARGE), no lookup. 200 unknown ones (more than one
    lookup batch): refused with no lookup. 10 unknown ones: one batch of 10 lookups. A directory
    that does not answer: refused (UNAVAILABLE) once the admission time bound is over."""
    async with stack(nats_url, "g-cost", n_buses=1, admit_timeout_s=0.5) as (sched, (a,)):
        tx = await a.agent("cost-tx", group="g-cost", signature=SIG)
        rx = await a.agent("cost-rx", group="g-cost", signature=SIG)
        gated = await gate_directory(sched, "cost-rx")

        ack = await raw_request(a, "g-cost", "cost-mallory", [f"n{i}" for i in range(60_000)])
        assert isinstance(ack, RequestAck) and ack.code == Reason.TOO_LARGE, ack
        assert "60000 receivers" in ack.reason and gated.gets == 0

        ack = await raw_request(a, "g-cost", "cost-mallory", [f"cost-nobody-{i}" for i in range(200)])
        assert isinstance(ack, RequestAck) and ack.code == Reason.UNKNOWN_RECEIVER, ack
        assert "and 192 more" in ack.reason and gated.gets == 0

        ack = await raw_request(a, "g-cost", "cost-mallory", [*(f"cost-nobody-{i}" for i in range(10)), "cost-rx"])
        assert isinstance(ack, RequestAck) and ack.code == Reason.UNKNOWN_RECEIVER, ack
        assert gated.gets == 10  # the unknown names, once each, together; the known one from the cache

        gated.gate.clear()
        ack = await raw_request(a, "g-cost", "cost-mallory", ["cost-nobody-x"])
        assert isinstance(ack, RequestAck) and ack.code == Reason.UNAVAILABLE, ack
        assert "admit_timeout_s" in ack.reason
        gated.gate.set()

        kv = random_kv(SIG, 4)
        report = await tx.send("cost-rx", kv, medium="full")
        assert (await rx.receive(timeout=10)).transfer_id == report.transfer_id
        assert sched.state.granted >= 1 and not sched._admitting


def test_max_receivers_is_a_setting() -> None:
    assert SchedulerConfig().max_receivers == 256
    assert SchedulerConfig.from_env(max_receivers=8).max_receivers == 8


# -- finding 10: numbers from the wire ------------------------------------------------------------------------


async def test_a_nan_deadline_is_refused_and_the_loop_keeps_granting(nats_url: str) -> None:
    """NaN, infinite and negative deadlines, and absurd sizes, to a real receiver: each refused with
    MALFORMED at once, none queued; the scheduling loop keeps granting everyone else."""
    async with stack(nats_url, "g-nan", n_buses=1) as (sched, (a,)):
        tx = await a.agent("nan-tx", group="g-nan", signature=SIG)
        rx = await a.agent("nan-rx", group="g-nan", signature=SIG)
        await until(lambda: sched.directory.cached("nan-rx") is not None, "the directory watch")
        hostile: list[dict[str, Any]] = [
            {"deadline": math.nan},
            {"deadline": math.inf},
            {"deadline": -math.inf},
            {"deadline": -1.0},
            {"fidelity": math.nan},
            {"ts": math.nan},
            {"n_tokens": 2**64 - 1},
            {"nbytes": -1},
        ]
        for fields in hostile:
            ack = await raw_request(a, "g-nan", "nan-mallory", ["nan-rx"], **fields)
            assert isinstance(ack, RequestAck) and not ack.ok and ack.code == Reason.MALFORMED, (fields, ack)
            assert next(iter(fields)) in ack.reason
        assert not sched.state.queue and not sched.state.active
        before = sched.state.granted
        kv = random_kv(SIG, 4)
        for _ in range(3):
            report = await tx.send("nan-rx", kv, medium="full", deadline=5.0)
            assert (await rx.receive(timeout=10)).transfer_id == report.transfer_id
        assert sched.state.granted == before + 3


# -- finding 13: an agent that closes says so ----------------------------------------------------------------


async def _leave(bus: Bus, group: str, agent: str, *, subject_agent: str | None = None) -> None:
    """Publish the leave message the bus publishes when an agent closes."""
    msg = AgentLeave(agent=agent, group=group)
    await bus.transport.publish(sched_subject(group, "leave", subject_agent or agent), msg.encode())
    await bus.transport.flush()


async def test_an_agent_that_leaves_is_dropped_at_once(nats_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """The scheduler drops a departing agent at once: its queued transfers are refused
    (the sender raises `ReceiverGone`), new ones too, the departure is logged at INFO and it is
    never "marked down"; a leave on another agent's subject is ignored; a new agent of the same
    name is served at once."""
    caplog.set_level(logging.INFO, logger="kvbus.group_scheduler")
    async with stack(nats_url, "g-leave", probe_ttl_s=2.0, per_pair=1) as (sched, (a, b)):
        tx = await a.agent("leave-tx", group="g-leave", signature=SIG)
        other = await a.agent("leave-other", group="g-leave", signature=SIG)
        rx = await b.agent("leave-rx", group="g-leave", signature=SIG, link=EmulatedLink(2e6))
        await until(lambda: {"leave-tx", "leave-rx"} <= set(sched.state.agents), "their probes")
        await until(lambda: sched.directory.cached("leave-rx") is not None, "the directory watch")

        # A leave on someone else's subject changes nothing.
        await _leave(a, "g-leave", "leave-tx", subject_agent="leave-mallory")
        await asyncio.sleep(0.2)
        assert "leave-tx" in sched.state.agents and "leave-tx" not in sched.state.left

        # One transfer to rx running (8 MB at 2 MB/s), one queued behind it (one per pair).
        running = asyncio.create_task(tx.send("leave-rx", kv_of_bytes(SIG, 8 << 20, seed=1), medium="full"))
        await until(lambda: len(sched.state.active) == 1, "the first grant")
        queued = asyncio.create_task(tx.send("leave-rx", kv_of_bytes(SIG, 1 << 20, seed=2), medium="full"))
        await until(lambda: len(sched.state.queue) == 1, "the second request")

        await _leave(b, "g-leave", "leave-rx")
        await until(lambda: "leave-rx" in sched.state.left, "the leave")
        assert "leave-rx" not in sched.state.agents and not sched.state.active and not sched.state.queue
        await rx.close()
        with pytest.raises(ReceiverGone) as gone:
            await queued
        assert "left the group" in str(gone.value)
        with pytest.raises(TransferError):
            await running
        with pytest.raises(ReceiverGone, match="left the group"):
            await tx.send("leave-rx", random_kv(SIG, 4), medium="full")

        # Past the probe TTL: a pass runs (another transfer), nobody is marked down.
        await asyncio.sleep(2.5)
        kv = random_kv(SIG, 4)
        await other.send("leave-tx", kv, medium="full")
        assert (await tx.receive(timeout=10)).kv.equal(kv)
        left = [r for r in caplog.records if "leave-rx left" in r.getMessage()]
        assert left and all(r.levelno == logging.INFO for r in left), [r.getMessage() for r in left]
        assert not [r for r in caplog.records if "marked down" in r.getMessage()], "a departed agent was marked down"

        # The name comes back: served at once (its new record is newer than its leave).
        back = await b.agent("leave-rx", group="g-leave", signature=SIG)
        kv = random_kv(SIG, 6, seed=3)
        report = await tx.send("leave-rx", kv, medium="full")
        got = await back.receive(timeout=10)
        assert got.transfer_id == report.transfer_id and got.kv.equal(kv)
        assert "leave-rx" not in sched.state.left


# -- tokens only to receivers that can recompute ---------------------------------------------------------------


async def test_a_receiver_without_a_model_gets_kv_not_tokens(nats_url: str) -> None:
    """On a slow link a short context is cheapest as tokens, but a receiver with no model runner
    cannot rebuild the KV from them: it gets a KV medium, unless the sender insists on tokens."""
    async with stack(nats_url, "g-norun") as (_, (a, b)):
        tx = await a.agent("norun-tx", group="g-norun", signature=SIG)
        rx = await b.agent("norun-rx", group="g-norun", signature=SIG, link=EmulatedLink(256e3))
        kv = random_kv(SIG, 64)
        report = await tx.send("norun-rx", kv)
        got = await rx.receive(timeout=30)
        assert report.medium != "tokens" and got.kv.keys and got.kv.n_tokens == 64
        candidates = {c["medium"]: c for c in report.decision["candidates"]}
        tokens = candidates["tokens"]
        assert tokens["why_not"] == "receiver cannot recompute (no model runner)" and tokens["total_s"] is None
        # The cost model would have picked tokens: it is predicted faster than what was chosen.
        assert tokens["comm_s"] + tokens["comp_s"] + tokens["loss_s"] < report.decision["predicted_s"]
        # A sender that insists gets what it asked for.
        report = await tx.send("norun-rx", kv, medium="tokens")
        assert report.medium == "tokens"
        await rx.receive(timeout=30)


def test_cost_model_keeps_tokens_from_a_receiver_that_cannot_recompute() -> None:
    """Deterministic: the same short context on the same slow link goes as tokens to a receiver
    that can recompute and as KV to one that cannot (unless asked for tokens)."""

    m = model()
    common = dict(n_tokens=128, kv_bytes=128 * SMOL.kv_bytes_per_token(), link=Link(1.25e6))
    sender = Endpoint(SMOL, model=COSTS)
    assert m.choose(MEDIA, sender=sender, receiver=Endpoint(SMOL, model=COSTS), **common).medium == "tokens"
    blind = Endpoint(SMOL, model=COSTS, recompute=False)
    chosen = m.choose(MEDIA, sender=sender, receiver=blind, **common).medium
    assert FIGS[chosen].needs_kv
    assert m.choose(["tokens"], sender=sender, receiver=blind, requested=True, **common).medium == "tokens"
    # A context without KV (tokens only): nothing is held back.
    bare = {**common, "kv_bytes": 0}
    able = Endpoint(SMOL, model=COSTS)
    assert m.choose(MEDIA, sender=sender, receiver=blind, **bare) == m.choose(
        MEDIA, sender=sender, receiver=able, **bare
    )
    # A receiver of another model without a runner: tokens are all it can take.
    other = Endpoint(None, model=COSTS, recompute=False)
    assert m.choose(MEDIA, sender=sender, receiver=other, **common).medium in ("tokens", "summary")
