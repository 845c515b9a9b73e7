"""The roles of `kvbus bench sched`, run in worker processes (`kvbus.app.testbed.worker`): the
receiver host's agent, and the sender host's bulk, critical, weighted and urgent senders.

Each operation registers fresh agents (names carry the round), runs its load, closes them and
returns what it measured. Times are ``time.monotonic()``: one clock for every process of the
machine, so spans measured in one process compare with another's.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from typing import Any

import torch

from kvbus.app.testbed import ops
from kvbus.app.testbed.worker import WorkerContext
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

MB = 1_000_000
SIG = ModelSignature("llama-shape", n_layers=8, n_kv_heads=8, head_dim=128, dtype="bfloat16", vocab_size=32000)
BUS = {
    "ack_timeout": 1.0,
    "peer_timeout": 30.0,
    "request_timeout": 5.0,
    "grant_timeout": 120.0,
    "partial_timeout": 30.0,
}


def make_kv(nbytes: int, seed: int = 0) -> KVCache:
    """A Llama-shaped bf16 cache of about ``nbytes``."""
    g = torch.Generator().manual_seed(seed)
    n = max(1, nbytes // SIG.kv_bytes_per_token())
    shape = (1, SIG.n_kv_heads, n, SIG.head_dim)
    keys = [torch.randn(shape, generator=g).to(SIG.torch_dtype) for _ in range(SIG.n_layers)]
    values = [torch.randn(shape, generator=g).to(SIG.torch_dtype) for _ in range(SIG.n_layers)]
    return KVCache(torch.randint(0, SIG.vocab_size, (1, n), generator=g), SIG, keys, values)


def _kv(ctx: WorkerContext, nbytes: int, seed: int) -> KVCache:
    cache: dict[tuple[int, int], KVCache] = ctx.state.setdefault("kv", {})
    if (nbytes, seed) not in cache:
        cache[(nbytes, seed)] = make_kv(nbytes, seed)
    return cache[(nbytes, seed)]


class Spans:
    """(stream start, done, bytes) of each transfer per sender, for throughput over a window."""

    def __init__(self) -> None:
        self.items: dict[str, list[tuple[float, float, int]]] = {}

    def add(self, who: str, t0: float, report: Any) -> None:
        """Record one transfer of ``who`` that started at ``t0``."""
        self.items.setdefault(who, []).append(
            (t0 + report.queued_s + report.encode_s, t0 + report.total_s, report.nbytes)
        )

    def rate(self, who: str, a: float, b: float) -> float:
        """Bytes per second ``who`` moved between ``a`` and ``b``."""
        total = 0.0
        for s, e, n in self.items.get(who, []):
            overlap = max(0.0, min(e, b) - max(s, a))
            total += n * overlap / max(e - s, 1e-9)
        return total / (b - a)


#: The data paths a transfer's payload may take when the bench pins one (`pinned`): ``nats``
#: alone, or a direct path with NATS beside it (inline payloads and fall backs take NATS).
PINNED = {"nats": "nats", "tcp": "tcp,nats", "shm": "shm,nats"}


def pinned(path: str) -> dict[str, Any]:
    """(bus key, `PathsConfig` fields) of agents whose payloads take ``path`` ("": the process's
    own paths, every one by default)."""
    if not path:
        return {"bus_key": "default", "paths": None}
    if path not in PINNED:
        raise ValueError(f"unknown path {path!r}; use one of {', '.join(PINNED)}")
    return {"bus_key": f"path-{path}", "paths": {"allowed": PINNED[path]}}


async def _agents(
    ctx: WorkerContext,
    url: str,
    group: str,
    names: list[str],
    priorities: list[float] | None = None,
    path: str = "",
) -> list[Any]:
    out = []
    for i, name in enumerate(names):
        await ops.agent(
            ctx,
            url=url,
            name=name,
            group=group,
            signature=SIG.to_dict(),
            priority=priorities[i] if priorities else 1.0,
            bus_config=BUS,
            **pinned(path),
        )
        out.append(ops.get_agent(ctx, name))
    return out


async def _bulk(
    agent: Any,
    to: str,
    kv: KVCache,
    stop: float,
    spans: Spans,
    lat: list[float],
    paths: collections.Counter[str] | None = None,
) -> None:
    while time.monotonic() < stop:
        t0 = time.monotonic()
        report = await agent.send(to, kv, medium="full")
        spans.add(agent.name, t0, report)
        lat.append(report.total_s)
        if paths is not None:
            paths[report.path] += 1


def sent(t0: float, report: Any) -> dict[str, Any]:
    """What the sender knows of one transfer's phases (monotonic ``t0`` at `send`), to be joined
    with the receiver's `arrivals` by `kvbus.app.bench.sched.phases`."""
    return {
        "transfer_id": report.transfer_id,
        "t0": t0,
        "queued_s": report.queued_s,
        "encode_s": report.encode_s,
        "transfer_s": report.transfer_s,
        "total_s": report.total_s,
        "rate_bps": report.rate_bps,
        "nbytes": report.nbytes,
        "reason": str(report.decision.get("reason", "")),
    }


async def _periodic(
    agent: Any,
    to: str,
    kv: KVCache,
    stop: float,
    every: float,
    lat: list[float],
    phase: float,
    sends: list[dict[str, Any]] | None = None,
) -> None:
    """Open loop: one critical send every ``every`` seconds, each in its own task."""
    tasks = []

    async def one() -> None:
        t0 = time.monotonic()
        report = await agent.send(to, kv, medium="full", critical=True)
        lat.append(report.total_s)
        if sends is not None:
            sends.append(sent(t0, report))

    await asyncio.sleep(phase)
    nxt = time.monotonic()
    while nxt < stop:
        tasks.append(asyncio.create_task(one()))
        nxt += every
        await asyncio.sleep(max(0.0, nxt - time.monotonic()))
    await asyncio.gather(*tasks)


async def receiver(
    ctx: WorkerContext,
    *,
    url: str,
    name: str,
    group: str,
    link_bps: float,
    priority: float = 1.0,
    path: str = "",
) -> str:
    """Register the receiving agent (declaring ``link_bps``, 0 = nothing; payloads on ``path``,
    see `pinned`) and drain its inbox."""
    await ops.agent(
        ctx,
        url=url,
        name=name,
        group=group,
        signature=SIG.to_dict(),
        link_bps=link_bps,
        priority=priority,
        bus_config=BUS,
        **pinned(path),
    )
    agent = ops.get_agent(ctx, name)

    arrivals: dict[str, tuple[float, float, float]] = {}

    async def drain() -> None:
        while True:
            delivery = await agent.receive()
            arrivals[delivery.transfer_id] = (time.monotonic(), delivery.transfer_s, delivery.decode_s)
            ctx.state["received"][name] = ctx.state["received"].get(name, 0) + 1

    ctx.state.setdefault("received", {})
    ctx.state.setdefault("arrivals", {})[name] = arrivals
    ctx.state.setdefault("drains", {})[name] = asyncio.create_task(drain())
    return name


async def receiver_arrivals(ctx: WorkerContext, *, name: str) -> dict[str, tuple[float, float, float]]:
    """Per transfer delivered to ``name``: (monotonic time its delivery was taken from the inbox,
    its `Delivery.transfer_s`, its `Delivery.decode_s`)."""
    return dict(ctx.state.get("arrivals", {}).get(name, {}))


async def receiver_stop(ctx: WorkerContext, *, name: str) -> int:
    """Stop draining, close the receiving agent; returns how many deliveries it took."""
    task = ctx.state.get("drains", {}).pop(name, None)
    ctx.state.get("arrivals", {}).pop(name, None)
    if task is not None:
        task.cancel()
    await ops.close_agent(ctx, name)
    return int(ctx.state.get("received", {}).pop(name, 0))


async def critical(
    ctx: WorkerContext,
    *,
    url: str,
    group: str,
    prefix: str,
    rx: str,
    seconds: float,
    bulk_bytes: int,
    crit_bytes: int,
    every: float,
    n_bulk: int = 4,
    n_crit: int = 2,
    warmup: float = 0.5,
    path: str = "",
) -> dict[str, Any]:
    """``n_bulk`` senders keep ``bulk_bytes`` transfers going while ``n_crit`` send ``crit_bytes``
    critical messages every ``every`` s (open loop), payloads on ``path`` (`pinned`). Latencies
    from `send` to verified delivery; ``bulk_paths``: how many bulk transfers took each path."""
    bulk = await _agents(ctx, url, group, [f"{prefix}-b{i}" for i in range(n_bulk)], path=path)
    crit = await _agents(ctx, url, group, [f"{prefix}-c{i}" for i in range(n_crit)], path=path)
    bulk_kv, small_kv = _kv(ctx, bulk_bytes, 1), _kv(ctx, crit_bytes, 2)
    spans = Spans()
    bulk_lat: list[float] = []
    crit_lat: list[float] = []
    crit_sends: list[dict[str, Any]] = []
    bulk_paths: collections.Counter[str] = collections.Counter()
    t_start = time.monotonic()
    stop = t_start + seconds
    try:
        tasks = [asyncio.create_task(_bulk(b, rx, bulk_kv, stop, spans, bulk_lat, bulk_paths)) for b in bulk]
        await asyncio.sleep(warmup)  # bulk saturates first
        await asyncio.gather(
            *(
                _periodic(c, rx, small_kv, stop, every, crit_lat, 0.5 * every * i / max(1, n_crit), crit_sends)
                for i, c in enumerate(crit)
            )
        )
        await asyncio.gather(*tasks)
    finally:
        for a in [*bulk, *crit]:
            await ops.close_agent(ctx, a.name)
    bulk_rate = sum(spans.rate(b.name, t_start + warmup + 0.5, stop - 0.2) for b in bulk)
    return {
        "crit_lat": crit_lat,
        "crit_sends": crit_sends,
        "bulk_lat": bulk_lat,
        "bulk_mb_s": bulk_rate / MB,
        "bulk_paths": dict(bulk_paths),
    }


async def fairness(
    ctx: WorkerContext,
    *,
    url: str,
    group: str,
    prefix: str,
    rx: str,
    seconds: float,
    nbytes: int,
    priorities: list[float],
) -> dict[str, Any]:
    """One sender per priority saturates the receiver; throughput of each over a window that
    leaves out the start."""
    senders = await _agents(ctx, url, group, [f"{prefix}-s{i}" for i in range(len(priorities))], priorities)
    kv = _kv(ctx, nbytes, 3)
    spans, lat = Spans(), list[float]()
    t0 = time.monotonic()
    stop = t0 + seconds
    try:
        await asyncio.gather(*(_bulk(s, rx, kv, stop, spans, lat) for s in senders))
    finally:
        for s in senders:
            await ops.close_agent(ctx, s.name)
    a, b = t0 + min(1.0, seconds / 4), stop - 0.3
    return {"rates": [spans.rate(s.name, a, b) for s in senders], "transfers": len(lat)}


async def urgent(
    ctx: WorkerContext,
    *,
    url: str,
    group: str,
    prefix: str,
    rx: str,
    seconds: float,
    bulk_bytes: int,
    urgent_bytes: int,
    n_bulk: int = 3,
) -> dict[str, Any]:
    """``n_bulk`` bulk senders and one urgent sender (critical transfers 0.2-0.6 s apart)."""
    bulk = await _agents(ctx, url, group, [f"{prefix}-b{i}" for i in range(n_bulk)])
    (hot,) = await _agents(ctx, url, group, [f"{prefix}-u"])
    bulk_kv, urgent_kv = _kv(ctx, bulk_bytes, 4), _kv(ctx, urgent_bytes, 5)
    spans = Spans()
    bulk_lat: list[float] = []
    urgent_lat: list[float] = []
    t0 = time.monotonic()
    stop = t0 + seconds

    async def urgent_loop() -> None:
        rng = random.Random(7)
        await asyncio.sleep(0.3)
        while time.monotonic() < stop:
            t = time.monotonic()
            report = await hot.send(rx, urgent_kv, medium="full", critical=True)
            spans.add(hot.name, t, report)
            urgent_lat.append(report.total_s)
            await asyncio.sleep(rng.uniform(0.2, 0.6))

    try:
        await asyncio.gather(urgent_loop(), *(_bulk(b, rx, bulk_kv, stop, spans, bulk_lat) for b in bulk))
    finally:
        for a in [*bulk, hot]:
            await ops.close_agent(ctx, a.name)
    a, b = t0 + 0.5, stop - 0.2
    return {
        "throughput_mb_s": sum(spans.rate(s, a, b) for s in spans.items) / MB,
        "urgent_lat": urgent_lat,
        "bulk_lat": bulk_lat,
    }
