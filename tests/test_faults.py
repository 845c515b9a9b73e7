"""Faults on the transport: nats-server restarted mid-transfer, a network partition.

The other faults have their tests next to the code they exercise: receiver killed and sender
gone mid-stream in test_bus.py, scheduler restart in test_scheduler.py, coordinator standby
takeover in test_coordinator.py, Redis restart mid-offload in test_cachetier.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbus.app.local import NatsServer
from kvbus.bus import Bus, BusConfig, TransferError
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig
from kvbus.net.transport import NatsTransport, NoResponders, TransportWrapper
from kvbus.protocol import CHUNK_INDEX_HEADER
from tests.kvutil import kv_of_bytes
from tests.peer import SIG, kv_digest

PEER = Path(__file__).with_name("peer.py")
#: Generous timeouts: a restart is repaired however loaded the machine is; what a short restart
#: must not do (fail a transfer whose receiver is alive) is then not a matter of timing.
RESTART = BusConfig(
    ack_timeout=0.5,
    peer_timeout=30.0,
    request_timeout=2.0,
    grant_timeout=60.0,
    partial_timeout=40.0,
    regrant_interval=0.3,
)


class KillServerAt(TransportWrapper):
    """Transport wrapper: kills nats-server as chunk ``at`` of a transfer is published, restarts it
    ``down_s`` later (in a thread: the agents' event loop goes on meanwhile, as it would in a
    process of its own)."""

    def __init__(self, inner: Any, server: NatsServer, at: int, down_s: float) -> None:
        self.inner, self.server, self.at, self.down_s = inner, server, at, down_s
        self.fired = asyncio.Event()
        self.restarted = asyncio.Event()
        self._restart: asyncio.Task[None] | None = None

    async def publish(self, subject: str, payload: Any, headers: dict[str, str] | None = None) -> None:
        if not self.fired.is_set() and headers and headers.get(CHUNK_INDEX_HEADER) == str(self.at):
            self.fired.set()
            self.server.kill()
            self._restart = asyncio.create_task(self._restart_later())
        await self.inner.publish(subject, payload, headers)

    async def _restart_later(self) -> None:
        await asyncio.sleep(self.down_s)
        await asyncio.to_thread(self.server.start)
        self.restarted.set()


@pytest.mark.usefixtures("nats_only")
@pytest.mark.parametrize("down_s", [0.3, 1.5], ids=["blip", "outage"])
async def test_nats_restart_mid_transfer_delivers_once_or_fails_loudly(fresh_nats: NatsServer, down_s: float) -> None:
    port = fresh_nats.port
    sched = await GroupScheduler.connect(fresh_nats.url, "faults", config=SchedulerConfig(max_active=4))
    tx_bus = await Bus.connect(fresh_nats.url, config=RESTART)
    rx_bus = await Bus.connect(fresh_nats.url, config=RESTART)
    try:
        tx = await tx_bus.agent("restart-tx", group="faults", signature=SIG)
        rx = await rx_bus.agent("restart-rx", group="faults", signature=SIG)
        killer = KillServerAt(tx.transport, fresh_nats, at=5, down_s=down_s)
        tx.transport = killer
        kvs = [kv_of_bytes(SIG, 12 << 20, seed=i) for i in range(3)]
        results = await asyncio.gather(*(tx.send(rx.name, kv, medium="full") for kv in kvs), return_exceptions=True)
        assert killer.fired.is_set()
        await asyncio.wait_for(killer.restarted.wait(), 60)
        assert fresh_nats.port == port  # restarted on the same port: clients reconnect by themselves
        for r in results:
            # Either a report or one of our errors, never anything else (a crash, a hang).
            assert not isinstance(r, BaseException) or isinstance(r, TransferError), repr(r)
        delivered = []
        while True:
            try:
                delivered.append(await rx.receive(timeout=1.0))
            except Exception:
                break
        ids = [d.transfer_id for d in delivered]
        assert len(ids) == len(set(ids))  # never twice
        expected = {kv_digest(kv) for kv in kvs}
        assert all(kv_digest(d.kv) in expected for d in delivered)  # never wrong
        ok_ids = {r.transfer_id for r in results if not isinstance(r, BaseException)}
        assert ok_ids <= set(ids)  # every reported success arrived
        if down_s < RESTART.request_timeout / 2:
            # A blip shorter than a request timeout is repaired: every transfer arrives once, and
            # no live receiver is taken for gone because it reconnected after its sender (a
            # "no responders" right after a reconnection is asked again). A longer outage may
            # fail transfers in flight, but loudly.
            failed = [r for r in results if isinstance(r, BaseException)]
            assert not failed, f"a short restart of the server failed transfers: {failed}"
        # After the restart the bus works as before.
        kv = kv_of_bytes(SIG, 4 << 20, seed=9)
        report = await tx.send(rx.name, kv, medium="full")
        got = await rx.receive(timeout=10)
        assert got.transfer_id == report.transfer_id and got.kv.equal(kv)
    finally:
        await tx_bus.close()
        await rx_bus.close()
        await sched.close()


async def test_no_responders_right_after_a_reconnection_is_asked_again(fresh_nats: NatsServer) -> None:
    """The cause of the short-restart failures: after a server restart each client reconnects on
    its own schedule, so a sender back first found "no responders" on a receiver that had not
    subscribed again yet and took it for gone. Right after its own reconnection a request is asked
    again (within its timeout) until the responder is back; otherwise no responder is at once an
    error, as before."""
    requester = await NatsTransport.connect(fresh_nats.url, reconnect_grace_s=30.0)
    try:
        with pytest.raises(NoResponders):  # never reconnected: believed at once
            await requester.request("kvbus.test.late", b"x", timeout=5.0)
        fresh_nats.kill()
        await asyncio.to_thread(fresh_nats.start)
        while requester.reconnected_at == float("-inf"):
            await asyncio.sleep(0.02)
        asked = asyncio.create_task(requester.request("kvbus.test.late", b"ping", timeout=20.0))
        await asyncio.sleep(0.3)
        assert not asked.done()  # no responder yet: still asking, not failed
        responder = await NatsTransport.connect(fresh_nats.url)  # the peer that reconnects late
        try:

            async def answer(msg: Any) -> None:
                await responder.reply(msg, b"pong:" + msg.data)

            await responder.subscribe("kvbus.test.late", answer)
            await responder.flush()
            assert await asyncio.wait_for(asked, 20) == b"pong:ping"
        finally:
            await responder.close()
    finally:
        await requester.close()


async def test_unanswered_open_is_asked_again_and_delivered_once(nats_url: str, scheduler: GroupScheduler) -> None:
    """The receiver answers the first Open only after the sender's request timeout (as when the
    request or its reply is lost in a server restart): the sender asks again with the same
    transfer id, the receiver answers from its record, the send succeeds, delivered once."""
    cfg = BusConfig(request_timeout=0.4, peer_timeout=5.0, ack_timeout=0.5, grant_timeout=10.0)
    tx_bus = await Bus.connect(nats_url, config=cfg)
    rx_bus = await Bus.connect(nats_url, config=cfg)
    try:
        tx = await tx_bus.agent("reopen-tx", signature=SIG)
        rx = await rx_bus.agent("reopen-rx", signature=SIG)
        slow_once = [True]
        decode = rx._receiver._decode

        async def slow_decode(*args: Any, **kwargs: Any) -> Any:
            if slow_once[0]:
                slow_once[0] = False
                await asyncio.sleep(1.0)  # 2.5 request timeouts
            return await decode(*args, **kwargs)

        rx._receiver._decode = slow_decode  # type: ignore[method-assign]
        kv = kv_of_bytes(SIG, 64 << 10, seed=3)  # inline: the payload rides in the Open
        report = await tx.send(rx.name, kv, medium="full")
        got = await rx.receive(timeout=5)
        assert got.transfer_id == report.transfer_id and got.kv.equal(kv)
        with pytest.raises(Exception):  # noqa: B017 - ReceiveTimeout: nothing more arrives
            await rx.receive(timeout=1.0)
    finally:
        await tx_bus.close()
        await rx_bus.close()


# -- network partition with namespaces ---------------------------------------------------------------


def _netns_problem() -> str:
    if os.geteuid() != 0:
        return "needs root for ip netns"
    if shutil.which("ip") is None:
        return "no `ip` command"
    name = f"kvbus-probe-{uuid.uuid4().hex[:6]}"
    try:
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", name], check=True, capture_output=True, timeout=10)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"`ip netns add` is not allowed here: {exc}"
    return ""


class NetnsHost:
    """A network namespace joined to this host by a veth pair: 10.77.<n>.1 here, 10.77.<n>.2 inside."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.ns = f"kvbus-{self.tag}"
        self.host_if, self.ns_if = f"kvh{self.tag}", f"kvn{self.tag}"
        self.subnet = 77 + int(self.tag[:2], 16) % 100
        self.host_ip, self.ns_ip = f"10.{self.subnet}.0.1", f"10.{self.subnet}.0.2"

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    def __enter__(self) -> NetnsHost:
        self._ip("netns", "add", self.ns)
        try:
            self._ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            self._ip("link", "set", self.ns_if, "netns", self.ns)
            self._ip("addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
            self._ip("link", "set", self.host_if, "up")
            self._ip("netns", "exec", self.ns, "ip", "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if)
            self._ip("netns", "exec", self.ns, "ip", "link", "set", self.ns_if, "up")
            self._ip("netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def partition(self) -> None:
        self._ip("link", "set", self.host_if, "down")

    def heal(self) -> None:
        self._ip("link", "set", self.host_if, "up")

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=10)


class WideNats(NatsServer):
    """nats-server listening on every interface (so a namespace can reach it over the veth)."""

    def _command(self) -> list[str]:
        cmd = super()._command()
        conf = self.workdir / "nats.conf"
        conf.write_text(conf.read_text().replace("host: 127.0.0.1", "host: 0.0.0.0"))
        return cmd


@pytest.fixture
def netns_host() -> Iterator[NetnsHost]:
    problem = _netns_problem()
    if problem:
        pytest.skip(f"network partition test skipped: {problem}")
    with NetnsHost() as host:
        yield host


@pytest.fixture
async def wide_nats() -> AsyncIterator[NatsServer]:
    server = WideNats().start()
    try:
        yield server
    finally:
        server.stop()


async def test_partitioned_receiver_fails_the_send_and_frees_nothing_twice(
    netns_host: NetnsHost, wide_nats: NatsServer
) -> None:
    """A receiver on the far side of a veth is cut off mid-stream: the sender gets an error within
    its peer timeout; after the partition heals the same receiver gets new transfers, once each."""
    url_inside = f"nats://{netns_host.host_ip}:{wide_nats.port}"
    sched = await GroupScheduler.connect(wide_nats.url, "default", config=SchedulerConfig(max_active=4))
    peer = subprocess.Popen(
        ["ip", "netns", "exec", netns_host.ns, sys.executable, str(PEER), url_inside, "far-rx"],
        stdout=subprocess.PIPE,
        cwd=PEER.parent.parent,
    )
    tx_bus = await Bus.connect(
        wide_nats.url, config=BusConfig(ack_timeout=0.5, peer_timeout=4.0, request_timeout=2.0, partial_timeout=5.0)
    )
    try:
        assert peer.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(peer.stdout.readline), 30)
        assert b"ready" in line
        tx = await tx_bus.agent("near-tx", signature=SIG)
        kv = kv_of_bytes(SIG, 2 << 20, seed=1)
        await tx.send("far-rx", kv, medium="full")  # through the veth
        first = await asyncio.wait_for(asyncio.to_thread(peer.stdout.readline), 10)
        assert kv_digest(kv).encode() in first

        big = kv_of_bytes(SIG, 256 << 20, seed=2)
        send = asyncio.create_task(tx.send("far-rx", big, medium="full"))
        await asyncio.sleep(0.3)
        netns_host.partition()
        with pytest.raises(TransferError):
            await asyncio.wait_for(send, 30)
        netns_host.heal()
        await asyncio.sleep(3.0)  # the peer's client reconnects
        kv2 = kv_of_bytes(SIG, 3 << 20, seed=3)
        for _ in range(10):
            try:
                await tx.send("far-rx", kv2, medium="full")
                break
            except TransferError:
                await asyncio.sleep(1.0)
        else:
            raise AssertionError("the receiver never came back after the partition healed")
        line = await asyncio.wait_for(asyncio.to_thread(peer.stdout.readline), 10)
        assert kv_digest(kv2).encode() in line  # the cut-off transfer was never delivered late
    finally:
        peer.kill()
        peer.wait()
        await tx_bus.close()
        await sched.close()
