"""Receiver memory and event-loop stall while a hostile peer sends the worst Opens it can.

Usage: ``.venv/bin/python scripts/measure_hostile_open.py [--flood N] [--json PATH]``.

Starts an embedded nats-server and a group scheduler, and a receiving agent in its own process
that samples its event loop (a 1 ms tick; the stall is the longest gap beyond the tick) and its
resident memory. A hostile client in this process then sends, one kind after another:

- ``amplifier``: the issue's Open (a few hundred bytes claiming 1 GB in 1-byte chunks);
- ``over_limits``: Opens over the chunk, buffer and byte limits;
- ``worst_accepted``: the largest Open the protocol lets through (16,384 chunk digests, 4,096
  buffers, 240 KB of junk codec metadata), accepted as a partial transfer and never fed;
- ``flood``: ``N`` such Opens with distinct transfer ids (the partial caps bound what is kept).

For each: the receiver's RSS growth (MB) from just before to just after, and its longest stall
(ms); ``baseline_idle_5s`` is the same receiver left idle, the stall the machine itself causes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

RECEIVER = r"""
import asyncio, json, os, sys, time
import psutil
from kvbus.bus import Bus, BusConfig
from kvbus.signature import ModelSignature

async def main():
    sig = ModelSignature(**json.loads(sys.argv[3]))
    bus = await Bus.connect(sys.argv[1], config=BusConfig(partial_timeout=600.0))
    agent = await bus.agent(sys.argv[2], signature=sig)
    proc = psutil.Process()
    state = {"stall": 0.0}

    async def tick():
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            state["stall"] = max(state["stall"], now - last - 0.001)
            last = now

    asyncio.get_running_loop().create_task(tick())
    print("ready", flush=True)
    while True:
        cmd = (await asyncio.to_thread(sys.stdin.readline)).strip()
        if cmd == "reset":
            await asyncio.sleep(0.2)
            state["stall"] = 0.0
        print(json.dumps({"rss": proc.memory_info().rss, "stall": state["stall"],
                          "partials": agent.partial_transfers}), flush=True)

asyncio.run(main())
"""


class ReceiverProcess:
    """The receiving agent in its own process, asked for its RSS, stall and partials over stdin."""

    def __init__(self, url: str, name: str, signature: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RECEIVER, url, name, json.dumps(signature)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if b"ready" not in line:
            raise RuntimeError(f"receiver did not start: {line!r}")

    def ask(self, cmd: str) -> dict[str, Any]:
        """Send a command (``reset`` clears the stall first) and read the receiver's figures."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd.encode() + b"\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        """Kill the receiver."""
        self.proc.kill()
        self.proc.wait()


def _opens(src: str, rx: str, signature: dict[str, Any], flood: int) -> dict[str, list[bytes]]:
    from kvbus.bus.chunking import digests_root
    from kvbus.protocol import MAX_BUFFERS, MAX_CHUNKS, Open, ack_subject, data_subject

    def open_(tid: str, **fields: Any) -> Open:
        base: dict[str, Any] = dict(
            transfer_id=tid,
            src=src,
            codec="full",
            meta={"signature": signature},
            sizes=[1 << 30],
            total=1 << 30,
            chunk_size=1,
            n_chunks=1 << 30,
            digest="0" * 32,
            window=16,
            data_subject=data_subject(rx, src, tid),
            ack_subject=ack_subject(src, rx),
        )
        base.update(fields)
        return Open(**base)

    per_buffer = MAX_CHUNKS // MAX_BUFFERS  # chunks per buffer, all buffers whole-chunk multiples
    sizes = [per_buffer * 1024] * MAX_BUFFERS
    digests = os.urandom(8 * MAX_CHUNKS)
    # Junk metadata: short strings expand the most once decoded (about 50 bytes per 3 on the wire).
    junk = {"signature": signature, "pad": ["ab"] * 15_000, "more": [str(i % 97) for i in range(5_000)]}

    def worst(tid: str) -> bytes:
        return open_(
            tid,
            meta=junk,
            sizes=sizes,
            total=sum(sizes),
            chunk_size=1024,
            n_chunks=MAX_CHUNKS,
            digests=digests,
            digest=digests_root(digests, sum(sizes)),
        ).frame()

    return {
        "amplifier": [open_("a" * 32).frame()],
        "over_limits": [
            open_("o1" * 16, chunk_size=1024, n_chunks=MAX_CHUNKS + 1, sizes=[1 << 26], total=1 << 26).frame(),
            open_(
                "o2" * 16, chunk_size=1024, n_chunks=4097, sizes=[1024] * (MAX_BUFFERS + 1), total=1024 * 4097
            ).frame(),
        ],
        "worst_accepted": [worst("w" * 32)],
        "flood": [worst(f"{i:032x}") for i in range(flood)],
    }


async def run(flood: int) -> dict[str, Any]:
    from kvbus.app.local import NatsServer
    from kvbus.bus import Bus
    from kvbus.group_scheduler import GroupScheduler
    from kvbus.protocol import OpenReply, inbox_subject
    from kvbus.signature import ModelSignature

    sig = ModelSignature("hostile-model", n_layers=4, n_kv_heads=4, head_dim=64, dtype="bfloat16", vocab_size=32000)
    server = NatsServer().start()
    sched = await GroupScheduler.connect(server.url, "default")
    rogue = await Bus.connect(server.url)
    receiver = ReceiverProcess(server.url, "victim", sig.to_dict())
    results: dict[str, Any] = {}
    try:
        kinds = _opens("rogue", "victim", sig.to_dict(), flood)
        # The machine's own noise: the same receiver, idle, for as long as the flood takes.
        before = receiver.ask("reset")
        await asyncio.sleep(5.0)
        after = receiver.ask("stat")
        results["baseline_idle_5s"] = {
            "rss_growth_mb": round((after["rss"] - before["rss"]) / 2**20, 2),
            "max_stall_ms": round(after["stall"] * 1000, 2),
        }
        print("baseline_idle_5s", json.dumps(results["baseline_idle_5s"]), flush=True)
        for kind, frames in kinds.items():
            before = receiver.ask("reset")
            codes = []
            t0 = time.perf_counter()
            for frame in frames:
                data = await rogue.transport.request(inbox_subject("victim", "rogue"), frame, timeout=30)
                reply = OpenReply.decode(data)
                codes.append("accepted" if reply.ok else str(reply.code))
            elapsed = time.perf_counter() - t0
            await asyncio.sleep(0.3)
            after = receiver.ask("stat")
            results[kind] = {
                "opens": len(frames),
                "open_bytes": max(len(f) for f in frames),
                "replies": sorted(set(codes)),
                "rss_growth_mb": round((after["rss"] - before["rss"]) / 2**20, 2),
                "max_stall_ms": round(after["stall"] * 1000, 2),
                "partials_held": after["partials"],
                "seconds": round(elapsed, 3),
            }
            print(kind, json.dumps(results[kind]), flush=True)
    finally:
        receiver.stop()
        await rogue.close()
        await sched.close()
        server.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", type=int, default=200)
    parser.add_argument("--json", type=str, default="")
    args = parser.parse_args()
    results = asyncio.run(run(args.flood))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"suite": "hostile_open", "config": {"flood": args.flood}, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
