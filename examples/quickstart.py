"""Two agents share a real KV-cache through kvbus: the README's first example, runnable.

Start a local stack first (nats-server, a group scheduler for group ``default``, ...)::

    kvbus up &
    python examples/quickstart.py

(it connects to the stack ``kvbus up`` runs, found through the stack file ``kvbus up`` writes),
or point it at any deployment with ``--nats-url``. The planner prefills a prompt with SmolLM2,
sends the KV-cache to the writer (the group scheduler picks the medium), and the writer continues
the text from the received cache without recomputing the prompt.
"""

from __future__ import annotations

import argparse
import asyncio

from kvbus import Bus
from kvbus.app.cli_commands import stack_nats_url
from kvbus.app.models import load_smollm2

PROMPT = "The three things every kitchen needs are"


async def main(nats_url: str, new_tokens: int) -> None:
    """Prefill on the planner, send the KV-cache, continue on the writer."""
    runner, tokenizer = load_smollm2()
    prompt_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    async with await Bus.connect(nats_url) as bus:
        planner = await bus.agent("planner", group="default", role="coordinator", runner=runner)
        writer = await bus.agent("writer", group="default", role="executor", runner=runner)
        kv = runner.prefill(prompt_ids)  # a real KV-cache
        report = await planner.send("writer", kv)  # the scheduler picks the medium
        delivery = await writer.receive(timeout=10)  # whole and verified, or send() raised
        new_tokens_ids = runner.generate(delivery.kv, new_tokens)  # continue from the received KV
        print(f"sent {report.nbytes} bytes as {report.medium} in {report.total_s * 1000:.1f} ms")
        print(PROMPT + tokenizer.decode(new_tokens_ids[0]).replace("\n", " "))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats-url", help="default: the running `kvbus up`, else nats://127.0.0.1:4222")
    parser.add_argument("--tokens", type=int, default=16, help="tokens the writer generates")
    args = parser.parse_args()
    asyncio.run(main(args.nats_url or stack_nats_url(), args.tokens))
