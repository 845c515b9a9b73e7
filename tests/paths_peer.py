"""One side of a data-path transfer in its own OS process, for the cross-process path tests.

Usage: ``python tests/paths_peer.py rx|tx [--paths shm,tcp,nats] [--nats URL] [--tls-ca F --tls-cert F
--tls-key F] [--private] [--bind-deadline S]``. Prints one JSON object per line (``{"ready": ..., "pid": ...,
"host": ...}`` first), reads one JSON command per line on stdin:

- rx ``{"cmd": "expect", "tid", "total", "chunk", "peer_paths", "peer_host"}``: offers the
  transfer, answers ``{"offer": <OpenReply path fields>, "paths": [...]}``; when every chunk is
  in: ``{"done": tid, "digest": <blake2b of the payload>, "corrupt": n, "via": [paths]}``; on a
  lost path ``{"lost": tid, "path": ...}`` (the partial transfer is dropped); every 4 chunks
  ``{"progress": tid, "chunks": n}``. ``{"cmd": "withdraw", "tid"}`` ends a transfer.
- tx ``{"cmd": "send", "tid", "total", "chunk", "seed", "offer", "paths", "pace_s", "stall_at"}``:
  sends random bytes (from ``seed``) on the fastest path, ``pace_s`` between chunks, and after
  ``stall_at`` chunks stops (``{"stalled": tid}``) and waits; ``{"sent": tid, "digest", "path"}``
  when all went out; ``{"lost": tid, "error"}`` when the path broke.
- both ``{"cmd": "status"}``: ``{"status": {"memfd_fds", "memfd_maps", "rss_kb", "sessions", ...}}`` after a
  GC, with the tcp listener's books (``tcp_unbound``, ``tcp_refused``, ``tcp_evicted``, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import sys
from typing import Any

import torch

from kvbus.bus.paths import DataPlane, DataTls, PathError, PathsConfig, TransferSpec, chunk_digest
from kvbus.protocol import OpenReply, PathName, PathOffer


def emit(**obj: Any) -> None:
    print(json.dumps(obj), flush=True)


def ranges(total: int, chunk: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + chunk, total)) for lo in range(0, total, chunk)]


def payload(total: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (total,), dtype=torch.uint8, generator=g)


def memfd_status() -> dict[str, int]:
    gc.collect()
    fds = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if "memfd:" in os.readlink(f"/proc/self/fd/{name}"):
                fds += 1
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = sum(1 for line in f if "memfd:" in line)
    return {"memfd_fds": fds, "memfd_maps": maps}


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def tcp_listener_status(plane: DataPlane) -> dict[str, Any]:
    """The tcp listener's own books: connections not bound yet (in all and per source), turned
    away, and the most buffer bytes an unbound connection holds."""
    listener = plane.tcp.listener if plane.tcp is not None else None
    if listener is None:
        return {"rss_kb": rss_kb()}
    waiting = [c for c in listener.connections if c.unbound]
    return {
        "rss_kb": rss_kb(),
        "tcp_accepted": listener.accepted,
        "tcp_unbound": listener.unbound_total,
        "tcp_unbound_by_source": dict(listener.unbound),
        "tcp_refused": listener.refused,
        "tcp_evicted": listener.evicted,
        "tcp_unbound_max_buffer": max((c.buffer_bytes for c in waiting), default=0),
    }


class Sink:
    """Collects one transfer's chunks; reports when whole."""

    def __init__(self, tid: str, spec: TransferSpec) -> None:
        self.tid, self.spec = tid, spec
        self.chunks: dict[int, memoryview] = {}
        self.corrupt = 0
        self.via: set[str] = set()
        self.sessions: list[Any] = []

    def chunk_arrived(self, index: int, data: memoryview, digest: str, root: str) -> None:
        if index in self.chunks:
            return
        self.chunks[index] = data
        if len(self.chunks) % 4 == 0:
            emit(progress=self.tid, chunks=len(self.chunks))
        if len(self.chunks) == self.spec.n_chunks:
            h = hashlib.blake2b(digest_size=16)
            for i in range(self.spec.n_chunks):
                h.update(self.chunks[i])
            emit(done=self.tid, digest=h.hexdigest(), corrupt=self.corrupt, via=sorted(self.via))

    def chunk_corrupt(self, index: int, path: PathName) -> None:
        self.corrupt += 1

    def path_opened(self, session: Any) -> None:
        self.via.add(session.kind.value)

    def path_lost(self, session: Any, error: PathError) -> None:
        self.chunks.clear()  # what phase 2 does with a partial transfer whose sender is gone
        emit(lost=self.tid, path=session.kind.value, error=str(error))


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["rx", "tx"])
    parser.add_argument("--paths", default="shm,tcp")
    parser.add_argument("--nats", default="")
    parser.add_argument("--tls-ca", default="")
    parser.add_argument("--tls-cert", default="")
    parser.add_argument("--tls-key", default="")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--bind-deadline", type=float, default=3.0)
    args = parser.parse_args()
    transport = None
    if args.nats:
        from kvbus.net.transport import NatsTransport

        transport = await NatsTransport.connect(args.nats)
    tls = DataTls(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key) if args.tls_ca else None
    config = PathsConfig(
        allowed=args.paths,
        tcp_host="127.0.0.1",
        shm_private=args.private,
        connect_timeout_s=3.0,
        tcp_bind_deadline_s=args.bind_deadline,
    )
    plane = DataPlane(transport, config=config, tls=tls, receive=args.role == "rx")
    await plane.start()
    sinks: dict[str, Sink] = {}
    tasks: set[asyncio.Task[None]] = set()
    emit(
        ready=True,
        pid=os.getpid(),
        host=plane.host,
        tcp=list(plane.tcp.endpoint) if plane.tcp and plane.tcp.endpoint else None,
    )

    async def send(cmd: dict[str, Any]) -> None:
        tid = cmd["tid"]
        data = payload(cmd["total"], cmd["seed"])
        view = data.numpy().data
        rs = ranges(cmd["total"], cmd["chunk"])
        spec = TransferSpec.of(tid, "tx", "rx", rs, data_subject=cmd.get("subject", ""))
        offer = OpenReply("x", True, **cmd["offer"]).offer if cmd.get("offer") else None
        lost: list[PathError] = []
        try:
            session = await plane.connect(spec, cmd["paths"], offer, on_lost=lost.append)
        except PathError as exc:
            emit(unavailable=tid, error=str(exc))
            return
        try:
            for i, (lo, hi) in enumerate(rs):
                if cmd.get("stall_at") and i == cmd["stall_at"]:
                    emit(stalled=tid)
                    await asyncio.Event().wait()
                piece = view[lo:hi]
                await session.send_chunk(i, [piece], chunk_digest(piece))
                if cmd.get("pace_s"):
                    await asyncio.sleep(cmd["pace_s"])
            h = hashlib.blake2b(digest_size=16)
            h.update(view)
            emit(sent=tid, digest=h.hexdigest(), path=session.kind.value)
            if cmd.get("wait_lost"):
                while not lost:
                    await asyncio.sleep(0.05)
        except PathError as exc:
            emit(lost=tid, error=str(exc))
        finally:
            await session.close(completed=not lost)
            del session

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        cmd = json.loads(line)
        if cmd["cmd"] == "expect":
            spec = TransferSpec.of(
                cmd["tid"], "tx", "rx", ranges(cmd["total"], cmd["chunk"]), data_subject=cmd.get("subject", "")
            )
            sink = sinks[cmd["tid"]] = Sink(cmd["tid"], spec)
            offer: PathOffer | None = await plane.accept(
                spec, sink, peer_paths=cmd["peer_paths"], peer_host=cmd["peer_host"]
            )
            emit(
                offer=offer.reply_fields() if offer else None,
                paths=plane.accepted_paths(cmd["peer_paths"], cmd["peer_host"]),
            )
        elif cmd["cmd"] == "withdraw":
            await plane.withdraw(cmd["tid"])
            sinks.pop(cmd["tid"], None)
        elif cmd["cmd"] == "send":
            task = asyncio.create_task(send(cmd))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        elif cmd["cmd"] == "status":
            await asyncio.sleep(0.1)
            emit(
                status={
                    **memfd_status(),
                    **tcp_listener_status(plane),
                    "sinks": len(sinks),
                    "expected": len(plane.registry) if plane.registry is not None else 0,
                    "tcp_rx_connections": len(plane.tcp.listener.connections)
                    if plane.tcp and plane.tcp.listener
                    else 0,
                    "tcp_tx_connections": plane.tcp.connections if plane.tcp else 0,
                    "shm_tx_connections": plane.shm.connections if plane.shm else 0,
                }
            )
    await plane.close()


if __name__ == "__main__":
    asyncio.run(main())
