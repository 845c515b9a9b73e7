"""A receiving agent in its own OS process, for cross-process tests.

Usage: ``python tests/peer.py NATS_URL AGENT_NAME [--die-at-chunk N] [--hang-after-delivery] [--wait]``.
Prints ``ready``, then one JSON line per delivery: transfer id, sender, medium and a blake2b digest
of the tokens and every key/value tensor's bytes (so the test can check the delivery bit for bit).

``--hang-after-delivery``: print a streamed transfer's delivery line the moment it is delivered,
then freeze before the final ack goes out (for the test to ``kill -9`` it right there).
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
    args = parser.parse_args()
    if args.wait:
        print("waiting", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
    if args.hang_after_delivery:
        import time

        from kvbus.bus.incoming import IncomingTransfer
        from kvbus.bus.receiver import Receiver

        deliver, report = Receiver._deliver, IncomingTransfer.report

        def deliver_and_say(self, d):
            deliver(self, d)
            print(json.dumps(_line(d)), flush=True)

        async def hang(self, *, ok, **kwargs):
            if ok:
                time.sleep(3600)  # the event loop stops here: the final ack never leaves
            await report(self, ok=ok, **kwargs)

        Receiver._deliver = deliver_and_say
        IncomingTransfer.report = hang
    if args.die_at_chunk:
        from kvbus.bus.incoming import IncomingTransfer

        original = IncomingTransfer._on_chunk

        async def dying(self, msg):
            if self.count + 1 >= args.die_at_chunk:
                os._exit(17)
            await original(self, msg)

        IncomingTransfer._on_chunk = dying
    bus = await Bus.connect(args.url, config=BusConfig(partial_timeout=5.0))
    agent = await bus.agent(args.name, signature=SIG)
    print("ready", flush=True)
    async for d in agent.inbox():
        if not args.hang_after_delivery:
            print(json.dumps(_line(d)), flush=True)
        del d


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
