"""Inter-group arbitration and failover: leases cap inter-group transfers, standby schedulers and
coordinators take over (kill -9 of real processes) and no transfer is lost or delivered twice."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvbus.app.local import NatsServer
from kvbus.bus import Bus, BusConfig
from kvbus.coordinator import Coordinator, CoordinatorConfig
from kvbus.errors import KVBusError
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig
from kvbus.protocol import COORD_BUCKET
from tests.kvutil import kv_of_bytes
from tests.peer import SIG

CAP = 400_000.0
"""Inter-group capacity in these tests, bytes/s: a 100 kB transfer takes a visible fraction of a second."""
CFG = CoordinatorConfig(capacity_bps=CAP, epoch_s=0.05, lease_grace_epochs=3, leader_ttl_s=0.6)
BUS = BusConfig(
    ack_timeout=0.5,
    peer_timeout=5.0,
    request_timeout=1.0,
    grant_timeout=20.0,
    partial_timeout=5.0,
    regrant_interval=0.3,
)
SCHED = SchedulerConfig(max_active=2, leader_ttl_s=0.6, heartbeat_s=0.2)


@contextlib.asynccontextmanager
async def bus(url: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(url, config=BUS)
    try:
        yield b
    finally:
        await b.close()


def spawn(*args: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvbus.app.cli", *args],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def holder(url: str, key: str) -> str | None:
    """Who holds leader lease ``key`` in the coordinator's bucket."""
    import nats as nats_client

    nc = await nats_client.connect(url)
    try:
        kv = await nc.jetstream().key_value(COORD_BUCKET)
        try:
            entry = await kv.get(key)
        except Exception:
            return None
        return json.loads(entry.value)["holder"] if entry.value else None
    except Exception:
        return None
    finally:
        await nc.close()


async def exchange(
    senders: list[Any], receivers: list[Any], kv: Any, per_sender: int, during: Any = None
) -> tuple[dict[str, int], list[BaseException], int]:
    """Every sender sends ``per_sender`` contexts to its receiver (in another group); returns the
    deliveries per transfer id, the senders' errors and how many sends completed."""
    delivered: dict[str, int] = {}

    async def drain(agent: Any) -> None:
        while True:
            d = await agent.receive(timeout=60)
            delivered[d.transfer_id] = delivered.get(d.transfer_id, 0) + 1

    drains = [asyncio.create_task(drain(r)) for r in receivers]
    sends = [asyncio.create_task(s.send(r.name, kv)) for s, r in zip(senders, receivers) for _ in range(per_sender)]
    if during is not None:
        await during()
    results = await asyncio.gather(*sends, return_exceptions=True)
    await asyncio.sleep(0.5)  # the last verdicts' deliveries reach the drains
    for t in drains:
        t.cancel()
    errors = [r for r in results if isinstance(r, BaseException)]
    ok = [r for r in results if not isinstance(r, BaseException)]
    for r in ok:
        assert delivered.get(r.transfer_id) == 1, (
            f"completed transfer {r.transfer_id} delivered {delivered.get(r.transfer_id)} times"
        )
    return delivered, errors, len(ok)


# -- the lease caps inter-group transfers -------------------------------------------------------


async def test_inter_group_transfers_share_the_lease_local_ones_do_not(fresh_nats: NatsServer) -> None:
    coord = await Coordinator.connect(fresh_nats.url, config=CFG)
    sched = await GroupScheduler.connect(fresh_nats.url, "ga", config=SchedulerConfig(max_active=8))
    try:
        async with bus(fresh_nats.url) as b:
            s1 = await b.agent("s1", group="ga", signature=SIG)
            s2 = await b.agent("s2", group="ga", signature=SIG)
            local = await b.agent("local", group="ga", signature=SIG)
            far1 = await b.agent("far1", group="gb", signature=SIG)
            far2 = await b.agent("far2", group="gb", signature=SIG)
            kv = kv_of_bytes(SIG, 120_000)
            assert sched.inter.leases == 0  # no inter-group demand yet: no lease asked for
            rates: list[float] = []

            async def watch() -> None:
                await asyncio.sleep(0.25)
                inter = [p for p in sched.state.active.values() if sched.state.inter_group(p)]
                rates.extend(p.rate_bps for p in inter)

            sends = [s1.send("far1", kv, medium="full"), s2.send("far2", kv, medium="full"), watch()]
            reports = await asyncio.gather(*sends)
            for rx in (far1, far2):
                await rx.receive(timeout=5)
            assert sched.inter.leases >= 1 and "ga" in coord.leases
            assert sched.state.remote == {"far1": "gb", "far2": "gb"}
            assert len(rates) == 2 and sum(rates) <= CAP * 1.05, rates
            # Each inter-group transfer was paced within the lease from its grant on.
            assert all(0 < r.rate_bps <= CAP * 1.05 for r in reports[:2]), [r.rate_bps for r in reports[:2]]
            # A transfer inside the group does not cross the lease: no budget, no declared link, so
            # it is granted unpaced (rate 0), and the group asks for no lease for it.
            local_report = await s1.send("local", kv, medium="full")
            await local.receive(timeout=5)
            assert local_report.rate_bps == 0.0
            # Demand gone: the lease is given back within a few epochs.
            await until(lambda: _true("ga" not in coord.leases), 2.0, "the lease to be released")
    finally:
        await sched.close()
        await coord.close()


async def _true(x: bool) -> bool:
    return x


async def test_without_a_coordinator_the_group_falls_back_to_its_budget(fresh_nats: NatsServer) -> None:
    coord = await Coordinator.connect(fresh_nats.url, config=CFG)
    sched = await GroupScheduler.connect(
        fresh_nats.url, "ga", config=SchedulerConfig(bandwidth_bps=2e6, coordinator_timeout_s=0.1)
    )
    try:
        async with bus(fresh_nats.url) as b:
            s = await b.agent("s", group="ga", signature=SIG)
            far = await b.agent("far", group="gb", signature=SIG)
            kv = kv_of_bytes(SIG, 20_000)
            await s.send("far", kv)
            await far.receive(timeout=5)
            assert sched.state.inter_bps == pytest.approx(CAP)  # the whole capacity: the only group asking
            expires = sched.inter.expires_at
            await coord.close()
            # The last lease holds until it expires, then the group's own budget caps inter-group traffic.
            big = kv_of_bytes(SIG, 400_000)
            task = asyncio.create_task(s.send("far", big, medium="full"))
            await until(lambda: _true(sched.inter.fallback), 3.0, "the fallback")
            assert time.time() >= expires
            assert sched.state.inter_bps == pytest.approx(2e6)
            await task
            await far.receive(timeout=5)
    finally:
        await sched.close()
        await coord.close()


# -- failover ----------------------------------------------------------------------------------------


async def test_kill_9_of_the_leading_scheduler_mid_inter_group_transfers(fresh_nats: NatsServer) -> None:
    env = {
        "KVBUS_SCHEDULER_LEADER_TTL_S": "0.6",
        "KVBUS_SCHEDULER_MAX_ACTIVE": "2",
        "KVBUS_SCHEDULER_HEARTBEAT_S": "0.2",
    }
    coord = await Coordinator.connect(fresh_nats.url, config=CFG)
    replicas = [spawn("group-scheduler", "--group", "ga", "--nats-url", fresh_nats.url, env=env) for _ in range(2)]
    try:
        await until(lambda: _true_async(holder(fresh_nats.url, "sched.ga")), 30, "a leader for ga")
        async with bus(fresh_nats.url) as b:
            senders = [await b.agent(f"s{i}", group="ga", signature=SIG) for i in range(4)]
            receivers = [await b.agent(f"r{i}", group="gb", signature=SIG) for i in range(4)]
            first = await holder(fresh_nats.url, "sched.ga")
            assert first is not None
            leader_pid = int(first.rsplit(":", 2)[1])
            assert leader_pid in {p.pid for p in replicas}

            async def kill_leader() -> None:
                await asyncio.sleep(0.4)  # two running (lease-paced), the rest queued at the leader
                os.kill(leader_pid, signal.SIGKILL)

            kv = kv_of_bytes(SIG, 60_000)
            delivered, errors, ok = await exchange(senders, receivers, kv, 3, during=kill_leader)
            assert ok + len(errors) == 12
            assert all(isinstance(e, KVBusError) for e in errors), errors
            assert all(n == 1 for n in delivered.values()), delivered
            assert ok >= 10, errors  # the standby granted the queued ones
            second = await holder(fresh_nats.url, "sched.ga")
            assert second is not None and second != first
    finally:
        for p in replicas:
            p.kill()
            p.wait()
        await coord.close()


async def _not_pid(name: Any, pid: int) -> bool:
    got = await name
    return got is not None and f":{pid}:" not in got


async def _true_async(x: Any) -> bool:
    return bool(await x)


async def test_kill_9_of_the_coordinator_mid_inter_group_transfers(fresh_nats: NatsServer) -> None:
    env = {
        "KVBUS_COORDINATOR_CAPACITY_BPS": str(CAP),
        "KVBUS_COORDINATOR_EPOCH_S": "0.05",
        "KVBUS_COORDINATOR_LEADER_TTL_S": "0.6",
    }
    first = spawn("coordinator", "--nats-url", fresh_nats.url, env=env)
    standby: subprocess.Popen[bytes] | None = None
    sched = await GroupScheduler.connect(
        fresh_nats.url, "ga", config=SchedulerConfig(max_active=4, coordinator_timeout_s=0.1)
    )
    try:
        await until(lambda: _true_async(holder(fresh_nats.url, "leader")), 30, "a coordinator")
        standby = spawn("coordinator", "--nats-url", fresh_nats.url, env=env)
        await asyncio.sleep(1.0)  # the standby is up and campaigning
        async with bus(fresh_nats.url) as b:
            senders = [await b.agent(f"s{i}", group="ga", signature=SIG) for i in range(4)]
            receivers = [await b.agent(f"r{i}", group="gb", signature=SIG) for i in range(4)]
            leases: list[int] = []

            async def kill_coordinator() -> None:
                await until(lambda: _true(sched.inter.leases > 0), 5, "a lease")
                leases.append(sched.inter.leases)
                first.send_signal(signal.SIGKILL)

            kv = kv_of_bytes(SIG, 100_000)
            delivered, errors, ok = await exchange(senders, receivers, kv, 3, during=kill_coordinator)
            assert ok == 12 and not errors, errors
            assert all(n == 1 for n in delivered.values())
            # The standby leads now and answers lease requests: a new inter-group transfer gets one.
            await until(lambda: _true_async(_not_pid(holder(fresh_nats.url, "leader"), first.pid)), 10, "the standby")
            before = sched.inter.leases
            await until(lambda: _true(time.time() > sched.inter._retry_at), 3, "the retry time")
            await senders[0].send(receivers[0].name, kv)
            await receivers[0].receive(timeout=5)
            assert sched.inter.leases > before and not sched.inter.fallback
    finally:
        await sched.close()
        for p in (first, standby):
            if p is not None:
                p.kill()
                p.wait()


async def test_placement_puts_new_agents_in_a_group_added_at_run_time(fresh_nats: NatsServer) -> None:
    coord = await Coordinator.connect(fresh_nats.url, config=CFG)
    g0 = await GroupScheduler.connect(fresh_nats.url, "g0", config=SchedulerConfig(heartbeat_s=0.1))
    try:
        async with bus(fresh_nats.url) as b:
            await until(lambda: _true("g0" in coord.groups), 5, "g0 to join")
            a = await b.agent("a", group=None, signature=SIG)
            assert a.group == "g0"
            await until(
                lambda: _true(coord.groups.get("g0") is not None and coord.groups["g0"].agents >= 1),
                5,
                "g0 to report its agent",
            )
            g1 = await GroupScheduler.connect(fresh_nats.url, "g1", config=SchedulerConfig(heartbeat_s=0.1))
            try:
                await until(lambda: _true("g1" in coord.groups), 5, "g1 to join")
                c = await b.agent("c", group=None, signature=SIG)
                assert c.group == "g1"
                far = await b.agent("far", group="g0", signature=SIG)
                await c.send("far", kv_of_bytes(SIG, 10_000))  # its new scheduler grants it
                assert (await far.receive(timeout=5)).sender == "c"
            finally:
                await g1.close()
    finally:
        await g0.close()
        await coord.close()
