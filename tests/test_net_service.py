"""Shared NATS plumbing: the request/reply client with retries and the replicated-service base,
against a real nats-server. Counts and order are asserted, never timings."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter

import pytest
from nats.aio.msg import Msg

from kvbus.app.local import NatsServer
from kvbus.errors import ConfigError
from kvbus.net.buckets import key_value
from kvbus.net.rpc import Retry, RpcClient
from kvbus.net.service import Endpoint, ReplicatedService, replica_name
from kvbus.net.transport import NatsTransport, NoResponders

_ids = itertools.count()


class CountingTransport(NatsTransport):
    """A real NATS transport that counts the requests it sends."""

    requests = 0

    async def request(self, subject: str, payload: bytes, timeout: float) -> bytes:
        self.requests += 1
        return await super().request(subject, payload, timeout)


async def counting(url: str) -> CountingTransport:
    base = await NatsTransport.connect(url)
    return CountingTransport(base.nc)


async def test_a_request_is_retried_until_it_is_answered(nats_url: str) -> None:
    subject = f"test.rpc.{next(_ids)}"
    seen: Counter[bytes] = Counter()
    server = await NatsTransport.connect(nats_url)
    client = await counting(nats_url)

    async def answer_the_third(msg: Msg) -> None:
        seen[msg.data] += 1
        if seen[msg.data] >= 3:  # the first two go unanswered: the caller's tries time out
            await server.reply(msg, b"done:" + msg.data)

    try:
        await server.subscribe(subject, answer_the_third)
        await server.flush()
        rpc = RpcClient(client, timeout=0.2, retry=Retry(attempts=5, backoff_s=0.01))
        assert await rpc.request(subject, b"key-1", key="key-1") == b"done:key-1"
        assert seen == {b"key-1": 3} and client.requests == 3  # the same request each time
        # Without retries the first unanswered try is the end.
        with pytest.raises(TimeoutError):
            await RpcClient(client, timeout=0.2).request(subject, b"key-2")
        assert seen[b"key-2"] == 1
        with pytest.raises(TimeoutError):
            await rpc.request(subject, b"key-3", key="key-3", retry=Retry(attempts=5, on_timeout=False))
        assert seen[b"key-3"] == 1
    finally:
        await client.close()
        await server.close()


async def test_no_responders_is_retried_then_raised(nats_url: str) -> None:
    client = await counting(nats_url)
    try:
        rpc = RpcClient(client, timeout=0.5, retry=Retry(attempts=3, backoff_s=0.01))
        with pytest.raises(NoResponders):
            await rpc.request(f"test.nobody.{next(_ids)}", b"x", key="x")
        assert client.requests == 3
        with pytest.raises(NoResponders):
            await rpc.request(
                f"test.nobody.{next(_ids)}", b"x", key="x", retry=Retry(attempts=3, on_no_responders=False)
            )
        assert client.requests == 4
    finally:
        await client.close()


async def test_retrying_needs_an_idempotency_key_and_a_sane_strategy(nats_url: str) -> None:
    client = await NatsTransport.connect(nats_url)
    try:
        with pytest.raises(ValueError, match="idempotency key"):
            await RpcClient(client, retry=Retry(attempts=2)).request("test.anything", b"")
    finally:
        await client.close()
    with pytest.raises(ConfigError):
        Retry(attempts=0)
    with pytest.raises(ConfigError):
        Retry(backoff_s=-1)
    assert [Retry(backoff_s=0.1, max_backoff_s=0.3).delay(n) for n in (1, 2, 3, 4)] == [0.1, 0.2, 0.3, 0.3]


class Echo(ReplicatedService):
    """The smallest replicated service: answers ``<subject>`` with its name."""

    def __init__(self, transport: NatsTransport, subject: str, log: list[str]) -> None:
        super().__init__(transport, replica_name("echo"))
        self.subject = subject
        self.log = log

    def endpoints(self) -> list[Endpoint]:
        return [Endpoint(self.subject, self._on_echo, "echo")]

    async def prepare_to_serve(self) -> None:
        self.log.append(f"prepare {self.name}")

    async def now_serving(self) -> None:
        self.log.append(f"serving {self.name}")

    async def closing(self) -> None:
        self.log.append(f"closing {self.name} serving={self.serving}")

    async def closed_down(self) -> None:
        self.log.append(f"closed {self.name} serving={self.serving}")

    async def _on_echo(self, msg: Msg) -> None:
        await self.transport.reply(msg, self.name.encode())


async def test_one_replica_serves_and_a_standby_takes_over_on_close(fresh_nats: NatsServer) -> None:
    subject = "test.echo"
    log: list[str] = []
    ta, tb, client = [await NatsTransport.connect(fresh_nats.url) for _ in range(3)]
    bucket = await key_value(client.nc.jetstream(), "test_echo_leases")
    first, second = Echo(ta, subject, log), Echo(tb, subject, log)
    try:
        await first.campaign(await key_value(ta.nc.jetstream(), "test_echo_leases"), "echo", ttl=0.6)
        await second.campaign(await key_value(tb.nc.jetstream(), "test_echo_leases"), "echo", ttl=0.6)
        assert first.serving and not second.serving  # the standby is warm, not serving
        assert await client.request(subject, b"", timeout=5.0) == first.name.encode()
        await first.close()
        assert not first.serving and first.leader is not None and not first.leader.is_leader
        # It stopped serving before it gave the lease up, and the hooks ran in order.
        assert log[:4] == [
            f"prepare {first.name}",
            f"serving {first.name}",
            f"closing {first.name} serving=True",
            f"closed {first.name} serving=False",
        ]
        deadline = time.monotonic() + 10
        while not second.serving and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert second.serving
        assert await client.request(subject, b"", timeout=5.0) == second.name.encode()
        await first._serve()  # a closed replica never serves again
        assert not first.serving
        holder = await bucket.get("echo")
        assert second.name in holder.value.decode()
    finally:
        await second.close()
        await first.close()
        await client.close()


async def test_without_a_bucket_a_replica_serves_at_once(nats_url: str) -> None:
    log: list[str] = []
    t = await NatsTransport.connect(nats_url)
    client = await NatsTransport.connect(nats_url)
    service = Echo(t, f"test.echo.{next(_ids)}", log)
    try:
        async with service:
            await service.campaign(None, "unused", ttl=1.0)
            assert service.serving and service.leader is None
            assert await client.request(service.subject, b"", timeout=5.0) == service.name.encode()
        assert service.closed and not service.serving
    finally:
        await client.close()
