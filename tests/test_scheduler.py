"""The weighted scheduler end to end: real nats-server, real schedulers (one per test group),
real agents on emulated links. Timing is asserted only where a share is the point, with wide
margins."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvbus.bus import Bus, BusConfig, EmulatedLink, ReceiveTimeout, ReservationRefused, TransferRejected
from kvbus.bus.outgoing import OutgoingTransfer
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig
from kvbus.reasons import Reason
from tests.conftest import FAST
from tests.kvutil import kv_of_bytes
from tests.peer import SIG

MB = 1_000_000


@contextlib.asynccontextmanager
async def group(nats_url: str, name: str, **config: Any) -> AsyncIterator[GroupScheduler]:
    sched = await GroupScheduler.connect(nats_url, name, config=SchedulerConfig(**config))
    try:
        yield sched
    finally:
        await sched.close()


@contextlib.asynccontextmanager
async def buses(nats_url: str, n: int, **config: Any) -> AsyncIterator[list[Bus]]:
    cfg = BusConfig(
        **{
            **{
                f: getattr(FAST, f)
                for f in ("ack_timeout", "peer_timeout", "request_timeout", "grant_timeout", "partial_timeout")
            },
            **config,
        }
    )
    opened = [await Bus.connect(nats_url, config=cfg) for _ in range(n)]
    try:
        yield opened
    finally:
        for b in opened:
            await b.close()


async def outgoing(agent: Any, timeout: float = 10.0) -> OutgoingTransfer:
    """The sender's running transfer, once it has started streaming."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for out in list(agent._sender.outgoing.values()):
            return out
        await asyncio.sleep(0.002)
    raise AssertionError(f"{agent.name} never started streaming")


async def until(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


# -- weighted shares ---------------------------------------------------------------------------------


async def test_weighted_shares_end_to_end(nats_url: str) -> None:
    """Three senders saturate one receiver's 24 MB/s link; bytes follow W = 2 : 4 : 6 (within 5 %;
    runs on this machine land within 1.5 %)."""
    async with group(nats_url, "g-share"), buses(nats_url, 2) as (tx_bus, rx_bus):
        rx = await rx_bus.agent("share-rx", group="g-share", priority=0.0, signature=SIG, link=EmulatedLink(24 * MB))
        senders = [
            await tx_bus.agent(f"share-s{i}", group="g-share", priority=p, signature=SIG)
            for i, p in enumerate((0.0, 2.0, 4.0))
        ]
        kv = kv_of_bytes(SIG, 6 * MB)
        spans: dict[str, list[tuple[float, float, int]]] = {s.name: [] for s in senders}
        stop = time.monotonic() + 4.5

        async def pump(s: Any) -> None:
            while time.monotonic() < stop:
                t0 = time.monotonic()
                report = await s.send(rx.name, kv, medium="full")
                start = t0 + report.queued_s + report.encode_s
                spans[s.name].append((start, t0 + report.total_s, report.nbytes))

        async def drain() -> None:
            while True:
                await rx.receive()

        drainer = asyncio.create_task(drain())
        await asyncio.gather(*(pump(s) for s in senders))
        drainer.cancel()
        t_begin = min(sp[0][0] for sp in spans.values()) + 1.0
        t_end = stop - 0.3

        def bytes_in_window(items: list[tuple[float, float, int]]) -> float:
            total = 0.0
            for a, b, n in items:
                overlap = max(0.0, min(b, t_end) - max(a, t_begin))
                total += n * overlap / (b - a)
            return total

        got = {name: bytes_in_window(items) for name, items in spans.items()}
        total = sum(got.values())
        want = dict(zip(got, (2.0 / 12, 4.0 / 12, 6.0 / 12)))
        shares = {k: v / total for k, v in got.items()}
        assert total / (t_end - t_begin) <= 24 * MB * 1.05  # the link is shared, not multiplied
        for k in got:
            assert abs(shares[k] - want[k]) <= 0.05 * want[k], shares


# -- preemption ---------------------------------------------------------------------------------------


async def preemption_run(nats_url: str, name: str, at_fraction: float) -> tuple[OutgoingTransfer, Any, Any, Any]:
    """A 16 MB bulk transfer on a 16 MB/s link; a critical 4 MB one when the bulk is at ``at_fraction``."""
    async with group(nats_url, name) as sched, buses(nats_url, 2, chunk_size=256 * 1024) as (tx_bus, rx_bus):
        rx = await rx_bus.agent(f"{name}-rx", group=name, signature=SIG, link=EmulatedLink(16 * MB))
        bulk_tx = await tx_bus.agent(f"{name}-bulk", group=name, signature=SIG)
        crit_tx = await tx_bus.agent(f"{name}-crit", group=name, signature=SIG)
        bulk_kv = kv_of_bytes(SIG, 16 * MB, seed=1)
        crit_kv = kv_of_bytes(SIG, 4 * MB, seed=2)
        bulk = asyncio.create_task(bulk_tx.send(rx.name, bulk_kv, medium="full"))
        out = await outgoing(bulk_tx)
        await until(lambda: out.fraction_sent >= at_fraction, what=f"bulk at {at_fraction:.0%}")
        crit_report = await crit_tx.send(rx.name, crit_kv, medium="full", critical=True)
        bulk_report = await bulk
        first, second = await rx.receive(timeout=10), await rx.receive(timeout=10)
        deliveries = {first.transfer_id: first, second.transfer_id: second}
        assert deliveries[bulk_report.transfer_id].kv.equal(bulk_kv)
        assert deliveries[crit_report.transfer_id].kv.equal(crit_kv)
        return out, sched, (first, second), (bulk_report, crit_report)


async def test_preempted_transfer_resumes_bit_exact_with_zero_chunks_resent(nats_url: str) -> None:
    out, sched, (first, _), (bulk, crit) = await preemption_run(nats_url, "g-preempt", 0.05)
    assert out.stats.pauses == 1 and out.stats.declined_pauses == 0
    assert out.stats.paused_s > 0
    assert out.stats.retransmits == 0
    assert out.stats.chunks_sent == out.plan.n_chunks  # every chunk once: resumed where it stopped
    assert bulk.retransmits == 0
    assert first.transfer_id == crit.transfer_id  # the critical one overtook it
    assert sched.state.preemptions == 1 and sched.state.declined_pauses == 0


async def test_no_preemption_past_the_threshold(nats_url: str) -> None:
    out, sched, _, _ = await preemption_run(nats_url, "g-nopreempt", 0.5)
    assert out.stats.pauses == 0 and out.stats.declined_pauses == 1  # the sender said no
    assert sched.state.declined_pauses == 1
    assert out.stats.retransmits == 0 and out.stats.chunks_sent == out.plan.n_chunks


async def test_a_pause_that_is_never_resumed_ends_and_the_transfer_goes_on(nats_url: str) -> None:
    """A scheduler that forgot a pause (it restarted, or failed over) never sends the resume: the
    transfer goes on by itself after `max_pause_s`, whole (it used to wait for ever)."""
    async with group(nats_url, "g-lostpause"), buses(nats_url, 2) as (tx_bus, rx_bus):
        rx = await rx_bus.agent("lostpause-rx", group="g-lostpause", signature=SIG, link=EmulatedLink(16 * MB))
        tx = await tx_bus.agent("lostpause-tx", group="g-lostpause", signature=SIG)
        kv = kv_of_bytes(SIG, 8 * MB, seed=3)
        send = asyncio.create_task(tx.send(rx.name, kv, medium="full"))
        out = await outgoing(tx)
        out.max_pause_s = 0.5
        assert out.pause()  # what a `pause` control does; no `resume` follows
        report = await asyncio.wait_for(send, 20)
        got = await rx.receive(timeout=10)
        assert got.transfer_id == report.transfer_id and got.kv.equal(kv)
        assert out.stats.pauses == 1 and out.stats.expired_pauses == 1


@pytest.mark.parametrize("paths", ["nats", "default"])
async def test_a_receivers_verdict_ends_a_paused_transfer(
    nats_url: str, paths: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver drops the paused transfer's partial (no chunk for its ``partial_timeout``)
    and says so: the send fails at once with that reason, paused or not (it used to wait for a
    resume that never came). On NATS and on the direct path this host gets."""
    if paths == "nats":
        monkeypatch.setenv("KVBUS_PATHS_ALLOWED", "nats")
    async with (
        group(nats_url, "g-pausedrop"),
        buses(nats_url, 1, grant_timeout=60.0) as (tx_bus,),
        buses(nats_url, 1, partial_timeout=1.0) as (rx_bus,),
    ):
        rx = await rx_bus.agent("pausedrop-rx", group="g-pausedrop", signature=SIG, link=EmulatedLink(16 * MB))
        tx = await tx_bus.agent("pausedrop-tx", group="g-pausedrop", signature=SIG)
        send = asyncio.create_task(tx.send(rx.name, kv_of_bytes(SIG, 8 * MB, seed=4), medium="full"))
        out = await outgoing(tx)
        await until(lambda: out.fraction_sent >= 0.05, what="the receiver holds a partial")
        out.max_pause_s = 60.0
        assert out.pause()
        with pytest.raises(TransferRejected) as caught:
            await asyncio.wait_for(send, 20)
        assert caught.value.code is Reason.PARTIAL_DROPPED
        assert out.stats.expired_pauses == 0


# -- failures -------------------------------------------------------------------------------------------


async def test_scheduler_restart_mid_transfer_loses_none_and_delivers_none_twice(nats_url: str) -> None:
    cfg = {"max_active": 1}
    async with buses(nats_url, 2, regrant_interval=0.2) as (tx_bus, rx_bus):
        sched = await GroupScheduler.connect(nats_url, "g-restart", config=SchedulerConfig(**cfg))
        try:
            rx = await rx_bus.agent("restart-rx", group="g-restart", signature=SIG, link=EmulatedLink(12 * MB))
            tx = await tx_bus.agent("restart-tx", group="g-restart", signature=SIG)
            kvs = [kv_of_bytes(SIG, 3 * MB, seed=i) for i in range(5)]
            sends = [asyncio.create_task(tx.send(rx.name, kv, medium="full")) for kv in kvs]
            await until(lambda: len(sched.state.active) == 1 and len(sched.state.queue) >= 3, what="a queue")
        finally:
            await sched.close()  # mid-transfer: one streams, the rest wait for grants
        await asyncio.sleep(0.4)
        async with group(nats_url, "g-restart", **cfg):
            reports = await asyncio.wait_for(asyncio.gather(*sends), 30)
        ids = [r.transfer_id for r in reports]
        got = [await rx.receive(timeout=10) for _ in kvs]
        assert sorted(d.transfer_id for d in got) == sorted(ids)  # none lost
        by_id = {d.transfer_id: d for d in got}
        for r, kv in zip(reports, kvs):
            assert by_id[r.transfer_id].kv.equal(kv)
        with pytest.raises(ReceiveTimeout):  # none twice
            await rx.receive(timeout=0.5)


async def test_a_silent_agent_is_marked_down_and_its_queued_transfers_fail(nats_url: str) -> None:
    async with (
        group(nats_url, "g-down", max_active=1, probe_ttl_s=0.5) as sched,
        buses(nats_url, 2, probe_interval=0.05) as (tx_bus, rx_bus),
    ):
        rx = await rx_bus.agent("down-rx", group="g-down", signature=SIG, link=EmulatedLink(8 * MB))
        ghost = await rx_bus.agent("down-ghost", group="g-down", signature=SIG)
        tx = await tx_bus.agent("down-tx", group="g-down", signature=SIG)
        other = await tx_bus.agent("down-tx2", group="g-down", signature=SIG)
        await until(lambda: "down-ghost" in sched.state.agents, what="the ghost's first probe")
        ghost._tasks[0].cancel()  # it hangs: no more probes
        bulk = asyncio.create_task(tx.send(rx.name, kv_of_bytes(SIG, 8 * MB), medium="full"))
        await until(lambda: len(sched.state.active) == 1, what="the bulk grant")
        with pytest.raises(TransferRejected, match="receiver 'down-ghost' is down: no probe for"):
            await other.send("down-ghost", kv_of_bytes(SIG, 4096), medium="full")
        assert sched.state.agents["down-ghost"].down
        with pytest.raises(TransferRejected, match="is down"):  # and new ones are refused at once
            await other.send("down-ghost", kv_of_bytes(SIG, 4096), medium="full")
        await bulk


async def test_an_idle_scheduler_does_no_work(nats_url: str) -> None:
    async with group(nats_url, "g-idle") as sched, buses(nats_url, 1, probe_interval=0.05) as (bus,):
        a = await bus.agent("idle-a", group="g-idle", signature=SIG)
        b = await bus.agent("idle-b", group="g-idle", signature=SIG)
        await a.send(b.name, kv_of_bytes(SIG, 3 * MB), medium="full")
        await b.receive(timeout=5)
        await until(lambda: not sched.state.active and not sched.state.queue, what="quiet")
        await asyncio.sleep(0.1)
        before = sched.slices
        await asyncio.sleep(0.5)  # ten probes arrive meanwhile; none wakes the loop
        assert sched.slices == before
        assert "idle-a" in sched.state.agents and not sched.state.agents["idle-a"].down


# -- memory hints and reservations ---------------------------------------------------------------------


class FakeTier:
    """Stands in for a cache tier (`kvbus.bus.cache.CacheTier`): reports its bytes, records shed
    calls; it has no listener to wrap and no counters."""

    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        self.sheds: list[int | None] = []
        self.listener: Any = None
        self.stats: Any = None

    async def shed(self, target_bytes: int | None = None) -> None:
        self.sheds.append(target_bytes)
        self.memory_bytes = target_bytes or 0


async def test_an_agent_over_its_watermark_is_told_to_shed(nats_url: str) -> None:
    async with (
        group(nats_url, "g-mem", memory_watermarks="fat=10000", shed_interval_s=0.1) as sched,
        buses(nats_url, 1, probe_interval=0.05) as (bus,),
    ):
        tier = FakeTier(50_000)
        await bus.agent("fat", group="g-mem", signature=SIG, cache=tier)
        thin = FakeTier(50_000)
        await bus.agent("thin", group="g-mem", signature=SIG, cache=thin)  # no watermark: no hint
        await until(lambda: tier.sheds, what="a shed hint")
        assert tier.sheds[0] == 8000  # down to 80 % of its watermark
        await asyncio.sleep(0.3)
        assert len(tier.sheds) == 1 and not thin.sheds  # below the watermark now
        assert sched.sheds == 1


async def test_reservations_over_the_bus_admitted_refused_used_and_kept(nats_url: str) -> None:
    cfg = {"bandwidth_bps": 10 * MB}
    async with buses(nats_url, 1) as (bus,):
        async with group(nats_url, "g-res", **cfg) as sched:
            a = await bus.agent("res-a", group="g-res", signature=SIG)
            b = await bus.agent("res-b", group="g-res", signature=SIG)
            rid = await a.reserve(b.name, period=0.2, size=100_000, deadline=0.05)  # 2.5 MB/s
            with pytest.raises(ReservationRefused, match=r"needs 60.0 Mbit/s .* only 20.0 Mbit/s of the 40.0"):
                await a.reserve(b.name, period=0.2, size=300_000, deadline=0.05)
            report = await a.send(b.name, kv_of_bytes(SIG, 80_000), medium="full", critical=True)
            assert report.rate_bps == pytest.approx(2.5 * MB)
            assert f"reservation {rid}" in report.decision["reason"]
            await b.receive(timeout=5)
            assert sched.reservations is not None and sched.reservations.get(rid).instances == 1
        async with group(nats_url, "g-res", **cfg) as again:  # kept across a restart
            assert again.reservations is not None and again.reservations.get(rid) is not None
            await a.unreserve(rid)
            assert again.reservations.get(rid) is None


async def test_coordinator_admission_checks_the_deployment_table(nats_url: str) -> None:
    from kvbus.coordinator import Coordinator, CoordinatorConfig

    async with buses(nats_url, 1) as (bus,), group(nats_url, "g-coordres", admission="coordinator"):
        a = await bus.agent("cres-a", group="g-coordres", signature=SIG)
        b = await bus.agent("cres-b", group="g-coordres", signature=SIG)
        with pytest.raises(ReservationRefused, match="no coordinator answers"):
            await a.reserve(b.name, period=1.0, size=100_000, deadline=0.5)
        coord = await Coordinator.connect(
            nats_url, config=CoordinatorConfig(capacity_bps=2 * MB, reservable_fraction=0.5)
        )
        try:
            rid = await a.reserve(b.name, period=1.0, size=400_000, deadline=0.5)  # 0.8 of its 1 MB/s
            assert rid in coord.reservations
            with pytest.raises(ReservationRefused, match="refused by the coordinator: needs"):
                await a.reserve(b.name, period=1.0, size=400_000, deadline=0.5)
            await a.unreserve(rid)
            assert rid not in coord.reservations
        finally:
            await coord.close()


async def test_directory_watch_keeps_the_schedulers_cache_current(nats_url: str) -> None:
    """A record written to the directory reaches the scheduler's cache by the JetStream watch,
    without a lookup: a remote agent's new link is known before any request names it."""
    async with group(nats_url, "dirwatch-a") as sched, buses(nats_url, 1) as (bus,):
        deadline = time.monotonic() + 10
        while not sched.directory.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert sched.directory.live
        far = await bus.agent("dirwatch-far", group="dirwatch-b", signature=SIG)

        async def cached_link(want: float) -> bool:
            end = time.monotonic() + 5
            while time.monotonic() < end:
                hit = sched.directory.cache.get("dirwatch-far")
                if hit is not None and hit[1] is not None and hit[1].link_bps == pytest.approx(want):
                    return True
                await asyncio.sleep(0.02)
            return False

        assert await cached_link(0.0)
        assert sched.state.remote.get("dirwatch-far") == "dirwatch-b"  # learnt as an agent of another group
        await far.set_link(EmulatedLink.mbit(80))
        want = 80e6 / 8
        assert await cached_link(want)
        assert sched.state.declared_bandwidth("dirwatch-far", "dirwatch-far") == pytest.approx(want)
