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

Imported, it gives the tests `Peer`: one handle on a helper process that speaks lines on stdin and
stdout, this file's receiving agent (`Peer.agent`) or a `paths_peer.py` endpoint (`Peer.paths`).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from kvbus.bus import Bus, BusConfig
from kvbus.bus.paths import PathsConfig
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

SIG = ModelSignature("test-model", n_layers=4, n_kv_heads=4, head_dim=64, dtype="bfloat16", vocab_size=32000)
HERE = Path(__file__).parent
BOUND = 60.0
"""Seconds a helper process may take to start or to print the line a test waits for."""


class Peer:
    """A helper process of a test: JSON commands in on stdin, one JSON event a line out on stdout.

    Every event read is kept in `events` (in order), so a test can also check what came before
    the one it waited for.
    """

    def __init__(self, proc: asyncio.subprocess.Process, name: str, hello: dict[str, Any]) -> None:
        self.proc = proc
        self.name = name
        self.hello = hello
        """The first line the process printed: ``{"line": "ready"}`` for an agent (a line that is
        not JSON comes as ``{"line": text}``), the pid, host and tcp listener of a `paths_peer.py`
        endpoint."""
        self.events: list[dict[str, Any]] = []

    @classmethod
    async def agent(cls, url: str, name: str, *extra: str) -> Peer:
        """A receiving agent ``name`` on ``url`` in its own process (this file, options ``extra``),
        once it is ready (with ``--wait``: once it is waiting for its go line)."""
        peer = await cls.start("peer.py", url, name, *extra, name=name)
        if peer.hello.get("line") not in ("ready", "waiting"):
            await peer.stop()
            raise RuntimeError(f"peer {name} did not start: {peer.hello!r}")
        return peer

    @classmethod
    async def paths(cls, role: str, *args: str) -> Peer:
        """A `paths_peer.py` endpoint, ``rx`` or ``tx``, with the paths (and options) ``args``."""
        return await cls.start("paths_peer.py", role, *args, name=role)

    @classmethod
    async def start(cls, script: str, *args: str, name: str = "") -> Peer:
        """The helper ``script`` (a file next to this one) run with ``args``, once it printed its
        first line (the `hello`); ``name`` names it in errors."""
        name = name or script
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(HERE / script),
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=HERE.parent,
            limit=1 << 20,  # a status line can be long
        )
        assert proc.stdout is not None
        first = await asyncio.wait_for(proc.stdout.readline(), BOUND)
        if not first.strip():
            await cls(proc, name, {}).stop()
            raise RuntimeError(f"{script} {name} did not start")
        return cls(proc, name, _event(first))

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    @property
    def host(self) -> str:
        """The host identity a `paths_peer.py` endpoint offers its paths under."""
        return str(self.hello["host"])

    @property
    def tcp(self) -> list[Any] | None:
        """A `paths_peer.py` receiver's tcp listener (host, port), if it has one."""
        tcp: list[Any] | None = self.hello["tcp"]
        return tcp

    async def send(self, **cmd: Any) -> None:
        """Write one command line (to `paths_peer.py`; any line is the go of ``peer.py --wait``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        await self.proc.stdin.drain()

    async def line(self, timeout: float = BOUND) -> dict[str, Any]:
        """The next event (an agent's: one delivery, or ``{"line": "ready"}``)."""
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not raw:
            raise EOFError(f"peer {self.name} ({self.pid}) exited; events: {self.events[-5:]}")
        event = _event(raw)
        self.events.append(event)
        return event

    async def wait(self, key: str, value: Any = None, timeout: float = BOUND) -> dict[str, Any]:
        """The next event with ``key`` (equal to ``value`` if given); earlier ones are kept in `events`."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            event = await self.line(max(0.01, end - loop.time()))
            if key in event and (value is None or event[key] == value):
                return event

    async def status(self) -> dict[str, Any]:
        """A `paths_peer.py` endpoint's status."""
        await self.send(cmd="status")
        status: dict[str, Any] = (await self.wait("status"))["status"]
        return status

    def kill9(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    async def exit_code(self, timeout: float = BOUND) -> int:
        """The code the process exits with (waiting up to ``timeout`` seconds for it)."""
        return await asyncio.wait_for(self.proc.wait(), timeout)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()


def _event(raw: bytes) -> dict[str, Any]:
    """One output line of a helper process: its JSON object, or ``{"line": text}``."""
    text = raw.decode().strip()
    return dict(json.loads(text)) if text.startswith("{") else {"line": text}


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
