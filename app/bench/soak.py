"""`kvbus bench soak`: 64 agents transferring continuously; memory must stay flat, no slow
consumers, and every transfer is delivered exactly once.

32 senders each send to their own receiver (another of the 64 agents, each on its own NATS
connection, one process, an embedded nats-server and a group scheduler) in a loop for
``seconds``. Each sender's contexts grow: every send is a longer prefix of the same 2 MB context
(64 KB inline up to 2 MB streamed), so with the receivers keeping their bases (``keep_bases``, the
default) the scheduler may send only the new tokens (``delta+...`` media); at the end of the
context a sender starts again from a short prefix. The process's resident memory is sampled every
second; ``rss_growth_fraction`` compares the median of the last 10 % of the samples with the
median of the first 10 % after the warm-up (the first quarter of the run, at least 5 s).
``slow_consumer_events`` counts slow-consumer reports from the server's log and from every
client's error callback. Every transfer id a sender saw reported delivered must be received
exactly once, and nothing else received: ``received == transfers``, ``duplicated`` 0,
``missing`` 0, ``unexpected`` 0 (``exactly_once`` true).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import random
import statistics
import time
from typing import Any

import psutil

from kvbus.app.bench.chaos_agents import SIG, make_kv
from kvbus.app.local import NatsServer
from kvbus.bus import Bus, BusConfig, TransferError
from kvbus.codecs.spec import medium_spec
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig

GROUP = "soak"
AGENTS = 64
CONFIG = BusConfig(chunk_size=256 * 1024, request_timeout=5.0, partial_timeout=10.0, inline_limit=128 * 1024)
#: Each sender's context (its sends are prefixes of it): 2 MB of KV.
CONTEXT_BYTES = 2 << 20
#: The shortest prefix a sender starts from (64 KB: one inline transfer).
FIRST_BYTES = 64 << 10


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
            pairs.append(
                (
                    await tb.agent(f"soak-tx{i}", group=GROUP, signature=SIG),
                    await rb.agent(f"soak-rx{i}", group=GROUP, signature=SIG),
                )
            )
        per_token = SIG.kv_bytes_per_token()
        contexts = [make_kv(CONTEXT_BYTES, seed=i) for i in range(len(pairs))]
        stop = time.monotonic() + seconds
        counts = {"sent": 0, "received": 0, "failed": 0, "bytes": 0}
        sent_ids: set[str] = set()
        received: collections.Counter[str] = collections.Counter()
        media: collections.Counter[str] = collections.Counter()

        async def sender(tx: Any, rx: Any, context: Any, rng: random.Random) -> None:
            first = FIRST_BYTES // per_token
            n = first
            while time.monotonic() < stop:
                kv = context.slice(0, n)
                try:
                    report = await tx.send(rx.name, kv)
                    counts["sent"] += 1
                    counts["bytes"] += kv.nbytes
                    sent_ids.add(report.transfer_id)
                    media[report.medium] += 1
                except TransferError:
                    counts["failed"] += 1
                n += rng.randint(first // 4, first * 2)
                if n > context.n_tokens:
                    n = first  # a new conversation: no base the receiver holds

        async def receiver(rx: Any) -> None:
            while True:
                d = await rx.receive()
                counts["received"] += 1
                received[d.transfer_id] += 1
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
        await asyncio.gather(*(sender(tx, rx, contexts[i], random.Random(i)) for i, (tx, rx) in enumerate(pairs)))
        elapsed = time.perf_counter() - t0
        await asyncio.sleep(1.0)  # deliveries reported to their senders are in the receivers' inboxes already
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
            "agents": agents,
            "seconds": round(elapsed, 1),
            "transfers": counts["sent"],
            "failed": counts["failed"],
            "received": counts["received"],
            "duplicated": sum(n - 1 for n in received.values() if n > 1),
            "missing": len(sent_ids - set(received)),
            "unexpected": len(set(received) - sent_ids),
            "exactly_once": counts["received"] == counts["sent"] and set(received) == sent_ids,
            "delta_transfers": sum(n for m, n in media.items() if medium_spec(m).delta),
            "media": dict(media),
            "throughput_MBps": round(counts["bytes"] / elapsed / 1e6, 1),
            "rss_start_MB": round(samples[0][1] / 2**20, 1),
            "rss_after_warmup_MB": round(base / 2**20, 1),
            "rss_end_MB": round(end / 2**20, 1),
            "rss_peak_MB": round(max(r for _, r in samples) / 2**20, 1),
            "rss_growth_fraction": round((end - base) / base, 4),
            "slow_consumer_events": slow_server + slow_client,
        }
    finally:
        for b in buses:
            await b.close()
        server.stop()


def run(
    *, quick: bool = False, smoke: bool = False, seconds: float | None = None, agents: int | None = None, **_: Any
) -> dict[str, Any]:
    """Run the soak (``seconds`` defaults to 120, 20 with ``quick``, 10 with 8 agents for a smoke run)."""
    s = seconds or (10.0 if smoke else 20.0 if quick else 120.0)
    agents = agents or (8 if smoke else AGENTS)
    results = asyncio.run(_soak(s, agents))
    print(
        f"soak: {results['agents']} agents, {results['transfers']} transfers in {results['seconds']} s, "
        f"rss growth {results['rss_growth_fraction']:.1%}, {results['slow_consumer_events']} slow-consumer events; "
        f"received {results['received']} of {results['transfers']} sent (exactly once: {results['exactly_once']}, "
        f"{results['delta_transfers']} as deltas)"
    )
    return {
        "suite": "soak",
        "config": {
            "network": "loopback",
            "seconds": s,
            "agents": agents,
            "keep_bases": CONFIG.keep_bases,
            "context_bytes": CONTEXT_BYTES,
        },
        "results": results,
    }
