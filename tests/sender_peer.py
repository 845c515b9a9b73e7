"""A sending agent in its own OS process, for the data-plane kill tests.

Usage: ``python tests/sender_peer.py NATS_URL AGENT_NAME RECEIVER MB STALL_AT``. Sends a random
KV-cache of about ``MB`` megabytes to ``RECEIVER`` with ``full``; when chunk ``STALL_AT`` is about
to go on a direct path it prints ``{"stalled": tid, "path": ...}`` and freezes (for a ``kill -9``
mid-transfer).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from kvutil import kv_of_bytes  # this folder is on the path (the script runs from it)
from peer import SIG

from kvbus.bus import Bus
from kvbus.bus.paths import PathsConfig
from kvbus.bus.route import Route


async def main() -> None:
    url, name, to, mb, stall_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    send = Route.send

    async def stalling(self: Route, index: int, data: bytes | memoryview) -> bool:
        if index == stall_at:
            print(json.dumps({"stalled": self.spec.transfer_id, "path": self.path}), flush=True)
            time.sleep(3600)  # the event loop stops here, mid-transfer
        return await send(self, index, data)

    Route.send = stalling  # type: ignore[method-assign]
    bus = await Bus.connect(url, paths=PathsConfig(tcp_host="127.0.0.1", allowed=sys.argv[6]))
    agent = await bus.agent(name, signature=SIG)
    print("ready", flush=True)
    await agent.send(to, kv_of_bytes(SIG, mb << 20, seed=13), medium="full")


if __name__ == "__main__":
    asyncio.run(main())
