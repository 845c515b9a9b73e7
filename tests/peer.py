"""A receiving agent in its own OS process, for cross-process tests.

Usage: ``python tests/peer.py NATS_URL AGENT_NAME [--die-at-chunk N] [--stall-at-chunk N] [--paths LIST]
[--hang-after-delivery] [--wait]``.
Prints ``ready``, then one JSON line per delivery: transfer id, sender, medium and a blake2b digest
of the tokens and every key/value tensor's bytes (so the test can check the delivery bit for bit).

``--hang-after-delivery``: print a streamed transfer's delivery line the moment it is delivered,
then freeze before the final ack goes out (for the test to ``kill -9`` it right there).
``--stall-at-chunk N``: print ``{"stalled": tid}`` when chunk N is about to be placed (on any path) and
freeze there (for a ``kill -9`` mid-transfer). ``--paths``: the data paths this receiver allows
(default all); each delivery line has ``accepted``, the connections its data listeners took.
``--wait``: print ``waiting`` once imported, and connect only when a line arrives on stdin (a
restart "at once": the process is warm).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
from typing import Any

import torch

from kvbus.bus import Bus, BusConfig
from kvbus.bus.paths import PathsConfig
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

SIG = ModelSignature("test-model", n_layers=4, n_kv_heads=4, head_dim=64, dtype="bfloat16", vocab_size=32000)


def kv_digest(kv: KVCache) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(kv.tokens.contiguous().numpy().tobytes())
    for t in (*kv.keys, *kv.values):
        h.update(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("name")
    parser.add_argument("--die-at-chunk", type=int, default=0)
    parser.add_argument("--hang-after-delivery", action="store_true")
    parser.add_argument("--wait", action="store_true")
    parser.add_argument("--paths", default="")
    parser.add_argument("--stall-at-chunk", type=int, default=0)
    args = parser.parse_args()
    if args.wait:
        print("waiting", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
    if args.hang_after_delivery:
        import time

        from kvbus.bus.incoming import IncomingTransfer
        from kvbus.bus.receiver import Receiver

        deliver, report = Receiver._deliver, IncomingTransfer.report

        def deliver_and_say(self, d, **kw):
            deliver(self, d, **kw)
            print(json.dumps(_line(d)), flush=True)

        async def hang(self, *, ok, **kwargs):
            if ok:
                time.sleep(3600)  # the event loop stops here: the final ack never leaves
            await report(self, ok=ok, **kwargs)

        Receiver._deliver = deliver_and_say
        IncomingTransfer.report = hang
    if args.die_at_chunk:
        from kvbus.bus.incoming import IncomingTransfer

        original = IncomingTransfer._place

        def dying(self, index, data, *, direct):
            if self.count + 1 >= args.die_at_chunk:
                os._exit(17)
            return original(self, index, data, direct=direct)

        IncomingTransfer._place = dying
    if args.stall_at_chunk:
        import time

        from kvbus.bus.incoming import IncomingTransfer

        placed = IncomingTransfer._place

        def stalling(self, index, data, *, direct):
            if self.count + 1 >= args.stall_at_chunk:
                print(json.dumps({"stalled": self.open.transfer_id, "via": sorted(self.via)}), flush=True)
                time.sleep(3600)  # the event loop stops here, with the transfer's memory mapped
            return placed(self, index, data, direct=direct)

        IncomingTransfer._place = stalling
    paths = PathsConfig(allowed=args.paths, tcp_host="127.0.0.1") if args.paths else PathsConfig(tcp_host="127.0.0.1")
    bus = await Bus.connect(args.url, config=BusConfig(partial_timeout=5.0), paths=paths)
    agent = await bus.agent(args.name, signature=SIG)
    print("ready", flush=True)
    async for d in agent.inbox():
        if not args.hang_after_delivery:
            print(json.dumps({**_line(d), "accepted": _accepted(bus)}), flush=True)
        del d


def _accepted(bus: Bus) -> dict[str, int]:
    """Connections the data listeners of ``bus`` accepted so far, per path."""
    plane = bus.plane
    out = {"tcp": 0, "shm": 0}
    if plane is not None and plane.tcp is not None and plane.tcp.listener is not None:
        out["tcp"] = plane.tcp.listener.accepted
    if plane is not None and plane.shm is not None and plane.shm.listener is not None:
        out["shm"] = plane.shm.listener.accepted
    return out


def _line(d: Any) -> dict[str, Any]:
    return {
        "transfer_id": d.transfer_id,
        "sender": d.sender,
        "medium": d.medium,
        "digest": kv_digest(d.kv),
        "nbytes": d.nbytes,
    }


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
