"""Worker operations every bench can use: bus connections and agents in a worker process, and a
bit-exact transfer check (`kvbus testbed selftest`, the tests).

Each operation is ``async def op(ctx, **args)`` (see `kvbus.app.testbed.worker`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any

import torch

from kvbus.app.testbed.worker import WorkerContext
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

logger = logging.getLogger(__name__)

#: The signature of `random_kv` caches when none is given.
DEFAULT_SIGNATURE = ModelSignature(
    "testbed-shape", n_layers=4, n_kv_heads=4, head_dim=64, dtype="bfloat16", vocab_size=32000
)


def random_kv(nbytes: int, seed: int, signature: ModelSignature = DEFAULT_SIGNATURE) -> KVCache:
    """A random KV-cache of about ``nbytes`` bytes of keys and values."""
    n = max(1, nbytes // signature.kv_bytes_per_token())
    g = torch.Generator().manual_seed(seed)
    shape = (1, signature.n_kv_heads, n, signature.head_dim)
    keys = [torch.randn(shape, generator=g).to(signature.torch_dtype) for _ in range(signature.n_layers)]
    values = [torch.randn(shape, generator=g).to(signature.torch_dtype) for _ in range(signature.n_layers)]
    return KVCache(torch.randint(0, signature.vocab_size, (1, n), generator=g), signature, keys, values)


def kv_digest(kv: KVCache) -> str:
    """A blake2b digest of a cache's tokens and every key and value byte."""
    h = hashlib.blake2b(digest_size=16)
    h.update(kv.tokens.contiguous().numpy().tobytes())
    for t in (*kv.keys, *kv.values):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


async def bus(
    ctx: WorkerContext,
    url: str,
    key: str = "default",
    config: dict[str, Any] | None = None,
    paths: dict[str, Any] | None = None,
) -> Any:
    """The worker's bus connection ``key`` to ``url`` (made on first use, closed with the worker);
    ``paths``: `PathsConfig` fields over the process's ``KVBUS_PATHS_*`` (e.g. ``{"allowed": "nats"}``)."""
    from kvbus.bus import Bus, BusConfig
    from kvbus.bus.paths import PathsConfig

    buses: dict[str, Any] = ctx.state.setdefault("buses", {})
    if key not in buses:
        path_config = dataclasses.replace(PathsConfig.from_env(), **paths) if paths else None
        b = await Bus.connect(url, config=BusConfig(**(config or {})), paths=path_config)
        buses[key] = b
        ctx.on_close(b.close)
    return buses[key]


async def agent(
    ctx: WorkerContext,
    *,
    url: str,
    name: str,
    group: str,
    signature: dict[str, Any] | None = None,
    link_bps: float = 0.0,
    latency_s: float = 0.0,
    priority: float = 1.0,
    role: str = "agent",
    bus_key: str = "default",
    bus_config: dict[str, Any] | None = None,
    paths: dict[str, Any] | None = None,
) -> str:
    """Register agent ``name`` on this worker's bus ``bus_key`` (made with ``bus_config`` and
    ``paths``, see `bus`); ``link_bps`` declares its link's capacity to the schedulers (an
    `EmulatedLink` with no latency of its own: the testbed's link has the real one)."""
    from kvbus.bus import EmulatedLink

    b = await bus(ctx, url, bus_key, bus_config, paths)
    sig = ModelSignature.from_dict(signature) if signature else DEFAULT_SIGNATURE
    link = EmulatedLink(link_bps, latency_s) if link_bps or latency_s else None
    a = await b.agent(name, group=group, signature=sig, link=link, priority=priority, role=role)
    ctx.state.setdefault("agents", {})[name] = a
    return name


def get_agent(ctx: WorkerContext, name: str) -> Any:
    """An agent registered in this worker (KeyError naming the ones there are)."""
    agents: dict[str, Any] = ctx.state.get("agents", {})
    if name not in agents:
        raise KeyError(f"no agent {name!r} in this worker; agents: {', '.join(agents) or 'none'}")
    return agents[name]


async def close_agent(ctx: WorkerContext, name: str) -> None:
    """Close and forget agent ``name``."""
    a = ctx.state.get("agents", {}).pop(name, None)
    if a is not None:
        await a.close()


async def send_random(
    ctx: WorkerContext, *, sender: str, to: str, nbytes: int, seed: int, medium: str = "full"
) -> dict[str, Any]:
    """Send a random cache; returns its digest and the transfer report's figures."""
    kv = random_kv(nbytes, seed)
    report = await get_agent(ctx, sender).send(to, kv, medium=medium)
    return {
        "digest": kv_digest(kv),
        "nbytes": report.nbytes,
        "medium": report.medium,
        "total_s": report.total_s,
        "chunks": report.chunks,
        "retransmits": report.retransmits,
        "path": report.path,
    }


async def receive_digest(ctx: WorkerContext, *, receiver: str, timeout: float = 60.0) -> dict[str, Any]:
    """Wait for one delivery; returns its sender and the digest of what arrived."""
    d = await get_agent(ctx, receiver).receive(timeout=timeout)
    return {"src": d.sender, "digest": kv_digest(d.kv), "n_tokens": d.kv.n_tokens}


async def scheduler_start(ctx: WorkerContext, *, url: str, group: str, config: dict[str, Any] | None = None) -> str:
    """Run group ``group``'s scheduler in this worker (a process of its own, as `kvbus group-scheduler`
    is, but the driver can read its counters)."""
    from kvbus.group_scheduler import GroupScheduler, SchedulerConfig

    sched = await GroupScheduler.connect(url, group, config=SchedulerConfig.from_env(**(config or {})))
    ctx.state.setdefault("schedulers", {})[group] = sched
    ctx.on_close(sched.close)
    return sched.name


async def scheduler_stats(ctx: WorkerContext, *, group: str) -> dict[str, Any]:
    """Counters of the scheduler of ``group`` running in this worker."""
    s = ctx.state["schedulers"][group].state
    return {
        "granted": s.granted,
        "completed": s.completed,
        "failed": s.failed,
        "preemptions": s.preemptions,
        "declined_pauses": s.declined_pauses,
    }


async def scheduler_stop(ctx: WorkerContext, *, group: str) -> None:
    """Close the scheduler of ``group``."""
    sched = ctx.state.get("schedulers", {}).pop(group, None)
    if sched is not None:
        await sched.close()


async def coordinator_start(ctx: WorkerContext, *, url: str, config: dict[str, Any] | None = None) -> str:
    """Run a coordinator in this worker."""
    from kvbus.coordinator import Coordinator

    kwargs: dict[str, Any] = {}
    if config:
        from kvbus.coordinator import CoordinatorConfig

        kwargs["config"] = CoordinatorConfig(**config)
    coord = await Coordinator.connect(url, **kwargs)
    ctx.state["coordinator"] = coord
    ctx.on_close(coord.close)
    return "coordinator"
