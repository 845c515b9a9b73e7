"""The leader lease through a NATS server that dies and comes back (a failover as its holder sees it)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import nats
from nats.aio.client import Client

from kvbus.app.cluster import NatsCluster
from kvbus.app.local import NatsServer
from kvbus.net.buckets import key_value
from kvbus.net.leader import LeaderLease

TTL = 3.0


class Watch:
    """Counts elections and losses, and samples `is_leader` every 50 ms."""

    def __init__(self) -> None:
        self.elected = 0
        self.lost = 0
        self.samples: list[bool] = []

    async def on_elected(self) -> None:
        self.elected += 1

    async def on_lost(self) -> None:
        self.lost += 1

    async def sample(self, lease: LeaderLease, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.samples.append(lease.is_leader)
            await asyncio.sleep(0.05)


async def _leader(server: NatsServer) -> tuple[Client, LeaderLease, Watch]:
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1, connect_timeout=1)
    bucket = await key_value(nc.jetstream(), "kvbus_test_leases")
    watch = Watch()
    lease = LeaderLease(bucket, "group", "replica-a", ttl=TTL, on_elected=watch.on_elected, on_lost=watch.on_lost)
    lease.start()
    for _ in range(100):
        if lease.is_leader:
            break
        await asyncio.sleep(0.02)
    assert lease.is_leader
    return nc, lease, watch


async def test_the_holder_keeps_its_lease_through_a_short_server_outage(fresh_nats: NatsServer) -> None:
    """A server that is away for less than the ttl costs the group no leader: no standby could
    have taken the lease over meanwhile."""
    nc, lease, watch = await _leader(fresh_nats)
    try:
        await asyncio.sleep(TTL / 3 + 0.1)  # at least one renewal went through
        fresh_nats.kill()
        await watch.sample(lease, 1.6)  # renewals fail: the server is gone
        await asyncio.to_thread(fresh_nats.start)
        await watch.sample(lease, TTL)  # and succeed again once the client is back
        assert watch.samples and all(watch.samples)
        assert (watch.elected, watch.lost) == (1, 0)
    finally:
        await lease.release()
        await nc.close()


async def test_the_holder_steps_down_once_its_lease_has_expired(fresh_nats: NatsServer) -> None:
    """Out of reach for longer than the ttl, the holder gives the lease up (a standby may hold it now)."""
    nc, lease, watch = await _leader(fresh_nats)
    try:
        fresh_nats.kill()
        killed = time.monotonic()
        while lease.is_leader and time.monotonic() - killed < 3 * TTL:
            await asyncio.sleep(0.05)
        # Within a bounded time: a call to a dead server does not hang (each is cut at ttl / 3).
        assert not lease.is_leader and watch.lost == 1
    finally:
        await lease.release(timeout=0.5)
        with contextlib.suppress(ConnectionError):
            await nc.close()  # the server is gone


async def test_the_holder_keeps_its_lease_when_the_buckets_leader_dies() -> None:
    """On a 3-server cluster, the server that leads the lease bucket's stream, and that the holder
    is connected to, is killed: the client moves to a survivor and JetStream elects a new stream
    leader. Renewals fail fast meanwhile (no responders, JetStream unavailable); the lease is
    still the holder's, so it stays the leader (it used to step down at the first of them, and
    the group had no scheduler through every failover)."""
    ttl = 8.0  # longer than an election of a stream leader on this machine under load
    options: dict[str, Any] = {"dont_randomize": True, "max_reconnect_attempts": -1, "reconnect_time_wait": 0.1}
    with NatsCluster(3) as c:
        urls = [s.url for s in c]
        probe = await nats.connect(urls, **options)
        await key_value(probe.jetstream(), "kvbus_test_leases", replicas=3)
        await probe.close()
        leader = c.stream_leader("KV_kvbus_test_leases")
        assert leader is not None
        nc = await nats.connect([leader.url, *(u for u in urls if u != leader.url)], **options)
        try:
            bucket = await key_value(nc.jetstream(), "kvbus_test_leases", replicas=3)
            watch = Watch()
            lease = LeaderLease(
                bucket, "group", "replica-a", ttl=ttl, on_elected=watch.on_elected, on_lost=watch.on_lost
            )
            lease.start()
            await watch.sample(lease, 0.5)
            assert lease.is_leader
            watch.samples.clear()
            await asyncio.to_thread(leader.kill)
            await watch.sample(lease, ttl * 0.75)
            assert all(watch.samples) and (watch.elected, watch.lost) == (1, 0)
            await lease.release()
        finally:
            with contextlib.suppress(Exception):
                await nc.close()
