"""`kvbus bench soak`: 64 agents transferring continuously; memory must stay flat, no slow consumers.

32 senders each send to their own receiver (another of the 64 agents, each on its own NATS
connection, one process, an embedded nats-server and a group scheduler) in a loop for
``seconds``: contexts of 64 KB (inline) to 2 MB (streamed). The process's resident memory is
sampled every second; ``rss_growth_fraction`` compares the median of the last 10 % of the
samples with the median of the first 10 % after the warm-up (the first quarter of the run, at
least 5 s). ``slow_consumer_events`` counts slow-consumer reports from the server's log and from
every client's error callback.
"""

from __future__ import annotations

import asyncio
import gc
import random
import statistics
import time
from typing import Any

import psutil

from kvbus.app.bench.chaos import SIG, make_kv
from kvbus.app.local import NatsServer
from kvbus.bus import Bus, BusConfig, TransferError
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig

GROUP = "soak"
AGENTS = 64
CONFIG = BusConfig(chunk_size=256 * 1024, request_timeout=5.0, partial_timeout=10.0, keep_bases=False,
                   inline_limit=128 * 1024)


async def _soak(seconds: float, agents: int) -> dict[str, Any]:
    server = NatsServer().start()
    buses: list[Bus] = []
    slow_client = 0

    async def on_error(exc: Exception) -> None:
        nonlocal slow_client
        if "slow consumer" in str(exc).lower():
            slow_client += 1

    try:
        sched = await GroupScheduler.connect(server.url, GROUP, config=SchedulerConfig(max_active=64))
        pairs = []
        for i in range(agents // 2):
            tb = await Bus.connect(server.url, config=CONFIG, error_cb=on_error)
            rb = await Bus.connect(server.url, config=CONFIG, error_cb=on_error)
            buses += [tb, rb]
            pairs.append((await tb.agent(f"soak-tx{i}", group=GROUP, signature=SIG),
                          await rb.agent(f"soak-rx{i}", group=GROUP, signature=SIG)))
        pool = [make_kv(n, seed=s) for s, n in enumerate([64 << 10, 256 << 10, 1 << 20, 2 << 20])]
        stop = time.monotonic() + seconds
        counts = {"sent": 0, "received": 0, "failed": 0, "bytes": 0}

        async def sender(tx: Any, rx: Any, rng: random.Random) -> None:
            while time.monotonic() < stop:
                kv = rng.choice(pool)
                try:
                    await tx.send(rx.name, kv, medium="full")
                    counts["sent"] += 1
                    counts["bytes"] += kv.nbytes
                except TransferError:
                    counts["failed"] += 1

        async def receiver(rx: Any) -> None:
            while True:
                d = await rx.receive()
                counts["received"] += 1
                del d

        proc = psutil.Process()
        samples: list[tuple[float, int]] = []

        async def sample() -> None:
            t0 = time.monotonic()
            while True:
                samples.append((time.monotonic() - t0, proc.memory_info().rss))
                await asyncio.sleep(1.0)

        drains = [asyncio.create_task(receiver(rx)) for _, rx in pairs]
        sampler = asyncio.create_task(sample())
        t0 = time.perf_counter()
        await asyncio.gather(*(sender(tx, rx, random.Random(i)) for i, (tx, rx) in enumerate(pairs)))
        elapsed = time.perf_counter() - t0
        gc.collect()
        samples.append((elapsed, proc.memory_info().rss))
        for task in [*drains, sampler]:
            task.cancel()
        warm = max(5.0, seconds / 4)
        # Medians over windows of ~10 % of the run (at least 3 samples): one sample swings by a
        # few percent with the allocator; a leak moves the whole window.
        width = max(3, int(len(samples) * 0.1))
        after = [rss for t, rss in samples if t >= warm]
        base = statistics.median(after[:width] or [samples[0][1]])
        end = statistics.median([rss for _, rss in samples[-width:]])
        await sched.close()
        log = server._log_text()
        slow_server = log.lower().count("slow consumer")
        return {
            "agents": agents, "seconds": round(elapsed, 1), "transfers": counts["sent"], "failed": counts["failed"],
            "received": counts["received"], "throughput_MBps": round(counts["bytes"] / elapsed / 1e6, 1),
            "rss_start_MB": round(samples[0][1] / 2**20, 1), "rss_after_warmup_MB": round(base / 2**20, 1),
            "rss_end_MB": round(end / 2**20, 1), "rss_peak_MB": round(max(r for _, r in samples) / 2**20, 1),
            "rss_growth_fraction": round((end - base) / base, 4),
            "slow_consumer_events": slow_server + slow_client,
        }
    finally:
        for b in buses:
            await b.close()
        server.stop()


def run(*, quick: bool = False, smoke: bool = False, seconds: float | None = None, agents: int | None = None,
        **_: Any) -> dict[str, Any]:
    """Run the soak (``seconds`` defaults to 120, 20 with ``quick``, 10 with 8 agents for a smoke run)."""
    s = seconds or (10.0 if smoke else 20.0 if quick else 120.0)
    agents = agents or (8 if smoke else AGENTS)
    results = asyncio.run(_soak(s, agents))
    print(f"soak: {results['agents']} agents, {results['transfers']} transfers in {results['seconds']} s, "
          f"rss growth {results['rss_growth_fraction']:.1%}, {results['slow_consumer_events']} slow-consumer events")
    return {"suite": "soak", "config": {"network": "loopback", "seconds": s, "agents": agents}, "results": results}
