"""`kvbus bench sched`: the weighted scheduler against FIFO, fairness, the preemption threshold,
and the scheduler's own cost per grant.

Real agents (bus clients on a real nats-server, real group schedulers in this process) send
real KV-caches (Llama-shaped, bf16, ``full`` medium) over emulated links: a receiver declares
its link and the group has a bandwidth budget, and every sender is paced to the rate its grant
(and later ``rate`` controls) gives it, so the link is shared exactly as the policy decides.

- ``critical_p99_ratio_fifo_vs_wrr``: four bulk senders keep 8 MB transfers going to one
  receiver (40 MB/s budget and link, ``max_active`` 4 for both policies, so bulk fills every
  slot) while two critical senders each send a 64 KB critical message every 200 ms (open loop:
  on schedule whether or not the last one is done). p99 of the critical messages' latency
  (``send`` to verified delivery) under FIFO over the same under the weighted policy, in
  the same run.
- ``jain_fairness``: four senders of role priority 0, 1, 2, 4 saturate a 30 MB/s receiver
  (priority 0), so W = 2, 3, 4, 6; Jain's index of throughput / W over a window that leaves
  out the start (1 = shares exactly as weighted). FIFO's index in the same setup is given too.
- ``preempt_threshold_sweep``: three bulk senders (8 MB) and one urgent sender (critical 4 MB
  transfers, 0.2-0.6 s apart; critical boost 7, so urgency 4.5x bulk's and W 11 against 4) on
  a 40 MB/s link, for thresholds 10-80 %: total throughput, p50/p99 of the urgent transfers,
  p99 of bulk, pauses asked / declined.
- ``decision_us_p99``: the policy's own CPU time per grant (thread CPU time of ``decide``) in a
  group of 16 / 64 / 256 agents with half of them sending and half waiting: each step one
  transfer finishes, one arrives, and ``decide`` grants one. Medium selection is the cost
  model's (lead-owned) business and is timed separately (``..._with_selection``); the per-slice
  max-min reallocation of every running transfer (``adjust``) is timed separately as well.
- ``jitter_p99_over_p50``: p99 / p50 of the critical messages' latency under the weighted
  policy (bulk and FIFO figures in ``jitter``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import torch

from kvbus.app.local import NatsServer
from kvbus.bus import Bus, BusConfig, EmulatedLink
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig, WeightedPolicy
from kvbus.group_scheduler.policy import Decision
from kvbus.group_scheduler.scheduler import default_selector
from kvbus.group_scheduler.simulate import SIM_SIGNATURE, FixedSelector
from kvbus.group_scheduler.state import AgentState, GroupState, Pending
from kvbus.kvcache import KVCache
from kvbus.protocol import TransferRequest
from kvbus.signature import ModelSignature

logger = logging.getLogger(__name__)

MB = 1_000_000
SIG = ModelSignature("llama-shape", n_layers=8, n_kv_heads=8, head_dim=128, dtype="bfloat16", vocab_size=32000)
BUS = BusConfig(ack_timeout=1.0, peer_timeout=15.0, request_timeout=5.0, grant_timeout=60.0, partial_timeout=20.0)


def make_kv(nbytes: int, seed: int = 0) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    n = max(1, nbytes // SIG.kv_bytes_per_token())
    shape = (1, SIG.n_kv_heads, n, SIG.head_dim)
    keys = [torch.randn(shape, generator=g).to(SIG.torch_dtype) for _ in range(SIG.n_layers)]
    values = [torch.randn(shape, generator=g).to(SIG.torch_dtype) for _ in range(SIG.n_layers)]
    return KVCache(torch.randint(0, SIG.vocab_size, (1, n), generator=g), SIG, keys, values)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs and any(xs) else float("nan")


@contextlib.asynccontextmanager
async def group(url: str, name: str, **config: Any) -> AsyncIterator[tuple[GroupScheduler, Bus, Bus]]:
    """A scheduler for group ``name`` and two bus connections (senders, receivers)."""
    sched = await GroupScheduler.connect(url, name, config=SchedulerConfig(**config))
    tx, rx = await Bus.connect(url, config=BUS), await Bus.connect(url, config=BUS)
    try:
        yield sched, tx, rx
    finally:
        await tx.close()
        await rx.close()
        await sched.close()


async def drain(agent: Any) -> None:
    while True:
        await agent.receive()


class Spans:
    """(stream start, done, bytes) of each transfer per sender, for throughput over a window."""

    def __init__(self) -> None:
        self.items: dict[str, list[tuple[float, float, int]]] = {}

    def add(self, who: str, t0: float, report: Any) -> None:
        self.items.setdefault(who, []).append(
            (t0 + report.queued_s + report.encode_s, t0 + report.total_s, report.nbytes)
        )

    def rate(self, who: str, a: float, b: float) -> float:
        total = 0.0
        for s, e, n in self.items.get(who, []):
            overlap = max(0.0, min(e, b) - max(s, a))
            total += n * overlap / max(e - s, 1e-9)
        return total / (b - a)


async def bulk_loop(agent: Any, to: str, kv: KVCache, stop: float, spans: Spans, lat: list[float]) -> None:
    while time.monotonic() < stop:
        t0 = time.monotonic()
        report = await agent.send(to, kv, medium="full")
        spans.add(agent.name, t0, report)
        lat.append(report.total_s)


async def periodic(
    agent: Any,
    to: str,
    kv: KVCache,
    stop: float,
    every: float,
    lat: list[float],
    *,
    critical: bool = True,
    phase: float = 0.0,
) -> None:
    """Open loop: one send every ``every`` seconds, each in its own task; latencies into ``lat``."""
    tasks = []

    async def one() -> None:
        report = await agent.send(to, kv, medium="full", critical=critical)
        lat.append(report.total_s)

    await asyncio.sleep(phase)
    nxt = time.monotonic()
    while nxt < stop:
        tasks.append(asyncio.create_task(one()))
        nxt += every
        await asyncio.sleep(max(0.0, nxt - time.monotonic()))
    await asyncio.gather(*tasks)


# -- critical latency under saturation: FIFO vs weighted -----------------------------------------------


async def critical_run(url: str, policy: str, seconds: float) -> dict[str, Any]:
    name = f"bench-crit-{policy}"
    async with group(url, name, policy=policy, bandwidth_bps=40 * MB, max_active=4) as (sched, tx, rxb):
        rx = await rxb.agent(f"{name}-rx", group=name, signature=SIG, link=EmulatedLink(40 * MB))
        bulk = [await tx.agent(f"{name}-b{i}", group=name, signature=SIG) for i in range(4)]
        crit = [await tx.agent(f"{name}-c{i}", group=name, signature=SIG) for i in range(2)]
        bulk_kv, small_kv = make_kv(8 * MB, 1), make_kv(64 * 1024, 2)
        drainer = asyncio.create_task(drain(rx))
        spans, bulk_lat, crit_lat = Spans(), [], []
        t_start = time.monotonic()
        stop = t_start + seconds
        bulk_tasks = [asyncio.create_task(bulk_loop(b, rx.name, bulk_kv, stop, spans, bulk_lat)) for b in bulk]
        await asyncio.sleep(0.5)  # bulk saturates first
        await asyncio.gather(
            *(periodic(c, rx.name, small_kv, stop, 0.2, crit_lat, phase=0.1 * i) for i, c in enumerate(crit))
        )
        await asyncio.gather(*bulk_tasks)
        drainer.cancel()
        bulk_rate = sum(spans.rate(b.name, t_start + 1.0, stop - 0.2) for b in bulk)
        return {
            "critical_p50_ms": 1e3 * pct(crit_lat, 0.5),
            "critical_p99_ms": 1e3 * pct(crit_lat, 0.99),
            "critical_n": len(crit_lat),
            "bulk_p50_s": pct(bulk_lat, 0.5),
            "bulk_p99_s": pct(bulk_lat, 0.99),
            "bulk_mb_s": bulk_rate / MB,
            "crit_lat": crit_lat,
            "bulk_lat": bulk_lat,
            "preemptions": sched.state.preemptions,
        }


# -- fairness --------------------------------------------------------------------------------------------


async def fairness_run(url: str, policy: str, seconds: float) -> dict[str, Any]:
    name = f"bench-fair-{policy}"
    priorities = (0.0, 1.0, 2.0, 4.0)
    async with group(url, name, policy=policy, max_active=8) as (sched, tx, rxb):
        rx = await rxb.agent(f"{name}-rx", group=name, priority=0.0, signature=SIG, link=EmulatedLink(30 * MB))
        senders = [
            await tx.agent(f"{name}-s{i}", group=name, priority=p, signature=SIG) for i, p in enumerate(priorities)
        ]
        kv = make_kv(6 * MB, 3)
        drainer = asyncio.create_task(drain(rx))
        spans, lat = Spans(), []
        t0 = time.monotonic()
        stop = t0 + seconds
        await asyncio.gather(*(bulk_loop(s, rx.name, kv, stop, spans, lat) for s in senders))
        drainer.cancel()
        cfg = sched.config
        u0 = cfg.urgency_base + cfg.urgency_alpha
        weights = [p + 0.0 + u0 for p in priorities]
        a, b = t0 + 1.0, stop - 0.3
        rates = [spans.rate(s.name, a, b) for s in senders]
        total = sum(rates)
        return {
            "jain": jain([r / w for r, w in zip(rates, weights)]),
            "weights": weights,
            "shares": [r / total for r in rates],
            "weight_shares": [w / sum(weights) for w in weights],
            "total_mb_s": total / MB,
        }


# -- preemption threshold sweep -----------------------------------------------------------------------


async def sweep_run(url: str, threshold: float, seconds: float) -> dict[str, Any]:
    name = f"bench-pre-{int(threshold * 100)}"
    # A critical boost of 7 makes the urgent transfers 4.5x as urgent as bulk (just past the
    # preemption ratio of 4) with W 11 against 4: by weight alone they would get 11/23 of the
    # link, so what preemption adds shows.
    async with group(url, name, preempt_threshold=threshold, critical_boost=7.0) as (sched, tx, rxb):
        rx = await rxb.agent(f"{name}-rx", group=name, signature=SIG, link=EmulatedLink(40 * MB))
        bulk = [await tx.agent(f"{name}-b{i}", group=name, signature=SIG) for i in range(3)]
        urgent = await tx.agent(f"{name}-u", group=name, signature=SIG)
        bulk_kv, urgent_kv = make_kv(8 * MB, 4), make_kv(4 * MB, 5)
        drainer = asyncio.create_task(drain(rx))
        spans, bulk_lat, urgent_lat = Spans(), [], []
        t0 = time.monotonic()
        stop = t0 + seconds
        tasks = [asyncio.create_task(bulk_loop(b, rx.name, bulk_kv, stop, spans, bulk_lat)) for b in bulk]
        await asyncio.sleep(0.3)

        async def urgent_loop() -> None:
            rng = random.Random(7)
            while time.monotonic() < stop:
                t = time.monotonic()
                report = await urgent.send(rx.name, urgent_kv, medium="full", critical=True)
                spans.add(urgent.name, t, report)
                urgent_lat.append(report.total_s)
                await asyncio.sleep(rng.uniform(0.2, 0.6))

        await asyncio.gather(urgent_loop(), *tasks)
        drainer.cancel()
        a, b = t0 + 0.5, stop - 0.2
        total = sum(spans.rate(s, a, b) for s in spans.items)
        return {
            "threshold": threshold,
            "throughput_mb_s": total / MB,
            "urgent_p50_ms": 1e3 * pct(urgent_lat, 0.5),
            "urgent_p99_ms": 1e3 * pct(urgent_lat, 0.99),
            "bulk_p99_s": pct(bulk_lat, 0.99),
            "urgent_n": len(urgent_lat),
            "pauses_asked": sched.state.preemptions,
            "pauses_declined": sched.state.declined_pauses,
        }


# -- decision cost ----------------------------------------------------------------------------------------


def decision_cost(n: int, steps: int, selector: Any, seed: int = 1) -> dict[str, float]:
    """Per-grant thread CPU time of ``decide`` and per-call time of ``adjust`` in a group of ``n`` agents."""
    rnd = random.Random(seed)
    state = GroupState("bench", bandwidth_bps=n * 5 * MB)
    sig = SIM_SIGNATURE.to_dict()
    for i in range(n):
        state.agents[f"a{i}"] = AgentState(f"a{i}", role_priority=rnd.choice([0.5, 1.0, 2.0]), last_seen=1e18)
        state.declare(f"a{i}", rnd.choice([10 * MB, 25 * MB, 100 * MB]), 0.0)
    policy = WeightedPolicy(selector, max_active=n // 2)
    now, k = 0.0, 0

    def arrival(src: str, dst: str) -> None:
        nonlocal k
        req = TransferRequest(
            transfer_id=f"t{k}",
            src=src,
            dst=[dst],
            group="bench",
            n_tokens=512,
            nbytes=rnd.choice([1, 4, 16]) * MB,
            signature=sig,
        )
        k += 1
        pending = Pending(req, {dst: SIM_SIGNATURE}, arrived=now)
        state.queue.append(pending)
        policy.queued(state, pending)

    def apply(decisions: list[Decision]) -> int:
        granted = 0
        for d in decisions:
            state.queue.remove(d.pending)
            if d.medium:
                d.pending.granted_at, d.pending.rate_bps = now, d.rate_bps
                state.active[d.pending.transfer_id] = d.pending
                policy.started(state, d.pending)
                granted += 1
        return granted

    for i in range(n):
        arrival(f"a{i}", f"a{(i * 7 + 3) % n}")
        apply(policy.decide(state, now))
        policy.adjust(state, now)
    gc.collect()
    gc.freeze()
    per_grant, adjust = [], []
    clock = time.thread_time_ns
    try:
        for _ in range(steps):
            now += 0.002
            p = state.active.pop(rnd.choice(list(state.active)))
            policy.released(p)
            arrival(p.src, p.dst[0])
            t0 = clock()
            decisions = policy.decide(state, now)
            t1 = clock()
            granted = apply(decisions)
            if granted:
                per_grant.append((t1 - t0) / 1e3 / granted)
            before = policy.reallocations
            t2 = clock()
            policy.adjust(state, now)
            t3 = clock()
            if policy.reallocations != before:
                adjust.append((t3 - t2) / 1e3)
    finally:
        gc.unfreeze()
    return {
        "p50": pct(per_grant, 0.5),
        "p99": pct(per_grant, 0.99),
        "adjust_p50": pct(adjust, 0.5),
        "adjust_p99": pct(adjust, 0.99),
        "grants": len(per_grant),
    }


# -- the suite ----------------------------------------------------------------------------------------------


async def _run(quick: bool, nats_url: str | None) -> dict[str, Any]:
    server = None if nats_url else NatsServer().start()
    url = nats_url or server.url  # type: ignore[union-attr]
    results: dict[str, Any] = {}
    crit_s, fair_s, sweep_s = (8.0, 6.0, 5.0) if quick else (20.0, 15.0, 12.0)
    thresholds = (0.1, 0.2, 0.3, 0.5, 0.8)
    try:
        crit = {p: await critical_run(url, p, crit_s) for p in ("fifo", "wrr")}
        fifo, wrr = crit["fifo"], crit["wrr"]
        results["critical_p99_ratio_fifo_vs_wrr"] = fifo["critical_p99_ms"] / wrr["critical_p99_ms"]
        results["critical"] = {p: {k: v for k, v in c.items() if not k.endswith("_lat")} for p, c in crit.items()}
        results["jitter_p99_over_p50"] = pct(wrr["crit_lat"], 0.99) / pct(wrr["crit_lat"], 0.5)
        results["jitter"] = {
            "wrr_critical": results["jitter_p99_over_p50"],
            "wrr_bulk": pct(wrr["bulk_lat"], 0.99) / pct(wrr["bulk_lat"], 0.5),
            "fifo_critical": pct(fifo["crit_lat"], 0.99) / pct(fifo["crit_lat"], 0.5),
            "fifo_bulk": pct(fifo["bulk_lat"], 0.99) / pct(fifo["bulk_lat"], 0.5),
        }
        fair = {p: await fairness_run(url, p, fair_s) for p in ("wrr", "fifo")}
        results["jain_fairness"] = fair["wrr"]["jain"]
        results["fairness"] = fair
        results["preempt_threshold_sweep"] = [await sweep_run(url, t, sweep_s) for t in thresholds]
    finally:
        if server is not None:
            server.stop()
    steps = 2000 if quick else 6000
    adaptive = default_selector(SchedulerConfig())
    cost = {n: decision_cost(n, steps, FixedSelector()) for n in (16, 64, 256)}
    cost_sel = {n: decision_cost(n, steps // 2, adaptive) for n in (16, 64, 256)}
    results["decision_us_p99"] = {str(n): c["p99"] for n, c in cost.items()}
    results["decision_us_p50"] = {str(n): c["p50"] for n, c in cost.items()}
    results["decision_us_p99_with_selection"] = {str(n): c["p99"] for n, c in cost_sel.items()}
    results["adjust_us_p99"] = {str(n): c["adjust_p99"] for n, c in cost.items()}
    results["adjust_us_p50"] = {str(n): c["adjust_p50"] for n, c in cost.items()}
    return results


def run(*, quick: bool = False, nats_url: str | None = None, **_: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    results = asyncio.run(_run(quick, nats_url))
    config = {
        "signature": SIG.to_dict(),
        "critical": "4 bulk x 8 MB + 2 x 64 KB critical every 200 ms, 40 MB/s, max_active 4",
        "fairness": "priorities 0/1/2/4 -> W 2/3/4/6, 6 MB transfers, 30 MB/s receiver link",
        "sweep": "3 bulk x 8 MB + critical 4 MB every 0.2-0.6 s (critical_boost 7), 40 MB/s",
        "decision": "n/2 running, n/2 waiting; "
        "one done + one arrival per step; thread CPU time of decide() per grant (gc frozen)",
        "seconds": round(time.perf_counter() - t0, 1),
    }
    _print(results)
    return {"suite": "sched", "config": config, "results": results}


def _print(r: dict[str, Any]) -> None:
    print(
        f"critical p99: FIFO {r['critical']['fifo']['critical_p99_ms']:.1f} ms, "
        f"WRR {r['critical']['wrr']['critical_p99_ms']:.1f} ms -> ratio {r['critical_p99_ratio_fifo_vs_wrr']:.1f}"
    )
    print(f"jain fairness: WRR {r['jain_fairness']:.3f}, FIFO {r['fairness']['fifo']['jain']:.3f}")
    for s in r["preempt_threshold_sweep"]:
        print(
            f"  threshold {s['threshold']:.0%}: {s['throughput_mb_s']:.1f} MB/s, urgent p50 {s['urgent_p50_ms']:.0f} "
            f"p99 {s['urgent_p99_ms']:.0f} ms, bulk p99 {s['bulk_p99_s']:.2f} s, pauses {s['pauses_asked']} "
            f"({s['pauses_declined']} declined)"
        )
    print(
        f"decision us p99 per grant: {r['decision_us_p99']} (with the cost model: "
        f"{r['decision_us_p99_with_selection']}); adjust us p99: {r['adjust_us_p99']}"
    )
    print(f"jitter p99/p50: {r['jitter_p99_over_p50']:.2f}")
