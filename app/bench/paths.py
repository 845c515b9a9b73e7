"""`kvbus bench paths`: the data paths on their own, between two OS processes.

The same random bytes (64 MB and 512 MB) move from this process to a receiver process on the
embedded nats-server in these ways, interleaved run by run (median of 5 each):

- ``shm``: `kvbus.bus.paths` shared memory; each chunk is copied into a pooled segment by
  `send_chunk` (a `full`-codec payload already exists as tensors), the receiver verifies it where
  it lies. ``shm_in_place``: the payload is already in the segment (a codec encoded into it);
  ``shm_fresh``: a new segment every time (its pages faulted in: what a receiver that keeps the
  delivered KV mapped costs the next transfer).
- ``tcp``: `kvbus.bus.paths` direct TCP (``sendmsg`` of views, read into the final buffer).
- ``nats_path``: chunk messages with `NatsTransport.publish_views`, chunks as large as
  max_payload allows (8 MB); ``nats_path_1mb``: the same with 1 MB chunks; ``nats_publish``: the
  ``nats_path`` messages with nats-py's ``publish`` (what the zero-copy publish saves).
- ``nats_py``: the plain nats-py loop of ``kvbus bench transport`` (1 MB messages, window 16).
- ``socket``: a plain socket loop (``sock_sendall`` of the whole payload, ``recv_into`` a reused buffer).
- ``memcpy``: ``torch`` ``copy_`` of the same bytes into a reused tensor, in this process.

Every kvbus way carries the chunk framing: an xxh3-64 digest per chunk computed by the sender
as it sends, verified by the receiver; credit of 16 chunks (acknowledged every 4; on the direct
paths over their own connection, on NATS over NATS). A run ends when the sender holds the
receiver's acknowledgement of the last chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import threading
import time
import uuid
from typing import Any

import nats
import torch

from kvbus.app.local import NatsServer
from kvbus.bus.paths import DataPlane, PathsConfig, Segment, TransferSpec, chunk_digest
from kvbus.bus.paths.nats import NatsSendSession
from kvbus.net.transport import NatsTransport, flush
from kvbus.protocol import CHUNK_INDEX_HEADER, CHUNK_SUM_HEADER, OpenReply

MB = 1 << 20
#: Overridable for experiments: KVBUS_BENCH_PATHS_CHUNK / _WINDOW / _ACK_EVERY / _WAYS (comma-separated).
CHUNK = int(os.environ.get("KVBUS_BENCH_PATHS_CHUNK", str(MB)))
WINDOW = int(os.environ.get("KVBUS_BENCH_PATHS_WINDOW", "16"))
ACK_EVERY = int(os.environ.get("KVBUS_BENCH_PATHS_ACK_EVERY", "4"))
NATS_WINDOW_BYTES = int(os.environ.get("KVBUS_BENCH_PATHS_NATS_WINDOW_BYTES", 32 * MB))
NATS_CHUNK = int(os.environ.get("KVBUS_BENCH_PATHS_NATS_CHUNK", "0"))
"""0: the largest the server allows (`NatsTransport.max_chunk_size`, at most 8 MB)."""
RAW_SUBJECT = "kvbus.bench.paths.raw"
CREDIT = "kvbus.bench.paths.credit"
ALL_WAYS = (
    "shm",
    "shm_in_place",
    "shm_fresh",
    "tcp",
    "nats_path",
    "nats_path_1mb",
    "nats_publish",
    "nats_py",
    "socket",
    "memcpy",
)
WAYS = tuple(w for w in os.environ.get("KVBUS_BENCH_PATHS_WAYS", ",".join(ALL_WAYS)).split(",") if w in ALL_WAYS)


def _ranges(total: int, chunk: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + chunk, total)) for lo in range(0, total, chunk)]


def _emit(**obj: Any) -> None:
    print(json.dumps(obj), flush=True)


#: Seconds without a credit after which a run is declared stuck (raises instead of hanging).
STUCK_S = 60.0


async def _credit(event: asyncio.Event, what: str, acked: list[int], n: int) -> None:
    event.clear()
    try:
        await asyncio.wait_for(event.wait(), STUCK_S)
    except TimeoutError:
        raise RuntimeError(f"{what}: no credit for {STUCK_S:.0f} s (acknowledged {acked[0]} of {n} chunks)") from None


# -- the receiver process ----------------------------------------------------------------------


class _Sink:
    """Counts verified chunks and acknowledges every ``ACK_EVERY`` (and the last)."""

    def __init__(self, n: int, ack: Any) -> None:
        self.n, self.ack = n, ack
        self.chunks: dict[int, memoryview] = {}
        self.session: Any = None

    def chunk_arrived(self, index: int, data: memoryview, digest: str, root: str) -> None:
        self.chunks[index] = data
        k = len(self.chunks)
        if k % ACK_EVERY == 0 or k == self.n:
            self.ack(self, k)

    def chunk_corrupt(self, index: int, path: Any) -> None:
        print(f"corrupt chunk {index}", file=sys.stderr)

    def path_opened(self, session: Any) -> None:
        self.session = session

    def path_lost(self, session: Any, error: Any) -> None:
        print(f"lost: {error}", file=sys.stderr)


def _socket_server(buffer: list[bytearray]) -> int:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while head := conn.recv(8, socket.MSG_WAITALL):
                n = int.from_bytes(head, "big")
                if len(buffer[0]) < n:
                    buffer[0] = bytearray(n)
                view = memoryview(buffer[0])
                got = 0
                while got < n:
                    k = conn.recv_into(view[got:n])
                    if not k:
                        return
                    got += k
                conn.sendall(b"k")

    threading.Thread(target=serve, daemon=True).start()
    return int(listener.getsockname()[1])


async def _receiver(nats_url: str) -> None:
    transport = await NatsTransport.connect(nats_url)
    nc = await nats.connect(nats_url, pending_size=64 * MB)
    plane = DataPlane(transport, config=PathsConfig(allowed="shm,tcp,nats", tcp_host="127.0.0.1"))
    await plane.start()
    sinks: dict[str, _Sink] = {}
    raw = {"n": 0, "count": 0}

    async def on_raw(msg: Any) -> None:
        if msg.headers and "Bench-Start" in msg.headers:
            raw.update(n=int(msg.headers["Bench-Start"]), count=0)
            return
        raw["count"] += 1
        if raw["count"] % ACK_EVERY == 0 or raw["count"] == raw["n"]:
            await nc.publish(CREDIT, str(raw["count"]).encode())

    await nc.subscribe(RAW_SUBJECT, cb=on_raw, pending_bytes_limit=1 << 30)
    await flush(nc)
    port = _socket_server([bytearray()])
    _emit(ready=True, host=plane.host, socket_port=port)

    acks: set[asyncio.Future[Any]] = set()  # held until done: the loop keeps only weak references

    def _keep(fut: asyncio.Future[Any]) -> None:
        acks.add(fut)
        fut.add_done_callback(acks.discard)

    def direct_ack(sink: _Sink, k: int) -> None:
        _keep(asyncio.ensure_future(sink.session.send_control(str(k).encode())))

    def nats_ack(subject: str) -> Any:
        def ack(sink: _Sink, k: int) -> None:
            _keep(asyncio.ensure_future(transport.publish(subject, str(k).encode())))

        return ack

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        cmd = json.loads(line)
        tid = cmd["tid"]
        if cmd["cmd"] == "withdraw":
            await plane.withdraw(tid)
            sinks.pop(tid, None)
            _emit(withdrawn=tid)
            continue
        rs = _ranges(cmd["total"], cmd["chunk"])
        spec = TransferSpec.of(tid, "tx", "rx", rs, data_subject=cmd.get("subject", ""))
        way = cmd["path"]
        sink = sinks[tid] = _Sink(len(rs), nats_ack(cmd["credit"]) if way == "nats" else direct_ack)
        offer = await plane.accept(spec, sink, peer_paths=[way], peer_host=cmd["host"])
        await transport.flush()
        _emit(offer=offer.reply_fields() if offer else None)


# -- the sending side ------------------------------------------------------------------------------


class _Bench:
    def __init__(
        self, rx: asyncio.subprocess.Process, hello: dict[str, Any], plane: DataPlane, transport: NatsTransport, nc: Any
    ) -> None:
        self.rx, self.hello, self.plane, self.transport, self.nc = rx, hello, plane, transport, nc
        self.sock: socket.socket | None = None

    async def _ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.rx.stdin is not None and self.rx.stdout is not None
        self.rx.stdin.write(json.dumps(cmd).encode() + b"\n")
        await self.rx.stdin.drain()
        return dict(json.loads(await asyncio.wait_for(self.rx.stdout.readline(), 120)))

    async def direct(self, way: str, view: memoryview, seg: Segment | None = None) -> float:
        path = "shm" if way.startswith("shm") else "tcp"
        total = view.nbytes
        tid = uuid.uuid4().hex
        rs = _ranges(total, CHUNK)
        spec = TransferSpec.of(tid, "tx", "rx", rs)
        reply = await self._ask(cmd="expect", tid=tid, total=total, chunk=CHUNK, path=path, host=self.plane.host)
        offer = OpenReply("x", True, **reply["offer"]).offer
        acked = [0]
        credit = asyncio.Event()

        def on_control(data: bytes) -> None:
            acked[0] = max(acked[0], int(data))
            credit.set()

        if way == "shm_fresh":
            seg = Segment(total)
        t = time.perf_counter()
        session = await self.plane.connect(spec, [path], offer, on_control=on_control, segment=seg)
        for i, (lo, hi) in enumerate(rs):
            while i - acked[0] >= WINDOW:
                await _credit(credit, way, acked, len(rs))
            piece = (seg.view if seg is not None and way == "shm_in_place" else view)[lo:hi]
            await session.send_chunk(i, [piece], chunk_digest(piece))
        while acked[0] < len(rs):
            await _credit(credit, way, acked, len(rs))
        dt = time.perf_counter() - t
        await session.close()
        await self._ask(cmd="withdraw", tid=tid)
        if way == "shm_fresh" and seg is not None:
            seg.close()
        return dt

    async def nats_way(self, way: str, view: memoryview) -> float:
        total = view.nbytes
        chunk = min(NATS_CHUNK, self.transport.max_chunk_size()) if NATS_CHUNK else self.transport.max_chunk_size()
        if way == "nats_path_1mb":
            chunk = MB
        window = max(2, NATS_WINDOW_BYTES // chunk)
        tid = uuid.uuid4().hex
        rs = _ranges(total, chunk)
        subject = f"kvbus.agent.rx.data.{tid}"
        credit_subject = f"{CREDIT}.{tid}"
        spec = TransferSpec.of(tid, "tx", "rx", rs, data_subject=subject)
        acked = [0]
        credit = asyncio.Event()

        async def on_credit(msg: Any) -> None:
            acked[0] = max(acked[0], int(msg.data))
            credit.set()

        sub = await self.transport.subscribe(credit_subject, on_credit)
        await self.transport.flush()
        await self._ask(
            cmd="expect",
            tid=tid,
            total=total,
            chunk=chunk,
            path="nats",
            host=self.plane.host,
            subject=subject,
            credit=credit_subject,
        )
        session = NatsSendSession(self.transport, spec)
        t = time.perf_counter()
        for i, (lo, hi) in enumerate(rs):
            while i - acked[0] >= window:
                await _credit(credit, way, acked, len(rs))
            piece = view[lo:hi]
            digest = chunk_digest(piece)
            if way != "nats_publish":
                await session.send_chunk(i, [piece], digest)
            else:
                await self.transport.publish(
                    subject, piece, headers={CHUNK_INDEX_HEADER: str(i), CHUNK_SUM_HEADER: digest}
                )
        while acked[0] < len(rs):
            await _credit(credit, way, acked, len(rs))
        dt = time.perf_counter() - t
        await sub.unsubscribe()
        await self._ask(cmd="withdraw", tid=tid)
        return dt

    async def nats_py(self, view: memoryview) -> float:
        chunks = [view[lo:hi] for lo, hi in _ranges(view.nbytes, CHUNK)]
        n = len(chunks)
        credit = asyncio.Event()
        acked = [0]

        async def on_credit(msg: Any) -> None:
            acked[0] = int(msg.data)
            credit.set()

        sub = await self.nc.subscribe(CREDIT, cb=on_credit)
        await self.nc.publish(RAW_SUBJECT, b"", headers={"Bench-Start": str(n)})
        await flush(self.nc)
        t = time.perf_counter()
        sent = 0
        while acked[0] < n:
            if sent < n and sent < acked[0] + WINDOW:
                await self.nc.publish(RAW_SUBJECT, chunks[sent])
                sent += 1
            else:
                await _credit(credit, "nats_py", acked, n)
        dt = time.perf_counter() - t
        await sub.unsubscribe()
        return dt

    async def plain_socket(self, view: memoryview) -> float:
        loop = asyncio.get_running_loop()
        if self.sock is None:
            self.sock = socket.create_connection(("127.0.0.1", self.hello["socket_port"]))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.setblocking(False)
        t = time.perf_counter()
        await loop.sock_sendall(self.sock, view.nbytes.to_bytes(8, "big"))
        await loop.sock_sendall(self.sock, view)
        assert await loop.sock_recv(self.sock, 1) == b"k"
        return time.perf_counter() - t

    async def once(self, way: str, src: torch.Tensor, dst: torch.Tensor, seg: Segment) -> float:
        view = src.numpy().data
        if way in ("shm", "tcp", "shm_fresh"):
            return await self.direct(way, view)
        if way == "shm_in_place":
            return await self.direct(way, view, seg)
        if way in ("nats_path", "nats_path_1mb", "nats_publish"):
            return await self.nats_way(way, view)
        if way == "nats_py":
            return await self.nats_py(view)
        if way == "socket":
            return await self.plain_socket(view)
        t = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t


async def _run(quick: bool, nats_url: str | None, smoke: bool = False) -> dict[str, Any]:
    sizes = {"4MB": 4 * MB} if smoke else {"64MB": 64 * MB} if quick else {"64MB": 64 * MB, "512MB": 512 * MB}
    reps = 1 if smoke else 3 if quick else 5
    server = None if nats_url else NatsServer().start()
    url = nats_url or server.url  # type: ignore[union-attr]
    rx = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvbus.app.bench.paths",
        "--rx",
        url,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        limit=1 << 20,
    )
    transport = await NatsTransport.connect(url)
    nc = await nats.connect(url, pending_size=64 * MB)
    plane = DataPlane(transport, config=PathsConfig(allowed="shm,tcp,nats"), receive=False)
    await plane.start()
    try:
        assert rx.stdout is not None
        hello = json.loads(await asyncio.wait_for(rx.stdout.readline(), 120))
        bench = _Bench(rx, hello, plane, transport, nc)
        by_size: dict[str, Any] = {}
        for label, nbytes in sizes.items():
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
            dst = torch.empty_like(src)
            seg = Segment(nbytes)
            seg.tensor().copy_(src)  # "encoded in place": the payload already lives in the segment
            times: dict[str, list[float]] = {w: [] for w in WAYS}
            for rep in range(reps + 1):  # the first round warms connections and pools, not counted
                for way in WAYS:
                    if os.environ.get("KVBUS_BENCH_PATHS_DEBUG"):
                        print(f"{label} rep {rep} {way}", file=sys.stderr, flush=True)
                    dt = await bench.once(way, src, dst, seg)
                    if rep:
                        times[way].append(dt)
            gbps = {w: nbytes / statistics.median(ts) / 1e9 for w, ts in times.items()}
            gbps = {w: gbps.get(w, float("nan")) for w in ALL_WAYS}
            by_size[label] = {
                **{f"{w}_GBps": round(v, 3) for w, v in gbps.items() if w in WAYS},
                "shm_ratio_vs_nats_py": round(gbps["shm"] / gbps["nats_py"], 2),
                "tcp_ratio_vs_nats_py": round(gbps["tcp"] / gbps["nats_py"], 2),
                "nats_path_ratio_vs_nats_py": round(gbps["nats_path"] / gbps["nats_py"], 2),
                "nats_path_1mb_ratio_vs_nats_py": round(gbps["nats_path_1mb"] / gbps["nats_py"], 2),
                "nats_path_vs_nats_publish": round(gbps["nats_path"] / gbps["nats_publish"], 2),
                "tcp_vs_loopback_limit": round(gbps["tcp"] / gbps["socket"], 2),
                "shm_vs_memcpy": round(gbps["shm"] / gbps["memcpy"], 2),
                "shm_in_place_vs_memcpy": round(gbps["shm_in_place"] / gbps["memcpy"], 2),
                "shm_fresh_vs_memcpy": round(gbps["shm_fresh"] / gbps["memcpy"], 2),
                "runs_s": {w: [round(t, 4) for t in ts] for w, ts in times.items()},
            }
            seg.close()
            del src, dst
        return {
            "suite": "paths",
            "config": {
                "chunk": CHUNK,
                "window": WINDOW,
                "ack_every": ACK_EVERY,
                "nats_chunk": transport.max_chunk_size(),
                "nats_window_bytes": NATS_WINDOW_BYTES,
                "reps": reps,
                "nats_url": "embedded" if server else "given",
            },
            "results": {"by_size": by_size},
        }
    finally:
        if bench.sock is not None:
            bench.sock.close()
        await plane.close()
        await nc.close()
        await transport.close()
        rx.kill()
        await rx.wait()
        if server is not None:
            server.stop()


def run(*, quick: bool = False, smoke: bool = False, nats_url: str | None = None, **_: Any) -> dict[str, Any]:
    """Run the suite; prints one line per size (``smoke``: 4 MB, one timed round)."""
    out = asyncio.run(_run(quick, nats_url, smoke))
    for label, row in out["results"]["by_size"].items():
        print(f"{label:>6}: " + "  ".join(f"{w} {row[f'{w}_GBps']:.2f}" for w in WAYS) + " GB/s")
        print("        " + "  ".join(f"{k} {v}" for k, v in row.items() if not k.endswith("GBps") and k != "runs_s"))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rx", metavar="NATS_URL")
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true")
    ns = parser.parse_args()
    if ns.rx:
        try:
            asyncio.run(_receiver(ns.rx))
        except KeyboardInterrupt:
            pass
    else:
        result = run(quick=ns.quick)
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump(result, f, indent=2)
