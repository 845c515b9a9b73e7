"""A paced TCP relay: the emulated stand-in for a shaped link when the testbed is not available.

``python -m kvbus.app.testbed.relay TARGET_HOST TARGET_PORT RATE_BPS DELAY_S`` listens on a free
loopback port (printed as ``port N``) and relays every connection to the target, each direction
paced to ``RATE_BPS`` bytes/s shared by all connections (0 = unpaced) and held back ``DELAY_S``.
So every flow to a host behind the relay shares one bottleneck in arrival order, as on a real
link, and backpressure reaches the sender through TCP. A JSON line on stdin
(``{"rate_bps": ..., "delay_s": ...}``) changes the link; end of stdin ends the relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections import deque

#: Bytes a direction holds at most beyond what the link let through.
QUEUE_BYTES = 256 * 1024


class Pacer:
    """One direction of the link: bytes leave no faster than ``rate`` bytes/s (all connections share it)."""

    def __init__(self, rate: float, delay: float) -> None:
        self.rate = rate
        self.delay = delay
        self.free_at = 0.0

    def due(self, n: int) -> float:
        """Monotonic time at which ``n`` more bytes have crossed the link (and its delay)."""
        now = time.monotonic()
        if self.rate > 0:
            self.free_at = max(self.free_at, now) + n / self.rate
            return self.free_at + self.delay
        return now + self.delay


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pacer: Pacer) -> None:
    """Copy ``reader`` to ``writer`` through ``pacer``: a chunk is written when its time has come."""
    queue: deque[tuple[float, bytes]] = deque()
    held = [0]
    wake = asyncio.Event()
    done = False

    async def send() -> None:
        while True:
            while not queue:
                if done:
                    return
                wake.clear()
                await wake.wait()
            due, data = queue[0]
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            queue.popleft()
            held[0] -= len(data)
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(send())
    try:
        # Small reads: the pacer's granularity is one read (64 KB is 1.6 ms at 40 MB/s).
        while data := await reader.read(64 * 1024):
            queue.append((pacer.due(len(data)), data))
            held[0] += len(data)
            wake.set()
            # Backpressure: hold at most QUEUE_BYTES (a router's buffer) beyond what is in flight; then the
            # sender's TCP window fills, as it would before a real bottleneck.
            while held[0] > QUEUE_BYTES + pacer.rate * pacer.delay:
                await asyncio.sleep(0.001)
    except ConnectionError:
        pass
    finally:
        done = True
        wake.set()
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            await sender
        writer.close()


async def serve(host: str, port: int, rate: float, delay: float) -> None:
    """Relay to ``host:port`` until stdin closes."""
    up, down = Pacer(rate, delay), Pacer(rate, delay)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pump(reader, target_writer, up), _pump(target_reader, writer, down))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(f"port {server.sockets[0].getsockname()[1]}", flush=True)
    loop = asyncio.get_running_loop()
    control = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(control), sys.stdin)
    async with server:
        while line := await control.readline():
            try:
                cmd = json.loads(line)
            except ValueError:
                continue
            for pacer in (up, down):
                pacer.rate = float(cmd.get("rate_bps", pacer.rate))
                pacer.delay = float(cmd.get("delay_s", pacer.delay))


def main(argv: list[str]) -> int:
    """Entry point: ``TARGET_HOST TARGET_PORT RATE_BPS DELAY_S``."""
    if len(argv) != 4:
        print("usage: python -m kvbus.app.testbed.relay TARGET_HOST TARGET_PORT RATE_BPS DELAY_S", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(argv[0], int(argv[1]), float(argv[2]), float(argv[3])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
