"""The cache tier on a real Valkey cluster (3 primaries + 3 replicas, cluster mode).

Blocks are written to their primaries and confirmed by a replica (``WAIT``); a primary killed
(SIGKILL) during offload and during fetch loses no confirmed block, and every fetch returns the
right KV (from memory, the remote tier, or a recompute after a clear miss).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import torch

from kvbus.app.models import random_model
from kvbus.app.valkey_cluster import ValkeyCluster
from kvbus.cachetier import CacheTier, CacheTierConfig, TierListener
from kvbus.cachetier.cluster import is_cluster_url, parse_cluster_url
from kvbus.codecs.runner import HFRunner
from kvbus.kvcache import KVCache

BLOCK = 32
VOCAB = 256


@pytest.fixture(scope="module")
def runner() -> HFRunner:
    """A small random Llama (deterministic: a recompute gives the same KV)."""
    return random_model(n_layers=2, n_kv_heads=2, head_dim=16, vocab_size=VOCAB, seed=7)


@pytest.fixture
def valkey() -> Iterator[ValkeyCluster]:
    """A Valkey cluster of this test only (a primary gets killed)."""
    c = ValkeyCluster(3, 1).start()
    try:
        yield c
    finally:
        c.stop()


class Events(TierListener):
    """Counts the tier's events."""

    def __init__(self) -> None:
        self.counts: dict[str, set[str]] = {"offloaded": set(), "fetched": set(), "missed": set(), "recomputed": set()}
        self.on_offload: Any = None

    def offloaded(self, keys: list[str]) -> None:
        self.counts["offloaded"].update(keys)
        if self.on_offload is not None:
            self.on_offload()

    def fetched(self, keys: list[str]) -> None:
        self.counts["fetched"].update(keys)

    def missed(self, keys: list[str]) -> None:
        self.counts["missed"].update(keys)

    def recomputed(self, keys: list[str]) -> None:
        self.counts["recomputed"].update(keys)


def context(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def close_to(a: KVCache, b: KVCache, atol: float = 1e-4) -> bool:
    return torch.equal(a.tokens, b.tokens) and all(
        torch.allclose(x, y, atol=atol, rtol=0) for x, y in zip(a.keys + a.values, b.keys + b.values)
    )


def test_a_node_whose_port_was_taken_starts_on_other_ports() -> None:
    """Found in CI: a node's cluster bus port was taken between drawing it and starting the node
    (its server aborts: "Address already in use"); the cluster starts that node on other ports."""
    import socket

    cluster = ValkeyCluster(primaries=1, replicas=0)
    node = cluster.nodes[0]
    with socket.socket() as held:
        held.bind(("127.0.0.1", node.cluster_port))
        held.listen()
        taken = node.cluster_port
        try:
            cluster.start()
            assert node.cluster_port != taken and node.running
            assert redis.Redis(host="127.0.0.1", port=node.port).ping()
        finally:
            cluster.stop()
    spare = ValkeyCluster(primaries=3, replicas=1)  # never started: each node has a folder to remove
    try:
        assert len({p for n in spare.nodes for p in (n.port, n.cluster_port)}) == 12
    finally:
        spare.stop()


def test_cluster_urls() -> None:
    assert is_cluster_url("redis+cluster://h:1")
    assert is_cluster_url("redis://:pw@a:1,b:2/0")
    assert not is_cluster_url("redis://user:pw,x@a:1/0")  # a comma in the password is no host list
    nodes, opts = parse_cluster_url("rediss+cluster://u:p%40ss@a:1,[::1]:2,c")
    assert nodes == [("a", 1), ("::1", 2), ("c", 6379)]
    assert opts == {"ssl": True, "username": "u", "password": "p@ss"}
    with pytest.raises(ValueError):
        parse_cluster_url("redis+cluster://a:x")


async def make_tier(url: str, runner: HFRunner, **options: Any) -> tuple[CacheTier, Events]:
    events = Events()
    config = CacheTierConfig(
        **{"block_tokens": BLOCK, "key_prefix": f"kvbus:t:{uuid.uuid4().hex[:6]}:", "remote_ttl": 0, **options}
    )
    tier = await CacheTier.connect(url, signature=runner.signature, runner=runner, config=config, listener=events)
    return tier, events


async def test_blocks_are_on_a_replica_when_confirmed(valkey: ValkeyCluster, runner: HFRunner) -> None:
    tier, events = await make_tier(valkey.url, runner, codec="full", drop_below=0.0)
    try:
        assert tier.remote is not None and tier.remote.cluster and tier.remote.wait_replicas == 1
        kv = runner.prefill(context(200, 1))
        keys = await tier.put(kv)
        report = await tier.shed(target_bytes=0)
        assert report.offloaded == len(keys) == len(events.counts["offloaded"])
        # Each record's key carries its block key as the hash tag, and a replica has it already.
        for key in keys:
            rk = tier.remote.record_key("full", key)
            assert rk.endswith("{" + key + "}")
        replicas = [n for i, n in enumerate(valkey.nodes) if valkey.roles().get(i) == "slave"]
        found = 0
        for node in replicas:
            c = node.client()
            c.execute_command("READONLY")
            for key in keys:
                try:
                    found += int(c.execute_command("EXISTS", tier.remote.record_key("full", key)))
                except redis.ResponseError:  # MOVED: another shard's replica
                    continue
        assert found == len(keys)
        got = await tier.get(kv)
        assert close_to(got, kv) and tier.stats.fetched == len(keys)
    finally:
        await tier.close()


async def test_primary_killed_during_offload_and_fetch_loses_no_confirmed_block(
    valkey: ValkeyCluster, runner: HFRunner
) -> None:
    tier, events = await make_tier(valkey.url, runner, codec="full", drop_below=0.0, write_batch_bytes=64 << 10)
    try:
        contexts = [context(160, 10 + i) for i in range(12)]
        reference = [runner.prefill(ids) for ids in contexts]
        for kv in reference:
            await tier.put(kv)
        victim = valkey.primary_indices()[0]
        killed = asyncio.Event()

        def kill_once() -> None:  # a primary dies while the offload is under way
            if not killed.is_set():
                killed.set()
                valkey.kill(victim)

        events.on_offload = kill_once
        await tier.shed(target_bytes=0)
        assert killed.is_set()
        await asyncio.to_thread(valkey.wait_failover, victim)
        confirmed = set(events.counts["offloaded"])
        assert confirmed, "nothing was offloaded"
        # Every block is resident (its write was not confirmed) or a stub whose record a replica had.
        for ids, ref in zip(contexts, reference):
            assert close_to(await tier.get(ids), ref)
        assert not (events.counts["missed"] & confirmed), "a confirmed block was lost in the failover"
        assert not events.counts["recomputed"] & confirmed
        # Fetch during a failover: offload everything again, kill another primary, read it all back.
        await tier.shed(target_bytes=0)
        second = next(i for i in valkey.primary_indices() if valkey.replicas_of(i))
        valkey.kill(second)
        got = await asyncio.gather(*(tier.get(ids) for ids in contexts))
        for g, ref in zip(got, reference):
            assert close_to(g, ref)  # right, fetched or recomputed after a clear miss
    finally:
        await tier.close()
