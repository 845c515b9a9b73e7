"""An agent script as a user writes it from the README: `Bus.connect`, `bus.agent`, `send` or
`inbox`, and nothing about telemetry (no `kvbus.telemetry` call, no test helper): whatever it
exports comes from the standard variables alone.

``python tests/user_agent.py NATS_URL NAME GROUP receive``: prints ``ready``, then one JSON line
per delivery. ``python tests/user_agent.py NATS_URL NAME GROUP send TO NBYTES``: sends one context
of about NBYTES, prints the report as JSON, then stays up (an agent has more to do) until its
standard input closes, and exits normally.
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch

from kvbus import Bus, KVCache
from kvbus.signature import ModelSignature

MODEL = ModelSignature("user-model", n_layers=4, n_kv_heads=4, head_dim=64, dtype="bfloat16", vocab_size=32000)


def context(nbytes: int) -> KVCache:
    """A KV-cache of about ``nbytes`` (what a model's prefill would give)."""
    n_tokens = max(1, nbytes // MODEL.kv_bytes_per_token())
    shape = (1, MODEL.n_kv_heads, n_tokens, MODEL.head_dim)
    keys = [torch.randn(shape).to(torch.bfloat16) for _ in range(MODEL.n_layers)]
    values = [torch.randn(shape).to(torch.bfloat16) for _ in range(MODEL.n_layers)]
    return KVCache(torch.randint(0, MODEL.vocab_size, (1, n_tokens)), MODEL, keys, values)


async def main(url: str, name: str, group: str, role: str, *rest: str) -> None:
    async with await Bus.connect(url) as bus:
        me = await bus.agent(name, group=group, signature=MODEL)
        if role == "receive":
            print("ready", flush=True)
            async for d in me.inbox():
                print(json.dumps({"transfer_id": d.transfer_id, "sender": d.sender, "medium": d.medium}), flush=True)
        else:
            to, nbytes = rest[0], int(rest[1])
            report = await me.send(to, context(nbytes))
            out = {"transfer_id": report.transfer_id, "medium": report.medium, "nbytes": report.nbytes}
            print(json.dumps(out), flush=True)
            await asyncio.to_thread(sys.stdin.read)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
