"""The vLLM connector in secure mode: engines' agents on a nats-server that enforces kvbus's
per-agent permissions (`kvbus.security`, what ``kvbus up --secure`` and the Helm chart set up),
each connecting as its own user from the credentials file (``credentials`` in
``kv_connector_extra_config``). The agents are the connector's `KVBusClient`, and in the last
test a real vLLM engine (skipped without vLLM)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvbus.app.local import NatsServer
from kvbus.errors import ConfigError
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig
from kvbus.integrations.vllm.client import KVBusClient
from kvbus.integrations.vllm.config import ConnectorConfig
from kvbus.integrations.vllm.control import AsyncControl
from kvbus.integrations.vllm.protocol import PullOutcome, PullReply, PullRequest, PushRequest, subject
from kvbus.net.transport import NatsTransport
from kvbus.security import AgentGrant, Credentials, permissions_config, save_credentials
from kvbus.signature import ModelSignature
from tests.kvutil import random_kv

SIG = ModelSignature("vllm-secure-model", n_layers=2, n_kv_heads=2, head_dim=16, dtype="float32", vocab_size=1000)
BS = 8
AGENTS = ["vsec-a", "vsec-b", "vsec-m", "vsec-engine", "vsec-peer"]


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, Credentials, Path]]:
    """A nats-server with one user per agent and for the group's scheduler; the credentials file."""
    block, creds = permissions_config([AgentGrant(a, "default") for a in AGENTS], ["default"])
    path = tmp_path_factory.mktemp("secure") / "credentials.json"
    save_credentials(creds, path)
    server = NatsServer(extra_config=block).start()
    try:
        yield server, creds, path
    finally:
        server.stop()


@pytest.fixture
async def team(secure: tuple[NatsServer, Credentials, Path]) -> AsyncIterator[dict[str, Any]]:
    """The group's scheduler as its own user, and engines A and B as theirs."""
    server, creds, path = secure
    sched = await GroupScheduler.connect(
        server.url, "default", config=SchedulerConfig(max_active=8), nats_options=creds.scheduler_options("default")
    )
    clients: list[KVBusClient] = []
    try:
        for name in ("vsec-a", "vsec-b"):
            config = ConnectorConfig.from_extra(
                {"agent": name, "nats_url": server.url, "credentials": str(path), "load_timeout_s": 5.0}, environ={}
            )
            client = KVBusClient(config, SIG, block_size=BS, dtype=torch.float32)
            await client.start()
            clients.append(client)
        yield {"a": clients[0], "b": clients[1], "url": server.url, "creds": creds}
    finally:
        for c in clients:
            await c.close()
        await sched.close()


async def _mallory(url: str, creds: Credentials) -> tuple[NatsTransport, list[str]]:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    return await NatsTransport.connect(url, error_cb=on_error, **creds.agent_options("vsec-m")), errors


async def _violation(errors: list[str], needle: str, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any("permissions violation" in e.lower() and needle.lower() in e.lower() for e in errors):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no permissions violation on {needle!r}; got {errors}")


async def test_engines_share_kv_as_their_own_users(team: dict[str, Any]) -> None:
    """The index, have, pull and push all work under per-agent permissions."""
    a, b = team["a"], team["b"]
    assert a.index is not None and b.index is not None  # the prefix index bucket is theirs to use
    kv = random_kv(SIG, 40, seed=1)
    a.save(kv, "r1")
    await a.settled()
    reply = await b.lookup(kv.tokens[0].tolist(), 40)
    assert (reply.remote, reply.holder) == (40, "vsec-a")
    got = await b.pull("vsec-a", kv.tokens, 40, timeout=10, medium="full")
    assert got.equal(kv)
    kv2 = random_kv(SIG, 24, seed=2)
    a.save(kv2, "r2")
    pushed = await a.push(["vsec-b"], kv2.tokens[0].tolist(), "full")
    assert pushed.ok, pushed.reason
    await b.settled()
    assert b.held(kv2.tokens) == 24
    # The operator's control, as agent A's user, asks A to push and B what it holds.
    control = await AsyncControl.connect(team["url"], **team["creds"].agent_options("vsec-a"))
    try:
        kv3 = random_kv(SIG, 16, seed=3)
        a.save(kv3, "r3")
        assert (await control.push("vsec-a", "vsec-b", kv3.tokens)).ok
        assert await control.have("vsec-b", kv3.tokens) == 16
    finally:
        await control.close()


async def test_an_agent_cannot_read_or_act_for_another_engine(team: dict[str, Any]) -> None:
    a = team["a"]
    kv = random_kv(SIG, 16, seed=4)
    a.save(kv, "r4")
    await a.settled()
    mallory, errors = await _mallory(team["url"], team["creds"])
    stolen: list[bytes] = []

    async def steal(msg: Any) -> None:
        stolen.append(msg.data)

    try:
        # Another engine's connector subjects cannot be read (its lookups, pulls, pushes).
        await mallory.subscribe("kvbus.vllm.vsec-b.>", steal)
        await _violation(errors, "kvbus.vllm.vsec-b.>")
        # A pull for B (B's name ends the subject), a push by A, a lookup of A's scheduler, or a
        # failure of B's pull, sent by another agent: the server refuses each.
        pull = PullRequest(pull_id="p" * 8, requester="vsec-b", tokens=kv.tokens[0].tolist(), medium="full")
        for name, data in (
            (subject("vsec-a", "pull", "vsec-b"), pull.encode()),
            (subject("vsec-a", "push"), PushRequest(to=["vsec-m"], tokens=kv.tokens[0].tolist()).encode()),
            (subject("vsec-a", "lookup"), b""),
            (subject("vsec-b", "pulled", "vsec-a"), PullOutcome(pull_id="p" * 8, ok=False).encode()),
            ("$KV.kvbus_agents.vsec-a", b"forged"),
        ):
            await mallory.publish(name, data)
            await _violation(errors, name)
        # Under its own name, a pull that says it is B's is refused by A (the message is not the
        # subject's word), and nothing is sent to anyone.
        refused = PullReply.decode(await mallory.request(subject("vsec-a", "pull", "vsec-m"), pull.encode(), 5.0))
        assert not refused.ok and "requester" in refused.reason
        # Its own pull, under its own name, is served as any agent's would be.
        own = PullRequest(pull_id="q" * 8, requester="vsec-m", tokens=kv.tokens[0].tolist(), medium="full")
        assert PullReply.decode(await mallory.request(subject("vsec-a", "pull", "vsec-m"), own.encode(), 5.0)).ok
        assert stolen == []
    finally:
        await mallory.close()


async def test_a_failure_report_from_another_holder_does_not_fail_a_pull(team: dict[str, Any]) -> None:
    """Without secure mode too: only the holder asked (its name ends the subject) can fail a pull."""
    b = team["b"]
    kv = random_kv(SIG, 16, seed=5)
    team["a"].save(kv, "r5")
    await team["a"].settled()
    task = asyncio.create_task(b.pull("vsec-a", kv.tokens, 16, timeout=10, medium="full"))
    await asyncio.sleep(0)
    for pull_id in list(b._pulls):
        await b._on_pulled(_Msg(subject("vsec-b", "pulled", "vsec-m"), PullOutcome(pull_id=pull_id, ok=False).encode()))
    assert (await task).equal(kv)


class _Msg:
    def __init__(self, subject: str, data: bytes) -> None:
        self.subject, self.data = subject, data


def test_credentials_without_the_agent_are_a_config_error(secure: tuple[NatsServer, Credentials, Path]) -> None:
    _, _, path = secure
    config = ConnectorConfig.from_extra({"agent": "vsec-nobody", "credentials": str(path)}, environ={})
    assert config.is_secure
    with pytest.raises(ConfigError, match="no user for agent 'vsec-nobody'"):
        config.connect_options()
    missing = ConnectorConfig.from_extra({"agent": "vsec-a", "credentials": str(path) + ".gone"}, environ={})
    with pytest.raises(ConfigError, match="cannot read"):
        missing.connect_options()
    assert ConnectorConfig.from_extra({"agent": "x", "secure": True}, environ={}).is_secure


@pytest.mark.timeout(900)  # an engine's start takes 1-4 minutes on a busy 2-core machine
async def test_a_vllm_engine_pulls_as_its_own_user(
    secure: tuple[NatsServer, Credentials, Path], tmp_path: Path
) -> None:
    """A real engine configured with ``credentials``: its scheduler's lookup, the index and its
    worker's pull all run under its user, and the prompt's KV comes from a peer agent."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]', see the README)")
    from transformers import AutoConfig

    from kvbus.app.models import model_folder
    from kvbus.integrations.vllm.keys import matchable_tokens, salt_scope
    from tests.vllm_helpers import SMOLLM2, prompt
    from tests.vllm_helpers import engine as vllm_engine

    server, creds, path = secure
    block = 32
    signature = ModelSignature.from_hf_config(
        AutoConfig.from_pretrained(str(model_folder())), model=SMOLLM2, dtype=torch.float32
    )
    sched = await GroupScheduler.connect(
        server.url, "default", config=SchedulerConfig(max_active=8), nats_options=creds.scheduler_options("default")
    )
    engine = vllm_engine(
        "vsec-engine",
        model_folder(),
        tmp_path / "engine.log",
        nats_url=server.url,
        model_name=SMOLLM2,
        block=block,
        max_model_len=1024,
        max_num_seqs=2,
        credentials=str(path),
    )
    peer_config = ConnectorConfig.from_extra(
        {"agent": "vsec-peer", "nats_url": server.url, "credentials": str(path)}, environ={}
    )
    peer = KVBusClient(peer_config, signature, block_size=block, dtype=torch.float32)
    try:
        await asyncio.to_thread(engine.launch)
        await asyncio.to_thread(engine.wait_ready, 900.0)
        await peer.start()
        p = prompt(200, offset=7000)
        n = matchable_tokens(len(p), block)
        first = (await asyncio.to_thread(engine.generate, [p], max_tokens=8))[0]
        # The peer pulls the engine's saved prefix (the engine serves as its own user) ...
        deadline = time.monotonic() + 30
        while peer.held(torch.tensor([p])) < n and time.monotonic() < deadline:
            try:
                await peer.pull("vsec-engine", torch.tensor([p]), n, timeout=10, medium="full")
            except Exception:
                await asyncio.sleep(0.5)
        got = await peer.get(torch.tensor([p]), n)
        assert got.seq_len == n
        # ... and keeps it for a tenant the engine never served: the engine's request of that
        # tenant finds it through the index and pulls it, all under per-agent permissions.
        peer.save(got, "t", salt=salt_scope("tenant-s"))
        await peer.settled()
        second = (await asyncio.to_thread(engine.generate, [p], max_tokens=8, cache_salt="tenant-s"))[0]
        assert second["num_cached_tokens"] == n
        assert second["kv_transfer_params"]["kvbus"]["source"] == "vsec-peer"
        assert second["token_ids"] == first["token_ids"]
    finally:
        await peer.close()
        await asyncio.to_thread(engine.close)
        await sched.close()
