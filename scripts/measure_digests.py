"""What hashing every chunk before the `Open` costs a 64 MB send.

Usage: ``.venv/bin/python scripts/measure_digests.py [--runs N] [--mb 64] [--json PATH]``.

Two figures: the xxh3-64 digest list of a 64 MB payload in 1 MB chunks (what the sender now
computes before its `Open`, off the event loop), and end-to-end ``send`` of a 64 MB ``full``
context to a receiver in another process (embedded nats-server and group scheduler), the median
of ``runs``. Run it against another checkout (``PYTHONPATH`` pointing at its ``kvbus``) to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import Any

RECEIVER = r"""
import asyncio, sys
from kvbus.bus import Bus, BusConfig
from kvbus.signature import ModelSignature

async def main():
    sig = ModelSignature("digest-model", n_layers=32, n_kv_heads=8, head_dim=128, dtype="bfloat16", vocab_size=32000)
    bus = await Bus.connect(sys.argv[1], config=BusConfig(keep_bases=False))
    agent = await bus.agent("digest-rx", signature=sig)
    print("ready", flush=True)
    async for d in agent.inbox():
        print(d.transfer_id, flush=True)

asyncio.run(main())
"""


def hash_figure(mb: int, runs: int) -> dict[str, float]:
    import os

    import xxhash

    data = memoryview(os.urandom(mb << 20))
    chunk = 1 << 20
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        b"".join(xxhash.xxh3_64_digest(data[i : i + chunk]) for i in range(0, len(data), chunk))
        times.append(time.perf_counter() - t0)
    best, median = min(times), statistics.median(times)
    return {
        "hash_ms_median": round(median * 1000, 2),
        "hash_ms_best": round(best * 1000, 2),
        "hash_gbps": round(mb / 1024 / best, 2),
    }


async def send_figure(mb: int, runs: int) -> dict[str, Any]:
    import torch

    from kvbus.app.local import NatsServer
    from kvbus.bus import Bus, BusConfig
    from kvbus.group_scheduler import GroupScheduler
    from kvbus.kvcache import KVCache
    from kvbus.signature import ModelSignature

    sig = ModelSignature("digest-model", n_layers=32, n_kv_heads=8, head_dim=128, dtype="bfloat16", vocab_size=32000)
    n = (mb << 20) // sig.kv_bytes_per_token()
    g = torch.Generator().manual_seed(0)
    shape = (1, sig.n_kv_heads, n, sig.head_dim)
    kv = KVCache(
        torch.randint(0, 32000, (1, n), generator=g),
        sig,
        [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(sig.n_layers)],
        [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(sig.n_layers)],
    )
    server = NatsServer().start()
    sched = await GroupScheduler.connect(server.url, "default")
    rx = subprocess.Popen([sys.executable, "-c", RECEIVER, server.url], stdout=subprocess.PIPE)
    bus = await Bus.connect(server.url, config=BusConfig(keep_bases=False))
    try:
        assert rx.stdout is not None
        assert b"ready" in rx.stdout.readline()
        tx = await bus.agent("digest-tx", signature=sig)
        totals, streams = [], []
        for i in range(runs + 1):
            report = await tx.send("digest-rx", kv, medium="full")
            rx.stdout.readline()
            if i:  # the first run warms up
                totals.append(report.total_s)
                streams.append(report.transfer_s)
        return {
            "send_ms_median": round(statistics.median(totals) * 1000, 1),
            "stream_ms_median": round(statistics.median(streams) * 1000, 1),
            "send_mb_per_s": round(kv.nbytes / 2**20 / statistics.median(totals), 1),
        }
    finally:
        rx.kill()
        rx.wait()
        await bus.close()
        await sched.close()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--json", type=str, default="")
    args = parser.parse_args()
    results = {**hash_figure(args.mb, args.runs), **asyncio.run(send_figure(args.mb, args.runs))}
    print(json.dumps(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"suite": "digests", "config": {"mb": args.mb, "runs": args.runs}, "results": results}, f)


if __name__ == "__main__":
    main()
