"""Issue 18 finding 1, secure mode: broadcast data readable by addressees only, and acks that count
only when they come from the receiver they are for. Against a real nats-server enforcing the
permissions `kvbus.security` generates (the chart's are the same: tests/test_helm.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from kvbus.app.local import NatsServer
from kvbus.bus import Bus, TransferError
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig
from kvbus.net.transport import TransportWrapper
from kvbus.protocol import CHUNK_INDEX_HEADER, Ack, ack_subject, agent_subject
from kvbus.security import AgentGrant, Credentials, permissions_config
from tests.conftest import FAST
from tests.kvutil import kv_of_bytes
from tests.peer import SIG

#: eve is no addressee of alice's broadcasts, although the old scheme let her "join" them.
AGENTS = ["alice", "bob", "carol", "eve", "mallory"]


@pytest.fixture(scope="module")
def secure_server() -> Iterator[tuple[NatsServer, Credentials]]:
    grants = [AgentGrant(a, "default", broadcasts_from=("alice",) if a != "alice" else ()) for a in AGENTS]
    block, creds = permissions_config(grants, ["default"])
    server = NatsServer(extra_config=block).start()
    try:
        yield server, creds
    finally:
        server.stop()


@pytest.fixture
async def stack(secure_server: tuple[NatsServer, Credentials]) -> AsyncIterator[dict[str, Any]]:
    server, creds = secure_server
    sched = await GroupScheduler.connect(
        server.url, "default", config=SchedulerConfig(max_active=8), nats_options=creds.scheduler_options("default")
    )
    errors: dict[str, list[str]] = {a: [] for a in AGENTS}
    buses: dict[str, Bus] = {}
    try:
        for a in AGENTS:

            async def on_error(exc: Exception, name: str = a) -> None:
                errors[name].append(str(exc))

            buses[a] = await Bus.connect(
                server.url, config=FAST, secure=True, error_cb=on_error, **creds.agent_options(a)
            )
        agents = {a: await buses[a].agent(a, signature=SIG) for a in AGENTS}
        yield {"agents": agents, "buses": buses, "errors": errors}
    finally:
        for b in buses.values():
            await b.close()
        await sched.close()


async def _wait_for(errors: list[str], needle: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(needle.lower() in e.lower() for e in errors):
        if time.monotonic() > deadline:
            raise AssertionError(f"no error containing {needle!r}; got {errors}")
        await asyncio.sleep(0.02)


async def test_a_broadcast_is_readable_by_its_addressees_only(stack: dict[str, Any]) -> None:
    """Finding 1: any agent that had joined a sender's broadcasts could read every broadcast of it,
    addressed to it or not. In secure mode each addressee gets its own stream under its own prefix:
    eve, listening wherever the server lets her, gets nothing, and the addressees get it whole."""
    agents, buses, errors = stack["agents"], stack["buses"], stack["errors"]
    eve = buses["eve"].transport
    stolen: list[bytes] = []

    async def steal(msg: Any) -> None:
        stolen.append(msg.data)

    await eve.subscribe("kvbus.bcast.alice.>", steal)
    await eve.subscribe("kvbus.agent.bob.data.>", steal)
    await eve.subscribe("kvbus.agent.eve.>", steal)  # her own prefix: allowed, and nothing of alice's comes
    await _wait_for(errors["eve"], 'subscription to "kvbus.agent.bob.data.>"')
    await _wait_for(errors["eve"], 'subscription to "kvbus.bcast.alice.>"')
    shared = kv_of_bytes(SIG, 6 << 20, seed=5)
    report = await agents["alice"].broadcast(["bob", "carol"], shared, medium="full")
    for rx in ("bob", "carol"):
        got = await agents[rx].receive(timeout=10)
        assert got.transfer_id == report.transfer_id and got.kv.equal(shared)
    assert stolen == []
    assert not errors["alice"] and not errors["bob"] and not errors["carol"]


async def test_a_forged_ack_never_completes_a_broadcast(stack: dict[str, Any]) -> None:
    """Finding 1: any agent could publish an Ack for any transfer and the sender trusted the
    receiver named inside it, so a forged Ack made `broadcast()` succeed while no addressee got
    anything. Acks now come on subjects ending in the receiver's name, which only it may publish
    to, and the sender takes the receiver from the subject: mallory's forgeries, on the old ack
    subject, on bob's and on her own naming bob, change nothing, and the broadcast fails."""
    agents, buses, errors = stack["agents"], stack["buses"], stack["errors"]
    alice = agents["alice"]
    mallory = buses["mallory"].transport
    forged: list[str] = []

    class DropChunks(TransportWrapper):
        """Alice's transport loses every chunk (no addressee can finish); mallory learns the
        transfer id (as an eavesdropper on the wire might) and forges acks for both addressees."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def publish(self, subject: str, payload: Any, headers: dict[str, str] | None = None) -> None:
            if headers and CHUNK_INDEX_HEADER in headers:
                tid = subject.rsplit(".", 1)[-1]
                if tid not in forged:
                    forged.append(tid)
                    for rx in ("bob", "carol"):
                        done = Ack(transfer_id=tid, rx=rx, next=99, received=99, done=True, ok=True).encode()
                        await mallory.publish(agent_subject("alice", "ack"), done)
                        await mallory.publish(ack_subject("alice", rx), done)
                        await mallory.publish(ack_subject("alice", "mallory"), done)
                    await mallory.flush()
                return
            await self.inner.publish(subject, payload, headers)

    alice.transport = DropChunks(alice.transport)
    try:
        with pytest.raises(TransferError) as info:
            await alice.broadcast(["bob", "carol"], kv_of_bytes(SIG, 4 << 20, seed=7), medium="full")
        assert forged and set(info.value.failed) == {"bob", "carol"}  # type: ignore[attr-defined]
        await _wait_for(errors["mallory"], 'publish to "kvbus.agent.alice.ack.bob"')
        await _wait_for(errors["mallory"], 'publish to "kvbus.agent.alice.ack"')
    finally:
        alice.transport = alice.transport.inner
    # Real acks still count.
    kv = kv_of_bytes(SIG, 3 << 20, seed=8)
    report = await alice.broadcast(["bob", "carol"], kv, medium="full")
    for rx in ("bob", "carol"):
        assert (await agents[rx].receive(timeout=10)).transfer_id == report.transfer_id


async def test_another_agent_cannot_inject_chunks_into_a_secure_stream(stack: dict[str, Any]) -> None:
    """Data subjects carry the sender's name, and only the sender may publish on them: mallory's
    chunks for alice's transfer to bob are refused by the server (and would fail their digests)."""
    agents, buses, errors = stack["agents"], stack["buses"], stack["errors"]
    mallory = buses["mallory"].transport
    await mallory.publish("kvbus.agent.bob.data.alice." + "x" * 32, b"junk", headers={CHUNK_INDEX_HEADER: "0"})
    await _wait_for(errors["mallory"], 'publish to "kvbus.agent.bob.data.alice.')
    kv = kv_of_bytes(SIG, 3 << 20, seed=9)
    report = await agents["alice"].send("bob", kv, medium="full")
    got = await agents["bob"].receive(timeout=10)
    assert got.transfer_id == report.transfer_id and got.kv.equal(kv)
