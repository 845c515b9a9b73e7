"""The coordinator: max-min shares, leases, reservations, durable state, leader failover, placement."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.msg import Msg

from kvbus.app.local import NatsServer
from kvbus.bus import Bus
from kvbus.coordinator import Coordinator, CoordinatorClient, CoordinatorConfig, weighted_max_min
from kvbus.errors import ReservationRefused, WireFormatError
from kvbus.net.rpc import Retry
from kvbus.net.transport import NatsTransport
from kvbus.protocol import COORD_GROUPS, COORD_LEAVE, COORD_REGISTER, GroupHeartbeat, GroupLeave, group_subject
from tests.peer import SIG

CFG = CoordinatorConfig(
    capacity_bps=1000.0, epoch_s=0.05, lease_grace_epochs=3, reservable_fraction=0.5, leader_ttl_s=0.6
)


@pytest.fixture
async def coord(fresh_nats: NatsServer) -> AsyncIterator[Coordinator]:
    c = await Coordinator.connect(fresh_nats.url, config=CFG)
    try:
        yield c
    finally:
        await c.close()


# -- max-min -------------------------------------------------------------------------------------


def test_max_min_on_constructed_demands() -> None:
    assert weighted_max_min(10, {"a": 2, "b": 8, "c": 8}) == pytest.approx({"a": 2, "b": 4, "c": 4})
    assert weighted_max_min(10, {"a": 2, "b": 8, "c": 8}, {"a": 1, "b": 1, "c": 2}) == pytest.approx(
        {"a": 2, "b": 8 / 3, "c": 16 / 3}
    )
    assert weighted_max_min(100, {"a": 2, "b": 8}) == pytest.approx({"a": 2, "b": 8})
    assert weighted_max_min(0, {"a": 2}) == {"a": 0.0}
    with pytest.raises(ValueError, match="weight"):
        weighted_max_min(1, {"a": 1}, {"a": 0})


@settings(max_examples=200, deadline=None)
@given(
    cap=st.floats(0, 1e6),
    demands=st.dictionaries(st.sampled_from("abcdefg"), st.floats(0, 1e6), min_size=1),
    weights=st.dictionaries(st.sampled_from("abcdefg"), st.floats(0.1, 10)),
)
def test_max_min_properties(cap: float, demands: dict[str, float], weights: dict[str, float]) -> None:
    shares = weighted_max_min(cap, demands, weights)
    total = sum(shares.values())
    assert total == pytest.approx(min(cap, sum(demands.values())), rel=1e-6, abs=1e-6)
    for k, s in shares.items():
        assert -1e-9 <= s <= demands[k] + 1e-6
    # Nobody left wanting has a smaller weighted share than anybody else.
    wanting = [k for k in shares if shares[k] < demands[k] - 1e-6]
    for k in wanting:
        for j in shares:
            assert shares[k] / weights.get(k, 1.0) >= shares[j] / weights.get(j, 1.0) - 1e-6 * max(1.0, cap)


# -- leases and reservations -----------------------------------------------------------------------


async def test_leases_split_by_max_min_and_expire(coord: Coordinator, fresh_nats: NatsServer) -> None:
    t = await NatsTransport.connect(fresh_nats.url)
    try:
        client = CoordinatorClient(t)
        a = await client.lease("ga", "s", 300)
        b = await client.lease("gb", "s", 2000, priority=1)
        assert a.share_bps == pytest.approx(300)
        assert b.share_bps == pytest.approx(700)
        assert a.expires_at > time.time()
        await asyncio.sleep(CFG.epoch_s * (CFG.lease_grace_epochs + 1))
        b = await client.lease("gb", "s", 2000)  # ga stopped renewing: its share is gone
        assert "ga" not in coord.leases
        assert b.share_bps == pytest.approx(1000)
    finally:
        await t.close()


async def test_a_reservation_over_capacity_is_refused(coord: Coordinator, fresh_nats: NatsServer) -> None:
    t = await NatsTransport.connect(fresh_nats.url)
    try:
        client = CoordinatorClient(t)
        ok = await client.reserve("ga", "heartbeat", period_s=1.0, size_bytes=100, deadline_s=0.5)
        assert ok.ok and ok.rate_bps == pytest.approx(200)
        with pytest.raises(ReservationRefused, match="only 2.4 of the 4.0 Mbit/s|only .* is left") as info:
            await client.reserve("gb", "sync", period_s=1.0, size_bytes=200, deadline_s=0.5)
        assert "Mbit/s" in info.value.reason
        # What is reserved is not leased out.
        lease = await client.lease("gc", "s", 10_000)
        assert lease.share_bps == pytest.approx(800)
    finally:
        await t.close()


async def test_state_survives_a_coordinator_restart(fresh_nats: NatsServer) -> None:
    first = await Coordinator.connect(fresh_nats.url, config=CFG)
    t = await NatsTransport.connect(fresh_nats.url)
    try:
        client = CoordinatorClient(t)
        await client.reserve("ga", "heartbeat", period_s=1.0, size_bytes=100, deadline_s=0.5, reservation_id="r1")
        await t.publish(group_subject(COORD_REGISTER, "ga"), GroupHeartbeat("ga", "sched-a", agents=3).encode())
        await t.flush()
        await asyncio.sleep(0.1)
        await first.close()
        second = await Coordinator.connect(fresh_nats.url, config=CFG)
        try:
            assert "r1" in second.reservations
            assert "ga" in second.groups and second.groups["ga"].agents == 3
            # Retried: under load the 0.6 s test lease can lapse and be won again, and between the
            # two nobody serves (a real scheduler's client retries the same way).
            retrying = CoordinatorClient(t, retry=Retry(attempts=5))
            assert (await retrying.groups())["ga"]["scheduler"] == "sched-a"
        finally:
            await second.close()
    finally:
        await t.close()


async def test_standby_takes_over_when_the_leader_dies(fresh_nats: NatsServer) -> None:
    leader = await Coordinator.connect(fresh_nats.url, config=CFG)
    standby = await Coordinator.connect(fresh_nats.url, config=CFG)
    t = await NatsTransport.connect(fresh_nats.url)
    try:
        assert leader.serving and not standby.serving
        # A crash: no clean release of the lease.
        assert leader._leader is not None and leader._leader._task is not None
        leader._leader._task.cancel()
        await leader._stop_serving()
        await leader.transport.close()  # type: ignore[attr-defined]
        deadline = time.monotonic() + 5 * CFG.leader_ttl_s
        while not standby.serving and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert standby.serving
        lease = await CoordinatorClient(t).lease("gx", "s", 10)
        assert lease.share_bps == pytest.approx(10)
    finally:
        await standby.close()
        leader.closed = True
        await t.close()


async def test_new_agents_go_to_a_group_added_at_run_time(coord: Coordinator, fresh_nats: NatsServer) -> None:
    t = await NatsTransport.connect(fresh_nats.url)
    bus = await Bus.connect(fresh_nats.url)
    try:
        client = CoordinatorClient(t)
        await t.publish(group_subject(COORD_REGISTER, "g0"), GroupHeartbeat("g0", "s0", agents=10).encode())
        await t.flush()
        await asyncio.sleep(0.05)
        assert (await client.place("new1")).group == "g0"
        await bus.agent("peer-in-g0", group="g0", signature=SIG)
        # A group is added while everything runs: new agents go there (least loaded) ...
        await t.publish(group_subject(COORD_REGISTER, "g1"), GroupHeartbeat("g1", "s1", agents=0).encode())
        await t.flush()
        await asyncio.sleep(0.05)
        placed = await client.place("new2")
        assert placed.group == "g1" and "least loaded" in placed.reason
        # ... unless they talk mostly to agents of another group.
        assert (await client.place("new3", ["peer-in-g0"])).group == "g0"
    finally:
        await bus.close()
        await t.close()


async def test_a_groups_reply_that_is_not_a_map_is_a_wire_format_error(fresh_nats: NatsServer) -> None:
    # Something that is not the coordinator answers on its subject with a list: the caller gets
    # a clear WireFormatError, not a list posing as the groups map.
    t = await NatsTransport.connect(fresh_nats.url)
    try:

        async def impostor(msg: Msg) -> None:
            await t.reply(msg, msgpack.packb(["not", "a", "map"]))

        await t.subscribe(COORD_GROUPS, impostor)
        await t.flush()
        with pytest.raises(WireFormatError, match="expected a map"):
            await CoordinatorClient(t).groups()
    finally:
        await t.close()


# -- membership: forged and silent groups (issue 18, finding 11) ----------------------------------------------


async def _heartbeat(
    t: NatsTransport, group: str, agents: int, *, on: str | None = None, ts: float | None = None
) -> None:
    hb = GroupHeartbeat(group, f"sched-{group}", agents=agents, **({} if ts is None else {"ts": ts}))
    await t.publish(group_subject(COORD_REGISTER, on or group), hb.encode())
    await t.flush()


async def _until(predicate: object, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def test_a_forged_heartbeat_expires_and_does_not_survive_a_restart(fresh_nats: NatsServer) -> None:
    """A heartbeat for a group that does not exist, dated far in the future and claiming no agents,
    takes placements only until it expires (the coordinator's clock decides, not the message);
    then its placement weight is gone, and a restarted coordinator does not bring it back."""
    cfg = CoordinatorConfig(
        **{**{f: getattr(CFG, f) for f in ("capacity_bps", "epoch_s", "leader_ttl_s")}, "group_ttl_s": 1.0}
    )
    first = await Coordinator.connect(fresh_nats.url, config=cfg)
    t = await NatsTransport.connect(fresh_nats.url)
    try:
        client = CoordinatorClient(t)
        await _heartbeat(t, "ghost", 0, ts=9e10)
        await _heartbeat(t, "real", 50)
        await _until(lambda: {"ghost", "real"} <= set(first.groups), "both heartbeats")
        assert first.groups["ghost"].ts < time.time() + 1  # dated by the coordinator, not by the message
        assert (await client.place("a1")).group == "ghost"  # least loaded while it is live
        # The real group keeps heartbeating; the ghost never again.
        for _ in range(8):
            await asyncio.sleep(0.25)
            await _heartbeat(t, "real", 50)
        placed = await client.place("a2")
        assert placed.group == "real", placed
        assert "ghost" not in (await client.groups()) and "ghost" not in first.groups
        await first.close()
        second = await Coordinator.connect(fresh_nats.url, config=cfg)
        try:
            assert "ghost" not in second.groups
            await _heartbeat(t, "real", 50)
            assert (await client.place("a3")).group == "real"
        finally:
            await second.close()
    finally:
        await t.close()


async def test_a_group_that_went_silent_while_no_coordinator_ran_does_not_come_back(fresh_nats: NatsServer) -> None:
    cfg = CoordinatorConfig(
        **{**{f: getattr(CFG, f) for f in ("capacity_bps", "epoch_s", "leader_ttl_s")}, "group_ttl_s": 0.5}
    )
    first = await Coordinator.connect(fresh_nats.url, config=cfg)
    t = await NatsTransport.connect(fresh_nats.url)
    try:
        await _heartbeat(t, "gone", 1)
        await _until(lambda: "gone" in first.groups, "the heartbeat")
        await first.close()
        await asyncio.sleep(1.0)  # longer than group_ttl_s: it stopped heartbeating meanwhile
        second = await Coordinator.connect(fresh_nats.url, config=cfg)
        try:
            assert "gone" not in second.groups
            assert (await CoordinatorClient(t).place("a")).group == ""
        finally:
            await second.close()
        third = await Coordinator.connect(fresh_nats.url, config=cfg)  # and it was deleted, not just skipped
        try:
            assert "gone" not in third.groups
        finally:
            await third.close()
    finally:
        await t.close()


async def test_a_heartbeat_or_leave_for_another_group_is_dropped(coord: Coordinator, fresh_nats: NatsServer) -> None:
    """Group messages count only on their own group's subject (in secure mode a scheduler may
    publish only there)."""
    t = await NatsTransport.connect(fresh_nats.url)
    try:
        await _heartbeat(t, "g-victim", 3)
        await _until(lambda: "g-victim" in coord.groups, "the victim's heartbeat")
        await _heartbeat(t, "g-forged", 0, on="g-mallory")
        await t.publish(group_subject(COORD_LEAVE, "g-mallory"), GroupLeave("g-victim", "x").encode())
        await t.flush()
        await _heartbeat(t, "g-marker", 1)  # same connection: handled after the two above
        await _until(lambda: "g-marker" in coord.groups, "the marker")
        await asyncio.sleep(0.2)  # the leave has its own subscription: let it be handled too
        assert "g-forged" not in coord.groups and "g-victim" in coord.groups
    finally:
        await t.close()
