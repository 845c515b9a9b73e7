"""An agent in its own OS process with telemetry on, for the cross-process tracing tests.

``python tests/telemetry_peer.py rx URL NAME GROUP``: receives; prints ``ready``, then one JSON line
per delivery. ``python tests/telemetry_peer.py tx URL NAME GROUP TO NBYTES``: sends one context of
about NBYTES to TO, prints the report as JSON, then ``sent`` and waits for stdin to close (so the
test can scrape its metrics endpoint). Telemetry comes from the ``OTEL_*`` and
``KVBUS_METRICS_PORT`` variables alone (`Bus.connect` configures it); both flush spans before
they exit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from kvutil import kv_of_bytes
from peer import SIG

from kvbus import telemetry
from kvbus.bus import Bus


async def main(argv: list[str]) -> None:
    role, url, name, group = argv[:4]
    bus = await Bus.connect(url)
    agent = await bus.agent(name, group=group, signature=SIG)
    try:
        if role == "rx":
            print("ready", flush=True)
            async for d in agent.inbox():
                print(json.dumps({"transfer_id": d.transfer_id, "medium": d.medium}), flush=True)
        else:
            to, nbytes = argv[4], int(argv[5])
            report = await agent.send(to, kv_of_bytes(SIG, nbytes))
            out = dataclasses.asdict(report)
            out["dst"] = list(report.dst)
            print(json.dumps(out, default=str), flush=True)
            telemetry.shutdown()
            print("sent", flush=True)
            await asyncio.to_thread(sys.stdin.read)
    finally:
        await bus.close()
        telemetry.shutdown()


if __name__ == "__main__":
    try:
        asyncio.run(main(sys.argv[1:]))
    except KeyboardInterrupt:
        pass
