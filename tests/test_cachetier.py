"""The cache tier against a real Redis-protocol server: shedding, offload and fetch, misses,
deduplication, restarts, single-flight reads, prefetch, AUTH, and hostile records."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import ssl
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgpack
import pytest
import redis.asyncio as aioredis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbus.app.local import RedisServer
from kvbus.app.models import random_model
from kvbus.bus import Bus
from kvbus.cachetier import (
    BlockInfo,
    BlockUnavailable,
    CacheTier,
    CacheTierConfig,
    ContextMismatch,
    RecordFormatError,
    RemoteUnavailable,
    Stub,
    TierListener,
    UnsuitableCodec,
    UtilityPolicy,
    block_spans,
    parse_record,
)
from kvbus.cachetier.record import META_FIELD, build_record, checksum, open_record
from kvbus.cachetier.remote import RemoteStore, redact
from kvbus.codecs import available_codecs, get_codec
from kvbus.codecs.runner import HFRunner
from kvbus.errors import KVBusError
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature
from tests.kvutil import random_kv

BLOCK = 32
VOCAB = 256
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TierFactory = Callable[..., Awaitable[CacheTier]]


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runner() -> HFRunner:
    """A small random Llama: prefill of a few hundred tokens takes milliseconds."""
    return random_model(n_layers=2, n_kv_heads=2, head_dim=16, vocab_size=VOCAB, seed=7)


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def make_tier(redis_server: RedisServer, runner: HFRunner) -> AsyncIterator[TierFactory]:
    """Tiers on the session Redis sharing one fresh key prefix (so tests never see each other's blocks)."""
    prefix = f"kvbus:test:{uuid.uuid4().hex[:8]}:"
    tiers: list[CacheTier] = []

    async def make(*, url: str | None = redis_server.url, with_runner: bool = True, **options: Any) -> CacheTier:
        policy = options.pop("policy", None)
        clock = options.pop("clock", None)
        signature = options.pop("signature", runner.signature)
        config = CacheTierConfig(**{"block_tokens": BLOCK, "key_prefix": prefix, "remote_ttl": 0, **options})
        extra: dict[str, Any] = {"clock": clock} if clock is not None else {}
        tier = await CacheTier.connect(
            url, signature=signature, runner=runner if with_runner else None, config=config, policy=policy, **extra
        )
        tiers.append(tier)
        return tier

    make.prefix = prefix  # type: ignore[attr-defined]
    try:
        yield make
    finally:
        for tier in tiers:
            await tier.close()


def context(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def close_to(a: KVCache, b: KVCache, atol: float = 1e-4) -> bool:
    return (
        torch.equal(a.tokens, b.tokens)
        and a.n_layers == b.n_layers
        and all(torch.allclose(x, y, atol=atol, rtol=0) for x, y in zip(a.keys + a.values, b.keys + b.values))
    )


async def record_keys(client: aioredis.Redis, prefix: str) -> list[bytes]:
    return [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]


async def hgetall_calls(client: aioredis.Redis) -> int:
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_hgetall", {}).get("calls", 0))


# -- keys ---------------------------------------------------------------------------------------


def test_block_keys_chain_the_prefix_and_bind_the_model() -> None:
    sig = ModelSignature("m", n_layers=2, n_kv_heads=2, head_dim=16, vocab_size=VOCAB)
    a = context(100, 1)
    b = a.clone()
    b[0, 40] = (b[0, 40] + 1) % VOCAB  # differs inside the second block
    ka = block_spans(a, sig, torch.float32, BLOCK)
    kb = block_spans(b, sig, torch.float32, BLOCK)
    assert [s.stop for s in ka] == [32, 64, 96, 100]
    assert ka[0].key == kb[0].key  # same first block: shared
    assert all(x.key != y.key for x, y in zip(ka[1:], kb[1:]))  # every later block depends on the change
    assert block_spans(a[:, :64], sig, torch.float32, BLOCK) == ka[:2]
    assert block_spans(a.to(torch.int32)[0], sig, torch.float32, BLOCK) == ka
    other_model = ModelSignature("m2", n_layers=2, n_kv_heads=2, head_dim=16, vocab_size=VOCAB)
    assert block_spans(a, other_model, torch.float32, BLOCK)[0].key != ka[0].key
    assert block_spans(a, sig, torch.bfloat16, BLOCK)[0].key != ka[0].key
    assert block_spans(a[:, :32], sig, torch.float32, 64)[0].key != ka[0].key  # the blocking is bound too


def test_a_salt_gives_every_block_a_key_of_its_own() -> None:
    sig = ModelSignature("m", n_layers=2, n_kv_heads=2, head_dim=16, vocab_size=VOCAB)
    a = context(100, 1)
    plain = block_spans(a, sig, torch.float32, BLOCK)
    assert block_spans(a, sig, torch.float32, BLOCK, salt="") == plain  # no salt: the keys as ever
    t1 = block_spans(a, sig, torch.float32, BLOCK, salt="tenant-1")
    t2 = block_spans(a, sig, torch.float32, BLOCK, salt="tenant-2")
    assert [s.stop for s in t1] == [s.stop for s in plain]
    keys = [s.key for s in plain + t1 + t2]
    assert len(set(keys)) == len(keys)  # no block of one salt shares a key with another's
    # The salt is length-delimited in the seed: no two salts run into each other.
    assert (
        block_spans(a, sig, torch.float32, BLOCK, salt="a|b")[0].key
        != block_spans(a, sig, torch.float32, BLOCK, salt="a|b|")[0].key
    )


async def test_blocks_put_with_a_salt_are_found_only_with_it(make_tier: TierFactory) -> None:
    """A tenant's blocks: another salt (or none) finds nothing, here or through the shared remote tier."""
    owner = await make_tier(codec="full", drop_below=0.0, with_runner=False)
    other = await make_tier(codec="full", drop_below=0.0, with_runner=False)
    kv = random_kv(owner.signature, 96, seed=11)
    await owner.put(kv, salt="tenant-1")
    assert owner.lookup(kv, salt="tenant-1") == 96
    assert owner.lookup(kv) == 0 and owner.lookup(kv, salt="tenant-2") == 0
    with pytest.raises(BlockUnavailable):
        await owner.get(kv, salt="tenant-2")
    assert (await owner.get(kv, salt="tenant-1")).equal(kv)
    await owner.shed(target_bytes=0)  # now only in the remote tier, under the salted keys
    with pytest.raises(BlockUnavailable):
        await other.load(kv, salt="tenant-2")
    with pytest.raises(BlockUnavailable):
        await other.load(kv)
    assert await other.load(kv, salt="tenant-1") == 3
    assert (await other.get(kv, salt="tenant-1")).equal(kv)
    assert other.discard(kv, salt="tenant-1") == 3 and other.lookup(kv, salt="tenant-1") == 0


def test_block_keys_agree_across_processes() -> None:
    code = (
        "import torch; from kvbus.signature import ModelSignature; from kvbus.cachetier import block_spans; "
        "sig = ModelSignature('m', n_layers=2, n_kv_heads=2, head_dim=16, vocab_size=256); "
        "print(','.join(s.key for s in block_spans(torch.arange(100) % 256, sig, torch.float32, 32)))"
    )
    sig = ModelSignature("m", n_layers=2, n_kv_heads=2, head_dim=16, vocab_size=VOCAB)
    here = ",".join(s.key for s in block_spans(torch.arange(100) % 256, sig, torch.float32, BLOCK))
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == here


# -- offload and fetch --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_offload_then_fetch_is_bit_exact_with_full(
    make_tier: TierFactory, redis_client: aioredis.Redis, dtype: str
) -> None:
    sig = ModelSignature("rand", n_layers=3, n_kv_heads=2, head_dim=16, dtype=dtype, vocab_size=VOCAB)
    kv = random_kv(sig, 150, seed=3)
    tier = await make_tier(codec="full", drop_below=0.0, signature=sig, with_runner=False)
    keys = await tier.put(kv)
    assert len(keys) == 5 and tier.resident_blocks() == 5
    report = await tier.shed(target_bytes=0)
    assert report.offloaded == 5 and tier.resident_blocks() == 0
    assert tier.memory_bytes == kv.tokens.numel() * 8  # only the token ids stay
    stubs = {s.key: s for s in tier.stubs()}
    assert set(stubs) == set(keys)
    first = stubs[keys[0]]
    assert (first.codec, first.dtype, first.shape) == ("full", dtype, (1, 2, BLOCK, 16))
    assert first.size == first.nbytes == sum(first.sizes)
    assert len(await record_keys(redis_client, make_tier.prefix)) == 5  # type: ignore[attr-defined]
    got = await tier.get(kv)
    assert got.equal(kv)
    assert tier.stats.fetched == 5 and tier.stats.recomputed == 0


async def test_get_assembles_into_a_kv_buffer_of_the_contexts_shape_and_ignores_another(
    make_tier: TierFactory,
) -> None:
    from kvbus.bus.kvbuffer import kv_buffer

    sig = ModelSignature("rand", n_layers=3, n_kv_heads=2, head_dim=16, dtype="float32", vocab_size=VOCAB)
    kv = random_kv(sig, 4 * BLOCK, seed=8)
    tier = await make_tier(codec="full", drop_below=0.0, signature=sig, with_runner=False)
    await tier.put(kv)
    await tier.shed(target_bytes=0)  # half fetched from the server, half resident
    await tier.load(kv.slice(0, 2 * BLOCK))
    out = kv_buffer(sig, 4 * BLOCK)
    got = await tier.get(kv, out=out)
    assert got is out and got.equal(kv) and got.segment is not None
    wrong = kv_buffer(sig, 3 * BLOCK)
    again = await tier.get(kv, out=wrong)
    assert again is not wrong and again.equal(kv) and again.segment is None
    assert not wrong.keys[0].any()  # left as it was


async def test_offload_then_fetch_with_int8_is_within_the_quantisation_bound(make_tier: TierFactory) -> None:
    sig = ModelSignature("rand", n_layers=2, n_kv_heads=2, head_dim=16, dtype="float32", vocab_size=VOCAB)
    g = torch.Generator().manual_seed(5)
    shape = (1, 2, 100, 16)
    kv = KVCache(
        context(100, 5),
        sig,
        [torch.randn(shape, generator=g) * 3 for _ in range(2)],
        [torch.randn(shape, generator=g) for _ in range(2)],
    )
    tier = await make_tier(codec="int8", drop_below=0.0, signature=sig, with_runner=False)
    await tier.put(kv)
    report = await tier.shed(target_bytes=0)
    assert report.offloaded == 4 and report.bytes_written < kv.nbytes * 0.4
    got = await tier.get(kv)
    assert torch.equal(got.tokens, kv.tokens) and got.fidelity < 1.0
    for k, k2 in zip(kv.keys, got.keys):
        step = k.abs().amax(dim=2, keepdim=True) / 127  # per channel, over the whole context (>= per block)
        assert bool(((k - k2).abs() <= step * 0.51 + 1e-6).all())
    for v, v2 in zip(kv.values, got.values):
        step = v.abs().amax(dim=3, keepdim=True) / 127  # per token
        assert bool(((v - v2).abs() <= step * 0.51 + 1e-6).all())


async def test_a_fetched_block_is_shed_again_without_a_write(make_tier: TierFactory, runner: HFRunner) -> None:
    tier = await make_tier(codec="full", drop_below=0.0)
    kv = runner.prefill(context(64, 9))
    await tier.put(kv)
    await tier.shed(target_bytes=0)
    await tier.get(kv)
    written = tier.stats.bytes_written
    report = await tier.shed(target_bytes=0)
    assert report.released == 2 and report.offloaded == 0 and tier.stats.bytes_written == written


# -- shedding -----------------------------------------------------------------------------------


async def test_shedding_keeps_memory_under_budget_in_a_multi_turn_workload(
    make_tier: TierFactory, runner: HFRunner
) -> None:
    """Three conversations grow turn by turn and are revisited; old ones go cold on a fake clock."""
    now = [0.0]
    per_token = runner.signature.kv_bytes_per_token() + 8
    budget = 600 * per_token  # room for about two of the longer conversations
    tier = await make_tier(
        budget_bytes=budget, high_watermark=0.9, low_watermark=0.7, half_life=10.0, drop_below=0.3, clock=lambda: now[0]
    )
    convs = {name: context(96, seed) for seed, name in enumerate(["plan", "code", "review"])}
    reference: dict[str, KVCache] = {}
    g = torch.Generator().manual_seed(11)
    order = ["plan", "code", "plan", "review", "code", "review", "plan", "code", "review", "plan", "code", "plan"]
    for turn, name in enumerate(order):
        now[0] += 8.0 if turn != 8 else 60.0  # one long pause: everything goes cold
        if name in reference:  # revisit: the KV must come back right, from memory, Redis or recompute
            got = await tier.get(convs[name])
            ref = reference[name]
            assert torch.equal(got.tokens, ref.tokens)
            for x, y in zip(got.keys + got.values, ref.keys + ref.values):
                step = y.abs().amax() / 127  # int8 offloads, per-block scales, bounded by the global max
                assert bool(((x - y).abs() <= step + 1e-4).all()), f"turn {turn}: {name} came back wrong"
            assert tier.memory_bytes <= budget
            convs[name] = torch.cat([convs[name], torch.randint(0, VOCAB, (1, 64), generator=g)], dim=1)
        reference[name] = runner.prefill(convs[name])
        await tier.put(reference[name])
        assert tier.memory_bytes <= tier.config.high_bytes, f"turn {turn}: {tier.memory_bytes} > high watermark"
    s = tier.stats
    assert s.peak_memory_bytes <= budget
    assert s.offloaded > 0 and s.dropped > 0 and s.fetched > 0 and s.recomputed > 0, s
    unmanaged = sum(kv.nbytes for kv in reference.values())
    assert unmanaged > budget  # the workload really needed the tier


async def test_cold_blocks_are_dropped_and_hot_ones_offloaded(make_tier: TierFactory, runner: HFRunner) -> None:
    now = [0.0]
    tier = await make_tier(codec="int8", half_life=1.0, drop_below=0.5, clock=lambda: now[0])
    cold = runner.prefill(context(64, 1))
    hot = runner.prefill(context(64, 2))
    await tier.put(cold)
    now[0] = 10.0  # ten half-lives later
    await tier.put(hot)
    report = await tier.shed(target_bytes=0)
    assert report.dropped == 2 and report.offloaded == 2
    assert tier.lookup(cold) == 0 and tier.lookup(hot) == 64


async def test_memory_only_tier_drops_and_recomputes(make_tier: TierFactory, runner: HFRunner) -> None:
    tier = await make_tier(url=None)
    kv = runner.prefill(context(80, 4))
    await tier.put(kv)
    report = await tier.shed(target_bytes=0)
    assert report.dropped == 3 and len(tier) == 0
    assert close_to(await tier.get(kv.tokens), kv)
    assert tier.stats.recomputed == 3

    bare = await make_tier(url=None, with_runner=False)
    await bare.put(kv)
    await bare.shed(target_bytes=0)
    with pytest.raises(BlockUnavailable) as err:
        await bare.get(kv)
    assert len(err.value.keys) == 3


async def test_codecs_that_cannot_store_a_block_alone_are_refused(make_tier: TierFactory, runner: HFRunner) -> None:
    with pytest.raises(UnsuitableCodec):
        await make_tier(codec="tokens")  # carries no KV
    with pytest.raises(UnsuitableCodec):
        await make_tier(codec="no-such-codec")
    for spec in ("delta", "topk", "split"):  # needs a base / keeps only some positions / recomputes
        if spec in available_codecs():
            with pytest.raises(UnsuitableCodec):
                await make_tier(codec=spec)

    class Picky(UtilityPolicy):
        def codec_for(self, block: BlockInfo) -> str:
            return "full" if block.start == 0 else "tokens"  # a cost model gone wrong for later blocks

    tier = await make_tier(policy=Picky(drop_below=0.0))
    kv = runner.prefill(context(64, 3))
    await tier.put(kv)
    report = await tier.shed(target_bytes=0)
    assert report.offloaded == 1 and report.dropped == 1
    assert close_to(await tier.get(kv), kv)


@pytest.mark.parametrize("spec", ["int4(64)", "lowrank"])
async def test_any_dense_kv_codec_spec_can_store_blocks(make_tier: TierFactory, runner: HFRunner, spec: str) -> None:
    if spec.split("(")[0] not in available_codecs():
        pytest.skip(f"codec {spec!r} is not registered")
    tier = await make_tier(codec=spec, drop_below=0.0)
    kv = runner.prefill(context(64, 5))
    await tier.put(kv)
    assert (await tier.shed(target_bytes=0)).offloaded == 2
    assert {s.codec for s in tier.stubs()} == {get_codec(spec).name}  # the canonical spec names the record
    got = await tier.get(kv)
    assert tier.stats.fetched == 2 and tier.stats.recomputed == 0
    assert torch.equal(got.tokens, kv.tokens) and got.fidelity < 1.0


async def test_put_refuses_another_model_or_dtype(make_tier: TierFactory, runner: HFRunner) -> None:
    tier = await make_tier()
    kv = runner.prefill(context(40, 1))
    with pytest.raises(ContextMismatch):
        await tier.put(kv.to(torch.bfloat16))
    other = ModelSignature("other", n_layers=2, n_kv_heads=2, head_dim=16, vocab_size=VOCAB)
    with pytest.raises(ContextMismatch):
        await tier.put(random_kv(other, 40))
    with pytest.raises(ContextMismatch):
        await tier.get(torch.zeros(3, 4, 5))


# -- misses -------------------------------------------------------------------------------------


async def test_record_deleted_or_damaged_behind_the_tiers_back_is_recomputed(
    make_tier: TierFactory, runner: HFRunner, redis_client: aioredis.Redis
) -> None:
    tier = await make_tier(codec="full", drop_below=0.0)
    kv = runner.prefill(context(128, 21))
    keys = await tier.put(kv)
    await tier.shed(target_bytes=0)
    rk = [tier.remote.record_key("full", k) for k in keys]  # type: ignore[union-attr]
    await redis_client.delete(rk[1])  # deleted (TTL, eviction)
    await redis_client.hset(rk[2], b"1", b"\x00" * 4)  # a buffer cut short
    fields = await redis_client.hgetall(rk[3])
    key_bytes = bytearray(fields[b"1"])
    key_bytes[0] ^= 0xFF  # one byte flipped
    await redis_client.hset(rk[3], b"1", bytes(key_bytes))
    got = await tier.get(kv)
    assert close_to(got, kv)
    assert tier.stats.fetched == 1 and tier.stats.misses == 3 and tier.stats.recomputed == 3
    assert torch.equal(got.keys[0][:, :, :32], kv.keys[0][:, :, :32])  # the intact block is the stored one


async def test_flushed_server_is_a_clean_miss(make_tier: TierFactory, runner: HFRunner) -> None:
    server = RedisServer().start()
    try:
        tier = await make_tier(url=server.url, codec="int8", drop_below=0.0)
        kv = runner.prefill(context(96, 8))
        await tier.put(kv)
        await tier.shed(target_bytes=0)
        assert len(tier.stubs()) == 3
        server.kill()  # no persistence: a restart comes back empty
        server.start()
        assert close_to(await tier.get(kv), kv)
        assert tier.stats.misses == 3 and tier.stats.recomputed == 3
    finally:
        server.stop()


class _AofRedis(RedisServer):
    """A Redis that fsyncs every write to its append-only file, so a kill loses nothing confirmed."""

    def _command(self) -> list[str]:
        return [*super()._command(), "--appendonly", "yes", "--appendfsync", "always"]


class _KillAfterFirstBatch(TierListener):
    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.batches = 0

    def offloaded(self, keys: list[str]) -> None:
        self.batches += 1
        if self.batches == 1:
            self.server.kill()  # mid-offload: the next batch's write finds no server


async def test_redis_restart_mid_offload_leaves_no_dangling_stub(runner: HFRunner) -> None:
    server = _AofRedis().start()
    listener = _KillAfterFirstBatch(server)
    config = CacheTierConfig(
        block_tokens=BLOCK,
        codec="full",
        drop_below=0.0,
        write_batch_bytes=1,
        retries=1,
        connect_timeout=1.0,
        remote_ttl=0,
    )
    tier = await CacheTier.connect(server.url, runner=runner, config=config)
    tier.listener = listener
    try:
        kv = runner.prefill(context(160, 31))
        await tier.put(kv)
        report = await tier.shed(target_bytes=0)
        assert listener.batches == 1
        assert report.offloaded == 1 and report.dropped == 4 and tier.stats.remote_errors == 1
        stubs = tier.stubs()
        assert len(stubs) == 1
        server.start()  # same port, same folder: the append-only file comes back
        # Every stub the tier holds points at a whole record that matches it.
        client = aioredis.Redis.from_url(server.url)
        try:
            for stub in stubs:
                fields = await client.hgetall(tier.remote.record_key(stub.codec, stub.key))  # type: ignore[union-attr]
                parse_record(fields, stub.key, stub)
        finally:
            await client.aclose()
        got = await tier.get(kv)
        assert close_to(got, kv)
        assert torch.equal(got.keys[0][:, :, :BLOCK], kv.keys[0][:, :, :BLOCK])
        assert tier.stats.fetched == 1 and tier.stats.recomputed == 4
    finally:
        await tier.close()
        server.stop()


async def test_remote_gone_for_good_still_keeps_the_budget(runner: HFRunner) -> None:
    server = RedisServer().start()
    per_block = BLOCK * (runner.signature.kv_bytes_per_token() + 8)
    config = CacheTierConfig(
        block_tokens=BLOCK, budget_bytes=4 * per_block, drop_below=0.0, retries=0, connect_timeout=0.5, remote_ttl=0
    )
    tier = await CacheTier.connect(server.url, runner=runner, config=config)
    try:
        server.stop()
        for seed in range(4):
            await tier.put(runner.prefill(context(96, seed)))
            assert tier.memory_bytes <= config.budget_bytes
        assert tier.stats.remote_errors > 0 and tier.stats.offloaded == 0 and tier.stubs() == []
        assert close_to(await tier.get(context(96, 0)), runner.prefill(context(96, 0)))
    finally:
        await tier.close()


@pytest.mark.parametrize("eviction", ["allkeys-lru", "noeviction"])
async def test_a_full_server_never_leaves_half_a_record(runner: HFRunner, eviction: str) -> None:
    """The server runs out of memory mid-offload: it evicts whole records (LRU) or refuses writes.

    Either way every stub points at a whole record or at nothing, and every context comes back right.
    """
    server = RedisServer(maxmemory="3mb").start()
    client = aioredis.Redis.from_url(server.url)
    config = CacheTierConfig(
        block_tokens=BLOCK, codec="full", drop_below=0.0, remote_ttl=0, retries=0, write_batch_bytes=64 * 1024
    )
    tier = await CacheTier.connect(server.url, runner=runner, config=config)
    try:
        await client.config_set("maxmemory-policy", eviction)
        kvs = [runner.prefill(context(320, 300 + i)) for i in range(20)]  # 200 blocks, ~3.3 MB of payload
        for kv in kvs:
            await tier.put(kv)
        await tier.shed(target_bytes=0)
        s = tier.stats
        assert s.offloaded > 0
        if eviction == "noeviction":
            assert s.dropped > 0  # refused writes left no stub; those blocks are recomputable
        lengths = set()
        for stub in tier.stubs():
            lengths.add(await client.hlen(tier.remote.record_key(stub.codec, stub.key)))  # type: ignore[union-attr]
        assert lengths <= {0, len(tier.stubs()[0].sizes) + 1}  # whole or absent, never half
        if eviction == "allkeys-lru":
            assert 0 in lengths  # the server did evict records behind the tier's back
        for kv in kvs:
            assert close_to(await tier.get(kv.tokens), kv)
        assert tier.stats.recomputed > 0
    finally:
        await tier.close()
        await client.aclose()
        server.stop()


# -- sharing ------------------------------------------------------------------------------------


async def test_two_agents_with_the_same_prefix_store_it_once(
    make_tier: TierFactory, runner: HFRunner, redis_client: aioredis.Redis
) -> None:
    shared = context(96, 40)
    a_ctx = torch.cat([shared, context(32, 41)], dim=1)
    b_ctx = torch.cat([shared, context(32, 42)], dim=1)
    a = await make_tier(drop_below=0.0)
    b = await make_tier(drop_below=0.0)
    kv_a, kv_b = runner.prefill(a_ctx), runner.prefill(b_ctx)
    await a.put(kv_a)
    await b.put(kv_b)
    ra = await a.shed(target_bytes=0)
    rb = await b.shed(target_bytes=0)
    assert ra.offloaded == 4
    assert rb.adopted == 3 and rb.offloaded == 1  # only b's own last block is written
    assert len(await record_keys(redis_client, make_tier.prefix)) == 5  # type: ignore[attr-defined]
    # A third agent that never computed anything reads the shared prefix without recomputing.
    c = await make_tier(with_runner=False)
    got = await c.get(shared)
    assert c.stats.fetched == 3 and c.stats.recomputed == 0
    assert close_to(got, kv_a.slice(0, 96), atol=0.05)


async def test_concurrent_fetches_of_the_same_blocks_read_each_once(
    make_tier: TierFactory, runner: HFRunner, redis_client: aioredis.Redis
) -> None:
    tier = await make_tier(codec="full", drop_below=0.0)
    kv = runner.prefill(context(128, 50))
    await tier.put(kv)
    await tier.shed(target_bytes=0)
    before = await hgetall_calls(redis_client)
    results = await asyncio.gather(tier.prefetch(kv), *(tier.get(kv) for _ in range(8)), tier.load(kv.tokens))
    assert await hgetall_calls(redis_client) - before == 4  # one HGETALL per block, for ten concurrent loads
    assert tier.stats.remote_reads == 4 and tier.stats.fetched == 4
    assert all(r.equal(kv) for r in results[1:9])

    # A prefetch cancelled while it loads leaves nobody waiting forever: the next get loads itself.
    await tier.shed(target_bytes=0)
    task = tier.prefetch(kv)
    await asyncio.sleep(0)
    task.cancel()
    assert (await asyncio.wait_for(tier.get(kv), 30)).equal(kv)


# -- prefetch and the agent hooks ---------------------------------------------------------------


async def test_prefetch_makes_a_later_get_local(make_tier: TierFactory, runner: HFRunner, bus: Bus) -> None:
    tier = await make_tier(drop_below=0.0)
    agent = await bus.agent("cachetier-agent", runner=runner, cache=tier)
    kv = runner.prefill(context(128, 60))
    await tier.put(kv)
    assert agent.cache_bytes == tier.memory_bytes > 0
    await tier.shed(target_bytes=0)
    task = agent.prefetch(kv.tokens)
    assert isinstance(task, asyncio.Task)
    assert await task == 4
    assert tier.resident_blocks() == 4 and agent.cache_bytes == tier.memory_bytes
    reads, stall = tier.stats.remote_reads, tier.stats.stall_seconds
    got = await tier.get(kv)
    assert tier.stats.remote_reads == reads and tier.stats.stall_seconds == stall  # nothing left to wait for
    assert close_to(got, kv, atol=0.05)


async def test_a_listener_set_after_construction_gets_the_events(runner: HFRunner) -> None:
    tier = CacheTier(runner.signature, runner=runner, config=CacheTierConfig(block_tokens=BLOCK, drop_below=1e9))
    events: list[tuple[str, int]] = []

    class Recording(TierListener):
        def dropped(self, keys: list[str]) -> None:
            events.append(("dropped", len(keys)))

        def recomputed(self, keys: list[str]) -> None:
            events.append(("recomputed", len(keys)))

    try:
        kv = runner.prefill(context(96, 61))
        await tier.put(kv)
        tier.listener = Recording()
        report = await tier.shed(target_bytes=0)
        assert report.dropped == 3 and tier.memory_bytes < kv.nbytes
        await tier.get(kv)
        assert events == [("dropped", 3), ("recomputed", 3)]
    finally:
        await tier.close()


async def test_closed_tier_cancels_prefetches(make_tier: TierFactory, runner: HFRunner) -> None:
    tier = await make_tier(url=None)
    task = tier.prefetch(context(512, 1))  # recomputes in the background
    await tier.close()
    assert task.done()
    with pytest.raises(KVBusError):
        await tier.get(context(32, 1))


# -- URLs and credentials -----------------------------------------------------------------------


async def test_auth_by_url(runner: HFRunner) -> None:
    server = RedisServer(password="s3cret-pw").start()
    config = CacheTierConfig(block_tokens=BLOCK, codec="full", drop_below=0.0, remote_ttl=60, retries=0)
    try:
        async with await CacheTier.connect(server.url, runner=runner, config=config) as tier:
            kv = runner.prefill(context(64, 70))
            await tier.put(kv)
            assert (await tier.shed(target_bytes=0)).offloaded == 2
            assert (await tier.get(kv)).equal(kv)
        wrong = server.url.replace("s3cret-pw", "wrong")
        with pytest.raises(RemoteUnavailable) as err:
            await CacheTier.connect(wrong, runner=runner, config=config)
        assert "wrong" not in str(err.value) and "***" in str(err.value)
        with pytest.raises(RemoteUnavailable):
            await CacheTier.connect(server.url.replace(":s3cret-pw@", "@"), runner=runner, config=config)
    finally:
        server.stop()


async def test_acl_user_limited_to_the_key_prefix(runner: HFRunner) -> None:
    """A Redis 6+ ACL user (``redis://user:password@...``) that may touch only the tier's keys."""
    server = RedisServer(password="admin-pw").start()
    admin = aioredis.Redis.from_url(server.url)
    try:
        await admin.execute_command("ACL", "SETUSER", "agent", "on", ">agent-pw", "~kvbus:acl:*", "+@all")
        url = f"redis://agent:agent-pw@127.0.0.1:{server.port}/0"
        config = CacheTierConfig(
            block_tokens=BLOCK, codec="full", drop_below=0.0, key_prefix="kvbus:acl:", remote_ttl=30
        )
        async with await CacheTier.connect(url, runner=runner, config=config) as tier:
            kv = runner.prefill(context(64, 71))
            await tier.put(kv)
            assert (await tier.shed(target_bytes=0)).offloaded == 2
            assert (await tier.get(kv)).equal(kv)
            assert tier.stats.fetched == 2
        # The same user outside its prefix: the server refuses every write, the tier drops instead.
        outside = CacheTierConfig(block_tokens=BLOCK, codec="full", drop_below=0.0, key_prefix="other:", remote_ttl=0)
        async with await CacheTier.connect(url, runner=runner, config=outside) as tier:
            await tier.put(kv)
            report = await tier.shed(target_bytes=0)
            assert report.offloaded == 0 and report.dropped == 2 and tier.stubs() == []
    finally:
        await admin.aclose()
        server.stop()


@pytest.fixture(scope="module")
def tls_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1, made with the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            key,
            "-out",
            cert,
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


@contextlib.asynccontextmanager
async def tls_terminator(target_port: int, cert: str, key: str) -> AsyncIterator[tuple[int, list[int]]]:
    """A TLS endpoint in front of a plain Redis (the embedded Valkey is built without TLS)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    handshakes = [0]

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handshakes[0] += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    try:
        yield server.sockets[0].getsockname()[1], handshakes
    finally:
        server.close()


async def test_rediss_url_goes_over_verified_tls(
    runner: HFRunner, redis_server: RedisServer, tls_cert: tuple[str, str]
) -> None:
    cert, key = tls_cert
    config = CacheTierConfig(
        block_tokens=BLOCK,
        codec="int8",
        drop_below=0.0,
        remote_ttl=30,
        retries=0,
        key_prefix=f"kvbus:tls:{uuid.uuid4().hex[:8]}:",
    )
    async with tls_terminator(redis_server.port, cert, key) as (port, handshakes):
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"
        async with await CacheTier.connect(url, runner=runner, config=config) as tier:
            kv = runner.prefill(context(96, 72))
            await tier.put(kv)
            assert (await tier.shed(target_bytes=0)).offloaded == 3
            assert close_to(await tier.get(kv), kv, atol=0.05)
            assert tier.stats.fetched == 3
        assert handshakes[0] >= 1
        # Without the CA the self-signed certificate is refused: a clean error, not a plain-text fallback.
        with pytest.raises(RemoteUnavailable):
            await CacheTier.connect(f"rediss://127.0.0.1:{port}/0", runner=runner, config=config)


def test_tls_urls_use_tls_and_passwords_are_redacted() -> None:
    store = RemoteStore("rediss://user:pw@cache.example:6380/2", CacheTierConfig())
    kwargs = store.client.connection_pool.connection_kwargs
    assert "ssl" in store.client.connection_pool.connection_class.__name__.lower()
    assert (kwargs["host"], kwargs["port"], kwargs["db"], kwargs["password"]) == ("cache.example", 6380, 2, "pw")
    assert redact("rediss://user:pw@cache.example:6380/2") == "rediss://user:***@cache.example:6380/2"
    assert redact("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    with pytest.raises(RemoteUnavailable):
        RemoteStore("http://nope", CacheTierConfig())


# -- hostile records ----------------------------------------------------------------------------


SIG = ModelSignature("fuzz", n_layers=2, n_kv_heads=1, head_dim=4, vocab_size=VOCAB)
_KV = random_kv(SIG, 6, seed=1)
_STUB, _FIELDS, _ = build_record("ab" * 16, _KV, "full")
_FIELDS = {k: bytes(v) for k, v in _FIELDS.items()}
_META = msgpack.unpackb(_FIELDS[META_FIELD])
_STUB8, _FIELDS8, _ = build_record("cd" * 16, _KV, "int8")
_FIELDS8 = {k: bytes(v) for k, v in _FIELDS8.items()}

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=10), inner, max_size=6),
    max_leaves=20,
)


@FUZZ
@given(st.binary(max_size=300) | msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True)))
def test_stub_decoder_rejects_garbage_with_record_format_error(raw: bytes) -> None:
    try:
        Stub.from_bytes(raw)
    except RecordFormatError:
        pass


@FUZZ
@given(st.sampled_from(sorted(_META)), msgpack_values)
def test_stub_decoder_checks_every_field(name: str, value: Any) -> None:
    meta = {**_META, name: value}
    try:
        stub = Stub.from_bytes(msgpack.packb(meta, use_bin_type=True))
    except RecordFormatError:
        return
    assert isinstance(stub, Stub)


@FUZZ
@given(st.sampled_from([(_STUB, _FIELDS), (_STUB8, _FIELDS8)]), st.data())
def test_hostile_records_never_decode_to_wrong_data(record: tuple[Stub, dict[bytes, bytes]], data: Any) -> None:
    stub, fields = record
    fields = dict(fields)
    names = sorted(fields)
    kind = data.draw(st.sampled_from(["none", "flip", "truncate", "drop", "extra", "meta", "reseal"]))
    target = data.draw(st.sampled_from(names))
    if kind == "flip" and fields[target]:
        raw = bytearray(fields[target])
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        fields[target] = bytes(raw)
    elif kind == "truncate":
        fields[target] = fields[target][: data.draw(st.integers(0, max(0, len(fields[target]) - 1)))]
    elif kind == "drop":
        del fields[target]
    elif kind == "extra":
        fields[data.draw(st.binary(min_size=1, max_size=4))] = data.draw(st.binary(max_size=8))
    elif kind in ("meta", "reseal"):
        # Hostile codec metadata, resealed with a matching checksum when asked: then only the
        # stub we kept, the codec's own checks and the block checks stand in the way.
        meta = msgpack.unpackb(fields[META_FIELD])
        codec_meta = msgpack.unpackb(meta["meta"])
        field_name = data.draw(st.sampled_from(sorted(codec_meta)))
        codec_meta[field_name] = data.draw(msgpack_values)
        meta["meta"] = msgpack.packb(codec_meta, use_bin_type=True)
        if kind == "reseal":
            meta["checksum"] = checksum(meta["meta"], [fields[str(i).encode()] for i in range(len(meta["sizes"]))])
        fields[META_FIELD] = msgpack.packb(meta, use_bin_type=True)
    for expected in (stub, None):
        try:
            got_stub, encoded = parse_record(fields, stub.key, expected)
            kv = open_record(got_stub, encoded, _KV.tokens, SIG)
        except KVBusError:
            continue
        if expected is not None:  # it passed our own checksum: it must be exactly what we stored
            assert got_stub.same_payload(stub)
            if stub.codec == "full":
                assert kv.equal(_KV)
        assert torch.equal(kv.tokens, _KV.tokens)
    if kind == "none":
        assert open_record(*parse_record(fields, stub.key, stub), _KV.tokens, SIG).n_layers == 2


def test_record_for_another_block_or_model_is_refused() -> None:
    with pytest.raises(RecordFormatError, match="not"):
        parse_record(_FIELDS, "ef" * 16)
    stub, encoded = parse_record(_FIELDS, _STUB.key, _STUB)
    with pytest.raises(RecordFormatError, match="token ids"):
        open_record(stub, encoded, _KV.tokens + 1, SIG)
    other = ModelSignature("other", n_layers=2, n_kv_heads=1, head_dim=4, vocab_size=VOCAB)
    with pytest.raises(RecordFormatError):
        open_record(stub, encoded, _KV.tokens, other)
    assert open_record(stub, encoded, _KV.tokens, SIG).equal(_KV)


def test_policy_validates_its_arguments() -> None:
    with pytest.raises(KVBusError):
        UtilityPolicy(half_life=0)
    with pytest.raises(KVBusError):
        CacheTierConfig(low_watermark=0.95, high_watermark=0.9)
