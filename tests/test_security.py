"""Secure mode against a real nats-server that enforces the generated per-agent permissions."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbus.app.local import NatsServer
from kvbus.bus import Bus
from kvbus.bus.chunking import digests_root
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig
from kvbus.protocol import (
    AgentRecord,
    Grant,
    RequestAck,
    TransferRequest,
    ack_subject,
    agent_subject,
    data_subject,
    inbox_subject,
    sched_subject,
)
from kvbus.security import AgentGrant, Credentials, load_credentials, permissions_config
from tests.conftest import FAST
from tests.kvutil import kv_of_bytes, random_kv
from tests.peer import SIG

AGENTS = ["alice", "bob", "carol", "mallory"]


@pytest.fixture(scope="module")
def secure_server() -> Iterator[tuple[NatsServer, Credentials]]:
    grants = [AgentGrant(a, "default", broadcasts_from=("alice",) if a in ("bob", "carol") else ()) for a in AGENTS]
    block, creds = permissions_config(grants, ["default"])
    server = NatsServer(extra_config=block).start()
    try:
        yield server, creds
    finally:
        server.stop()


@pytest.fixture
async def stack(secure_server: tuple[NatsServer, Credentials]) -> AsyncIterator[dict[str, Any]]:
    """A scheduler running as its scheduler user and one secure bus per agent, with their async errors."""
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
        yield {"agents": agents, "buses": buses, "errors": errors, "sched": sched, "url": server.url}
    finally:
        for b in buses.values():
            await b.close()
        await sched.close()


async def _wait_for(errors: list[str], needle: str, timeout: float = 3.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hit = [e for e in errors if needle.lower() in e.lower()]
        if hit:
            return hit[0]
        await asyncio.sleep(0.02)
    raise AssertionError(f"no error containing {needle!r}; got {errors}")


async def test_unauthenticated_client_is_refused(secure_server: tuple[NatsServer, Credentials]) -> None:
    server, _ = secure_server
    with pytest.raises(Exception, match="(?i)authorization"):
        await Bus.connect(server.url, config=FAST, max_reconnect_attempts=0, allow_reconnect=False)


async def test_agent_cannot_read_another_inbox_or_publish_a_grant(stack: dict[str, Any]) -> None:
    agents, buses, errors = stack["agents"], stack["buses"], stack["errors"]
    mallory = buses["mallory"].transport
    stolen: list[bytes] = []

    async def steal(msg: Any) -> None:
        stolen.append(msg.data)

    await mallory.subscribe(agent_subject("bob", "inbox"), steal)
    await mallory.subscribe("kvbus.agent.bob.data.>", steal)
    await mallory.subscribe("kvbus.bcast.alice.>", steal)
    await _wait_for(errors["mallory"], 'subscription to "kvbus.bcast.alice.>"')
    refused = [e for e in errors["mallory"] if "permissions violation for subscription" in e.lower()]
    assert len(refused) == 3

    forged = Grant(transfer_id="x" * 32, medium="full", chunk_size=1 << 20, window=16, rate_bps=0.0)
    await mallory.publish(agent_subject("alice", "ctl"), forged.encode())
    await _wait_for(errors["mallory"], "Permissions Violation for Publish")
    # Straight to JetStream (the directory) is refused too.
    await mallory.publish("$KV.kvbus_agents.alice", b"forged")
    await _wait_for(errors["mallory"], "$KV.kvbus_agents")

    # The legitimate traffic still flows: streamed unicast, inline unicast and a broadcast.
    big = kv_of_bytes(SIG, 8 << 20, seed=3)
    report = await agents["alice"].send("bob", big, medium="full")
    got = await agents["bob"].receive(timeout=10)
    assert got.transfer_id == report.transfer_id and got.kv.equal(big)
    small = random_kv(SIG, 4)
    await agents["alice"].send("bob", small, medium="full")
    assert (await agents["bob"].receive(timeout=10)).kv.equal(small)
    shared = kv_of_bytes(SIG, 4 << 20, seed=5)
    await agents["alice"].broadcast(["bob", "carol"], shared, medium="full")
    assert (await agents["bob"].receive(timeout=10)).kv.equal(shared)
    assert (await agents["carol"].receive(timeout=10)).kv.equal(shared)
    assert stolen == []
    assert not errors["alice"] and not errors["bob"] and not errors["carol"]


async def test_secure_agent_reserves_and_uses_its_reservation(stack: dict[str, Any]) -> None:
    """Reservations go to the agent's own scheduler subject, which its user may publish on."""
    alice = stack["agents"]["alice"]
    rid = await alice.reserve("bob", period=1.0, size=1 << 20, deadline=0.5)
    kv = kv_of_bytes(SIG, 1 << 20, seed=11)
    report = await alice.send("bob", kv, medium="full", critical=True)
    got = await stack["agents"]["bob"].receive(timeout=10)
    assert got.transfer_id == report.transfer_id and got.kv.equal(kv)
    await alice.unreserve(rid)
    assert not stack["errors"]["alice"]


async def test_agent_cannot_speak_for_another_agent_to_the_scheduler(stack: dict[str, Any]) -> None:
    """Mallory may not publish on bob's scheduler subjects (the server refuses), and a record, probe
    or request naming bob that she sends on her own subjects is refused by the scheduler."""
    agents, buses, errors, sched = stack["agents"], stack["buses"], stack["errors"], stack["sched"]
    mallory = buses["mallory"].transport
    before = await sched.lookup("bob")
    forged = AgentRecord(name="bob", group="default", role="agent", priority=9.0, signature=None)
    await mallory.publish(sched_subject("default", "register", "bob"), forged.encode())
    await _wait_for(errors["mallory"], "kvbus.sched.default.register.bob")
    with pytest.raises(Exception):  # noqa: B017 - the scheduler does not answer a refused record
        await mallory.request(sched_subject("default", "register", "mallory"), forged.encode(), timeout=1.0)
    sched.directory.cache.clear()
    after = await sched.lookup("bob")
    assert after is not None and before is not None and after.signature == before.signature
    assert after.priority == before.priority
    request = TransferRequest(
        transfer_id="f" * 32,
        src="bob",
        dst=["alice"],
        group="default",
        n_tokens=4,
        nbytes=1024,
        signature=SIG.to_dict(),
    )
    ack = RequestAck.decode(
        await mallory.request(sched_subject("default", "request", "mallory"), request.encode(), timeout=3.0)
    )
    assert not ack.ok and "came on the subject of 'mallory'" in ack.reason
    # Bob is unaffected.
    kv = random_kv(SIG, 4)
    await agents["bob"].send("alice", kv, medium="full")
    assert (await agents["alice"].receive(timeout=10)).kv.equal(kv)


async def test_agent_cannot_pose_as_another_sender(stack: dict[str, Any]) -> None:
    """Mallory may not open a transfer on bob's inbox under alice's name (the server refuses the
    publish), and an Open claiming alice on mallory's own inbox subject is refused by bob."""
    from kvbus.protocol import Open, OpenReply

    agents, buses, errors = stack["agents"], stack["buses"], stack["errors"]
    mallory = buses["mallory"].transport
    kv = random_kv(SIG, 4)
    forged = Open(
        transfer_id="a" * 32,
        src="alice",
        codec="full",
        meta={"signature": SIG.to_dict()},
        sizes=[16],
        total=16,
        chunk_size=1 << 20,
        n_chunks=1,
        digest=digests_root(b"\0" * 8, 16),
        window=4,
        data_subject=data_subject("bob", "alice", "a" * 32),
        ack_subject=ack_subject("alice", "bob"),
        digests=b"\0" * 8,
    )
    await mallory.publish(inbox_subject("bob", "alice"), forged.frame())
    await _wait_for(errors["mallory"], "kvbus.agent.bob.inbox.alice")
    reply = OpenReply.decode(await mallory.request(inbox_subject("bob", "mallory"), forged.frame(), timeout=3))
    assert not reply.ok and "came on the inbox of 'mallory'" in reply.reason
    # Nothing reached bob's inbox; alice's real sends still do.
    await agents["alice"].send("bob", kv, medium="full")
    got = await agents["bob"].receive(timeout=10)
    assert got.sender == "alice" and got.kv.equal(kv)


async def test_only_a_groups_scheduler_may_announce_it_to_the_coordinator(
    secure_server: tuple[NatsServer, Credentials], stack: dict[str, Any]
) -> None:
    """Heartbeats and group leaves: an agent may publish neither; a scheduler only its own group's."""
    from kvbus.net.transport import NatsTransport
    from kvbus.protocol import COORD_LEAVE, COORD_REGISTER, GroupHeartbeat, GroupLeave, group_subject

    server, creds = secure_server
    mallory, errors = stack["buses"]["mallory"].transport, stack["errors"]["mallory"]
    forged = GroupHeartbeat("default", "forged", agents=0).encode()
    await mallory.publish(group_subject(COORD_REGISTER, "default"), forged)
    await _wait_for(errors, "kvbus.coord.register.default")
    await mallory.publish(COORD_REGISTER, forged)
    await _wait_for(errors, '"kvbus.coord.register"')
    await mallory.publish(group_subject(COORD_LEAVE, "default"), GroupLeave("default").encode())
    await _wait_for(errors, "kvbus.coord.leave.default")

    sched_errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        sched_errors.append(str(exc))

    sched = await NatsTransport.connect(server.url, error_cb=on_error, **creds.scheduler_options("default"))
    try:
        await sched.publish(group_subject(COORD_REGISTER, "other"), GroupHeartbeat("other", "s").encode())
        await _wait_for(sched_errors, "kvbus.coord.register.other")
        await sched.publish(group_subject(COORD_LEAVE, "other"), GroupLeave("other").encode())
        await _wait_for(sched_errors, "kvbus.coord.leave.other")
        refused = len(sched_errors)
        await sched.publish(group_subject(COORD_REGISTER, "default"), GroupHeartbeat("default", "s").encode())
        await sched.flush()  # a round trip: a refusal would come before its answer
        await asyncio.sleep(0.2)
        assert len(sched_errors) == refused, sched_errors  # its own group's subject is allowed
    finally:
        await sched.close()


async def test_secure_agents_register_through_their_scheduler(stack: dict[str, Any]) -> None:
    record = await stack["sched"].lookup("carol")
    assert record is not None and record.group == "default"


async def test_receiver_refuses_an_open_pointing_at_foreign_subjects(stack: dict[str, Any]) -> None:
    from kvbus.protocol import Open, OpenReply

    mallory = stack["buses"]["mallory"].transport
    bad = Open(
        transfer_id="t" * 32,
        src="mallory",
        codec="full",
        meta={"signature": SIG.to_dict()},
        sizes=[4 << 20],
        total=4 << 20,
        chunk_size=1 << 20,
        n_chunks=4,
        digest=digests_root(b"\0" * 32, 4 << 20),
        window=4,
        data_subject="kvbus.agent.alice.data.x",
        ack_subject=ack_subject("mallory", "bob"),
        digests=b"\0" * 32,
    )
    reply = OpenReply.decode(await mallory.request(inbox_subject("bob", "mallory"), bad.frame(), timeout=3))
    assert not reply.ok and "data subject" in reply.reason
    assert stack["agents"]["bob"].partial_transfers == 0


def test_kvbus_up_secure_writes_private_credentials_and_logs_no_secret(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "KVBUS_CREDENTIALS_FILE": str(tmp_path / "credentials.json"),
        "KVBUS_STACK_FILE": str(tmp_path / "stack.json"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbus.app.cli", "-vv", "up", "--secure", "--agents", "a1,a2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    out = b""
    try:
        deadline = time.monotonic() + 30
        assert proc.stdout is not None
        while b"kvbus is up" not in out and time.monotonic() < deadline and proc.poll() is None:
            out += proc.stdout.readline()
        assert b"kvbus is up" in out, out.decode(errors="replace")[-2000:]
        path = tmp_path / "credentials.json"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        creds = load_credentials(path)
        assert set(creds.agents) == {"a1", "a2"} and set(creds.schedulers) == {"default"}
        stack = json.loads((tmp_path / "stack.json").read_text())
        assert stack["secure"] is True

        async def transfer() -> None:
            a1 = await Bus.connect(stack["nats_url"], config=FAST, secure=True, **creds.agent_options("a1"))
            a2 = await Bus.connect(stack["nats_url"], config=FAST, secure=True, **creds.agent_options("a2"))
            try:
                tx, rx = await a1.agent("a1", signature=SIG), await a2.agent("a2", signature=SIG)
                kv = kv_of_bytes(SIG, 3 << 20, seed=1)
                await tx.send("a2", kv, medium="full")
                assert (await rx.receive(timeout=10)).kv.equal(kv)
            finally:
                await a1.close()
                await a2.close()

        asyncio.run(transfer())
    finally:
        proc.terminate()
        try:
            rest, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
        out += rest or b""
    secrets_ = [pw for _, pw in [*creds.agents.values(), *creds.schedulers.values(), creds.coordinator]]
    text = out.decode(errors="replace")
    assert all(pw not in text for pw in secrets_)
