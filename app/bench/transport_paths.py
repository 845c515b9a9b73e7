"""The data-path ways of `kvbus bench transport`: the bus on each path, and the baselines they are held to.

- ``kvbus_zero_copy``: the same ``send`` on ``shm`` of the context built in place
  (`Agent.kv_buffer`): ``shm_vs_memcpy`` with it, ``shm_copying_vs_memcpy`` without;
- ``kvbus_shm`` / ``kvbus_tcp`` / ``kvbus_nats``: a real ``send`` through the bus (grant,
  `Open`, stream, verdict) from three buses of the sending process, one allowed every path
  (it picks ``shm``: one host), one ``tcp,nats``, one ``nats`` only;
- ``socket``: a plain socket loop moving the same bytes to the receiving process (the loopback
  limit ``tcp`` is held to), ``memcpy``: a ``copy_`` of them in this process (``shm``'s limit);
- ``nats_reqrep``: at 1 MB, a plain nats-py request carrying the bytes and its reply (what one
  small transfer costs without kvbus);
- `count_round_trips`: the control round trips (requests) one ``send`` makes.
"""

from __future__ import annotations

import time
from typing import Any

import nats

from kvbus.net.transport import TransportWrapper

#: The subject the receiving process answers plain nats-py requests on.
REQREP_SUBJECT = "kvbus.app.bench.reqrep"
#: Sending buses: name suffix and allowed paths.
PATH_BUSES = {"shm": "shm,tcp,nats", "tcp": "tcp,nats", "nats": "nats"}


class CountingTransport(TransportWrapper):
    """Wraps an agent's transport and counts its requests (control round trips)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.requests = 0

    async def request(self, subject: str, payload: bytes, timeout: float) -> bytes:
        """Count, then ask."""
        self.requests += 1
        data: bytes = await self.inner.request(subject, payload, timeout=timeout)
        return data


async def count_round_trips(agent: Any, to: str, kv: Any) -> tuple[int, str]:
    """Control round trips (grant request, `Open`, status requests) one ``send`` of ``kv`` makes, and its path."""
    counting = CountingTransport(agent.transport)
    agent.transport = counting
    try:
        report = await agent.send(to, kv, medium="full")
    finally:
        agent.transport = counting.inner
    return counting.requests, str(report.path)


async def serve_reqrep(nc: Any) -> None:
    """Answer each plain request on `REQREP_SUBJECT` with its size (in the receiving process)."""

    async def on_req(msg: Any) -> None:
        await nc.publish(msg.reply, str(len(msg.data)).encode())

    await nc.subscribe(REQREP_SUBJECT, cb=on_req, pending_bytes_limit=1 << 30)


async def reqrep_once(nc: Any, payload: memoryview) -> float:
    """One plain nats-py request carrying ``payload``, until its reply."""
    t = time.perf_counter()
    reply = await nc.request(REQREP_SUBJECT, payload, timeout=60)
    dt = time.perf_counter() - t
    if int(reply.data) != payload.nbytes:
        raise RuntimeError("the request/reply peer got the wrong size")
    return dt


class SocketLoop:
    """The plain socket loop of `kvbus.app.bench.paths` to the receiving process's socket server."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock: Any = None

    async def once(self, view: memoryview) -> float:
        """Send ``view`` (8-byte length first) and wait for the 1-byte answer."""
        import asyncio
        import socket

        loop = asyncio.get_running_loop()
        if self.sock is None:
            self.sock = socket.create_connection(("127.0.0.1", self.port))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.setblocking(False)
        t = time.perf_counter()
        await loop.sock_sendall(self.sock, view.nbytes.to_bytes(8, "big"))
        await loop.sock_sendall(self.sock, view)
        if await loop.sock_recv(self.sock, 1) != b"k":
            raise RuntimeError("the socket peer did not answer")
        return time.perf_counter() - t

    def close(self) -> None:
        """Close the connection."""
        if self.sock is not None:
            self.sock.close()


def memcpy_once(src: Any, dst: Any) -> float:
    """A ``copy_`` of ``src`` into ``dst`` (torch tensors of the payload's bytes)."""
    t = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t


def path_results(nbytes: int, medians: dict[str, float]) -> dict[str, Any]:
    """GB/s per way and the ratios the data plane is held to, from median seconds per way."""
    gbps = {k: nbytes / v / 1e9 for k, v in medians.items() if v > 0}

    def ratio(a: str, b: str) -> float:
        return round(gbps[a] / gbps[b], 3) if a in gbps and b in gbps else float("nan")

    return {
        **{f"{k}_GBps": round(v, 3) for k, v in gbps.items()},
        "shm_ratio_vs_nats_py": ratio("kvbus_shm", "nats_py"),
        "tcp_ratio_vs_nats_py": ratio("kvbus_tcp", "nats_py"),
        "nats_path_ratio_vs_nats_py": ratio("kvbus_nats", "nats_py"),
        "tcp_vs_loopback_limit": ratio("kvbus_tcp", "socket"),
        # With the zero-copy API (a context built in a shared segment) where the size has it,
        # else the copying path; the copying path's figure beside it.
        "shm_vs_memcpy": ratio("kvbus_zero_copy" if "kvbus_zero_copy" in gbps else "kvbus_shm", "memcpy"),
        "shm_copying_vs_memcpy": ratio("kvbus_shm", "memcpy"),
    }


async def connect_reqrep(url: str) -> Any:
    """A plain nats-py connection for the request/reply baseline."""
    return await nats.connect(url, pending_size=64 * 1024 * 1024)
