"""What the sending side of the direct paths (``tcp``, ``shm``) shares: a channel that writes
frames scatter-gather, a long-lived connection per peer that multiplexes transfers as
streams, the send session of one transfer, and `DirectPath`, the pool of those connections
(one per receiving endpoint) that each direct path is built on."""

from __future__ import annotations

import array
import asyncio
import logging
import socket
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

from kvbus.bus.paths.base import ControlHandler, DataPath, LostHandler, Pacer, TransferSpec, digest_int
from kvbus.bus.paths.errors import PathBroken, PathError, PathProtocolError, PathUnavailable, TokenRefused
from kvbus.bus.paths.frames import HEADER_SIZE, MAX_CTRL, SENDER, Frame, FrameType, bind_payload, pack, unpack
from kvbus.protocol import PathName

logger = logging.getLogger(__name__)

#: Most buffers one ``sendmsg`` takes (Linux IOV_MAX).
IOV_MAX = 1024
#: Linux's ``SO_MAX_PACING_RATE`` (Python's `socket` module does not name it).
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
#: ``SO_MAX_PACING_RATE``'s "no limit".
UNPACED = (1 << 64) - 1
#: A relative change of a connection's pacing rate below this is not passed to the kernel.
REPACE_TOLERANCE = 0.01
Buffer = bytes | bytearray | memoryview
K = TypeVar("K", bound=Hashable)
"""How a direct path names a receiving endpoint (``shm``: the socket's name; ``tcp``: (host, port))."""


def byte_view(data: Buffer) -> memoryview:
    """``data`` as a flat byte view (no copy).

    Raises:
        ValueError: the buffer is not contiguous.
    """
    view = memoryview(data)
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise ValueError("chunk pieces must be contiguous buffers")
    return view.cast("B")


def _set_pacing(sock: socket.socket, rate_bps: float) -> None:
    value = UNPACED if rate_bps <= 0 else max(1, int(rate_bps))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("Q", value))
    except OSError:  # a kernel that takes the rate as 32 bits only
        sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("I", min(value, (1 << 32) - 1)))


class _Unpaced:
    rate = 0.0


_UNPACED_PACER = _Unpaced()


class Channel(ABC):
    """A bidirectional byte (or message) pipe carrying frames."""

    def pace(self, rate_bps: float) -> None:
        """Have the kernel send at most ``rate_bps`` bytes/s on the wire (0: no limit); a channel
        without such a limit ignores it. Raises `OSError` when the kernel refuses."""
        return None

    @abstractmethod
    async def send(self, buffers: Sequence[memoryview], fds: Sequence[int] = ()) -> None:
        """Write ``buffers`` in order as one frame (with ``fds`` attached, where supported); raises `OSError`."""

    @abstractmethod
    async def recv_frame(self, path: str) -> tuple[Frame, bytes]:
        """The next frame from the far end; raises `EOFError` at the end, `OSError`, `PathProtocolError`."""

    @abstractmethod
    def close(self) -> None:
        """Close at once."""


class SocketChannel(Channel):
    """A non-blocking stream socket: writes with ``sendmsg`` straight from the buffers (no join, no copy)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._loop = asyncio.get_running_loop()

    def pace(self, rate_bps: float) -> None:
        """Set the socket's ``SO_MAX_PACING_RATE`` (see `Channel.pace`)."""
        _set_pacing(self.sock, rate_bps)

    async def _writable(self) -> None:
        fut: asyncio.Future[None] = self._loop.create_future()
        fd = self.sock.fileno()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        self._loop.add_writer(fd, ready)
        try:
            await fut
        finally:
            self._loop.remove_writer(fd)

    async def send(self, buffers: Sequence[memoryview], fds: Sequence[int] = ()) -> None:
        """Write the frame (see `Channel.send`)."""
        views = [b for b in buffers if b.nbytes]
        i = 0
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
        while i < len(views):
            try:
                n = self.sock.sendmsg(views[i : i + IOV_MAX], ancillary)
            except (BlockingIOError, InterruptedError):
                await self._writable()
                continue
            ancillary = []  # fds travel with the first byte only
            while n:
                size = views[i].nbytes
                if n >= size:
                    n -= size
                    i += 1
                else:
                    views[i] = views[i][n:]
                    n = 0

    async def _recv_exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = await self._loop.sock_recv_into(self.sock, view[got:])
            if not k:
                raise EOFError("the connection was closed")
            got += k
        return bytes(buf)

    async def recv_frame(self, path: str) -> tuple[Frame, bytes]:
        """The next frame (see `Channel.recv_frame`)."""
        frame = unpack(await self._recv_exactly(HEADER_SIZE), path, SENDER)
        return frame, (await self._recv_exactly(frame.length) if frame.length else b"")

    def close(self) -> None:
        """Close at once."""
        try:
            self._loop.remove_writer(self.sock.fileno())
            self._loop.remove_reader(self.sock.fileno())
        except (ValueError, OSError):
            pass
        self.sock.close()


class PacketChannel(SocketChannel):
    """A ``SOCK_SEQPACKET`` Unix socket: one frame per message, file descriptors alongside."""

    async def recv_frame(self, path: str) -> tuple[Frame, bytes]:
        """The next message as a frame (see `Channel.recv_frame`)."""
        data = await self._loop.sock_recv(self.sock, HEADER_SIZE + MAX_CTRL)
        if not data:
            raise EOFError("the connection was closed")
        if len(data) < HEADER_SIZE:
            raise PathProtocolError(path, f"a message of {len(data)} bytes is shorter than a frame header")
        frame = unpack(data, path, SENDER)
        if len(data) != HEADER_SIZE + frame.length:
            raise PathProtocolError(
                path, f"{frame.type.name} message of {len(data)} bytes, its header says {HEADER_SIZE + frame.length}"
            )
        return frame, data[HEADER_SIZE:]


class StreamChannel(Channel):
    """asyncio streams (for TLS: encryption reads each buffer, nothing is joined first)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def pace(self, rate_bps: float) -> None:
        """Set the underlying socket's ``SO_MAX_PACING_RATE`` (see `Channel.pace`)."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            _set_pacing(sock, rate_bps)

    async def send(self, buffers: Sequence[memoryview], fds: Sequence[int] = ()) -> None:
        """Write the frame through the stream (no descriptors)."""
        if fds:
            raise OSError("cannot pass file descriptors over this channel")
        if self.writer.is_closing():
            raise ConnectionResetError("the connection is closed")
        self.writer.writelines(buffers)
        await self.writer.drain()

    async def recv_frame(self, path: str) -> tuple[Frame, bytes]:
        """The next frame (see `Channel.recv_frame`)."""
        try:
            frame = unpack(await self.reader.readexactly(HEADER_SIZE), path, SENDER)
            return frame, (await self.reader.readexactly(frame.length) if frame.length else b"")
        except asyncio.IncompleteReadError:
            raise EOFError("the connection was closed") from None

    def close(self) -> None:
        """Abort the connection."""
        transport = self.writer.transport
        transport.abort()


class DirectSendSession:
    """The sender's side of one transfer on a direct path (`SendSession`); subclasses frame the chunks."""

    kind: PathName = PathName.TCP

    def __init__(
        self,
        spec: TransferSpec,
        conn: TxConnection,
        *,
        peer: str,
        on_control: ControlHandler | None,
        on_lost: LostHandler | None,
    ) -> None:
        self.spec = spec
        self.conn = conn
        self.peer = peer
        self.stream = 0
        self._on_control = on_control
        self._on_lost = on_lost
        self._broken: PathError | None = None
        self._closed = False
        self.pacer: Pacer | None = None
        """What paces the transfer's writes, for a connection the kernel paces (None: not told
        yet, the connection's pacing leaves the transfer out)."""

    def pace(self, pacer: Pacer | None) -> None:
        """The transfer's writes are paced by ``pacer`` (see `SendSession.pace`); the connection's
        kernel pacing follows the rates of the transfers on it."""
        self.pacer = pacer if pacer is not None else _UNPACED_PACER
        self.conn.repace()

    @property
    def segment(self) -> memoryview | None:
        """No shared segment on this path."""
        return None

    @property
    def broken(self) -> PathError | None:
        """Why the path failed, once it has."""
        return self._broken

    def check(self, index: int, pieces: Sequence[memoryview]) -> None:
        """Raise for a chunk that cannot be sent as given.

        Raises:
            PathBroken: the path failed or the session is closed.
            ValueError: index out of range or pieces of the wrong total size.
        """
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise PathBroken(self.kind.value, "the session is closed", peer=self.peer)
        if not 0 <= index < self.spec.n_chunks:
            raise ValueError(f"chunk {index} is out of range (0..{self.spec.n_chunks - 1})")
        size = sum(memoryview(p).nbytes for p in pieces)
        if size != self.spec.chunk_len(index):
            raise ValueError(f"chunk {index} has {size} bytes, its range has {self.spec.chunk_len(index)}")

    async def send_chunk(self, index: int, pieces: Sequence[memoryview], digest: str, *, root: str = "") -> None:
        """Send chunk ``index`` (see `SendSession.send_chunk`)."""
        self.check(index, pieces)
        await self._send(index, [byte_view(p) for p in pieces], digest_int(digest), root)

    async def _send(self, index: int, pieces: list[memoryview], digest: int, root: str) -> None:
        raise NotImplementedError

    def lost(self, error: PathError) -> None:
        """The path failed under this session (called by the connection)."""
        if self._closed or self._broken is not None:
            return
        self._broken = error
        if self._on_lost is not None:
            try:
                self._on_lost(error)
            except Exception:
                logger.exception("transfer %s: on_lost failed", self.spec.transfer_id)

    def control(self, data: bytes) -> None:
        """A control message arrived from the receiver."""
        if self._on_control is not None and not self._closed:
            try:
                self._on_control(data)
            except Exception:
                logger.exception("transfer %s: on_control failed", self.spec.transfer_id)

    async def close(self, *, completed: bool = True) -> None:
        """End the stream (the connection stays for other transfers)."""
        if self._closed:
            return
        self._closed = True
        # Neither is called once closed, and both hold the transfer (its payload, its context):
        # a shm session stays registered until the receiver let go of the segment, which may be
        # long after the transfer (a receiver keeps the last context as its delta base).
        self._on_control = self._on_lost = None
        await self.conn.end(self.stream, completed=completed)


class TxConnection:
    """A sender's long-lived connection to one receiving process, multiplexing transfers as streams.

    With ``wire_overhead`` (``tcp``) the kernel paces the connection (``SO_MAX_PACING_RATE``) at
    the sum of the rates of the transfers on it, times ``wire_overhead`` for the headers, and
    without a limit while any of them is unpaced. The transfers' own pacing holds their
    average rates, a chunk at a time; the kernel spreads each chunk's packets over its share of
    the time, so the link's queue stays short instead of taking a chunk in one burst, and a
    rate control slows the bytes already written at once (`repace`).
    """

    def __init__(
        self,
        path: str,
        channel: Channel,
        peer: str,
        on_closed: Callable[[TxConnection], None],
        *,
        wire_overhead: float = 0.0,
    ) -> None:
        self.path = path
        self.channel = channel
        self.peer = peer
        self.wire_overhead = wire_overhead
        """Wire bytes per payload byte for the kernel's pacing (0: the kernel does not pace)."""
        self.pacing_bps = 0.0
        """The kernel's pacing rate now, bytes/s on the wire (0: no limit)."""
        self.sessions: dict[int, DirectSendSession] = {}
        self.broken: PathError | None = None
        self._on_closed = on_closed
        self._binds: dict[int, asyncio.Future[tuple[bool, str]]] = {}
        self.on_release: dict[int, Callable[[], None]] = {}
        """Per stream: called when the receiver reports it let go of what the stream lent it (``shm``)."""
        self._lock = asyncio.Lock()
        self._next = 1
        self._reader = asyncio.create_task(self._read_loop(), name=f"kvbus-{path}-reader")

    async def send(self, buffers: Sequence[memoryview], fds: Sequence[int] = ()) -> None:
        """Write one frame atomically (frames of concurrent transfers never interleave).

        Raises:
            PathBroken: the connection failed (it is closed and every session on it is told).
        """
        if self.broken is not None:
            raise self.broken
        self.repace()
        async with self._lock:
            try:
                await self.channel.send(buffers, fds)
            except (OSError, RuntimeError) as exc:
                self.fail(PathBroken(self.path, f"write failed ({type(exc).__name__}: {exc})", peer=self.peer))
        if self.broken is not None:
            raise self.broken

    async def bind(self, session: DirectSendSession, token: str, *, timeout: float, fds: Sequence[int] = ()) -> None:
        """Open a stream for ``session``'s transfer with ``token``.

        Raises:
            TokenRefused: the receiver refused the token.
            PathUnavailable: no answer within ``timeout``, or the connection failed.
        """
        sid = self._next
        self._next += 1
        fut: asyncio.Future[tuple[bool, str]] = asyncio.get_running_loop().create_future()
        self._binds[sid] = fut
        payload = bind_payload(token, session.spec.transfer_id)
        try:
            await self.send([memoryview(pack(FrameType.BIND, sid, len(payload))), memoryview(payload)], fds)
            ok, reason = await asyncio.wait_for(fut, timeout)
        except PathBroken as exc:
            raise PathUnavailable(self.path, exc.detail, peer=self.peer) from None
        except TimeoutError:
            raise PathUnavailable(self.path, f"no answer to the bind within {timeout:.1f} s", peer=self.peer) from None
        finally:
            self._binds.pop(sid, None)
        if not ok:
            raise TokenRefused(self.path, reason, peer=self.peer)
        session.stream = sid
        self.sessions[sid] = session

    def repace(self) -> None:
        """Set the kernel's pacing to the transfers' rates now (see the class docstring); called
        before every frame and when a transfer's rate or pacer changes."""
        if self.wire_overhead <= 0 or self.broken is not None:
            return
        rates: dict[int, float] = {}
        for session in self.sessions.values():
            pacer = session.pacer
            if pacer is None:
                continue
            if pacer.rate <= 0:
                rates = {}
                break
            rates[id(pacer)] = pacer.rate  # transfers under one rate budget share its pacer
        rate = self.wire_overhead * sum(rates.values())
        now = self.pacing_bps
        if (rate <= 0) == (now <= 0) and abs(rate - now) <= REPACE_TOLERANCE * now:
            return
        try:
            self.channel.pace(rate)
        except OSError as exc:
            logger.debug("%s connection to %s: pacing refused (%s)", self.path, self.peer, exc)
            self.wire_overhead = 0.0  # this kernel does not pace; the transfers' own pacing holds
            return
        self.pacing_bps = rate

    async def end(self, stream: int, *, completed: bool) -> None:
        """End ``stream`` (best effort: a broken connection ends it anyway)."""
        self.sessions.pop(stream, None)
        self.repace()
        if self.broken is None:
            try:
                await self.send([memoryview(pack(FrameType.END, stream, flags=2 if completed else 0))])
            except PathBroken:
                pass

    async def _read_loop(self) -> None:
        try:
            while True:
                frame, payload = await self.channel.recv_frame(self.path)
                self._dispatch(frame, payload)
        except asyncio.CancelledError:
            raise
        except (EOFError, OSError) as exc:
            self.fail(PathBroken(self.path, f"connection lost ({type(exc).__name__}: {exc})", peer=self.peer))
        except PathProtocolError as exc:
            logger.warning("%s connection to %s: %s", self.path, self.peer, exc.detail)
            self.fail(PathBroken(self.path, exc.detail, peer=self.peer))
        except Exception as exc:
            logger.exception("%s connection to %s: reader failed", self.path, self.peer)
            self.fail(PathBroken(self.path, f"reader failed ({exc})", peer=self.peer))

    def _dispatch(self, frame: Frame, payload: bytes) -> None:
        kind = frame.type
        fut = self._binds.get(frame.stream)
        if kind is FrameType.BOUND or (kind is FrameType.REFUSED and fut is not None):
            if fut is not None and not fut.done():
                fut.set_result((kind is FrameType.BOUND, payload.decode("utf-8", "replace")))
            return
        session = self.sessions.get(frame.stream)
        if kind is FrameType.CTRL:
            if session is not None:
                session.control(payload)
        elif kind is FrameType.RELEASE:
            release = self.on_release.pop(frame.stream, None)
            if release is not None:
                release()
        elif kind in (FrameType.END, FrameType.REFUSED):
            if session is not None:
                self.sessions.pop(frame.stream, None)
                session.lost(PathBroken(self.path, "the receiver closed the stream", peer=self.peer))
        else:
            raise PathProtocolError(self.path, f"a sender does not take {kind.name} frames")

    def fail(self, error: PathError) -> None:
        """Close the connection and tell every session on it."""
        if self.broken is not None:
            return
        self.broken = error
        self.channel.close()
        for fut in self._binds.values():
            if not fut.done():
                fut.set_exception(PathBroken(self.path, error.detail, peer=self.peer))
        for session in list(self.sessions.values()):
            session.lost(error)
        self.sessions.clear()
        # What the receiver never released may still be mapped there: it is not reused.
        self.on_release.clear()
        if asyncio.current_task() is not self._reader:
            self._reader.cancel()
        self._on_closed(self)

    def close(self) -> None:
        """Close the connection (sessions on it fail with `PathBroken`)."""
        self.fail(PathBroken(self.path, "the connection was closed", peer=self.peer))


class DirectPath(DataPath, Generic[K]):
    """A direct path's sending side (`DataPath`): one long-lived `TxConnection` per receiving
    endpoint ``K``, made on first use and shared by every transfer to it.

    A path says how to reach an endpoint (`dial`), opens its sessions on `connection`, and
    closes what else it holds (its listener) in `close_listener`.
    """

    wire_overhead: float = 0.0
    """Wire bytes per payload byte when the kernel paces the path's connections (0: it does not)."""

    def __init__(self) -> None:
        self._conns: dict[K, TxConnection] = {}
        self._connecting: dict[K, asyncio.Task[TxConnection]] = {}

    @abstractmethod
    async def dial(self, endpoint: K) -> tuple[Channel, str]:
        """A new channel to ``endpoint`` and the peer's name for errors; called on the event loop
        by `connection` when there is no connection to it (at most one dial per endpoint at a time).

        Raises:
            PathUnavailable: it cannot be reached.
        """

    @abstractmethod
    async def close_listener(self) -> None:
        """Close what the path holds besides its connections (its listener); called by `close`."""

    async def connection(self, endpoint: K) -> TxConnection:
        """The connection to ``endpoint``: the open one, else a new one (concurrent callers share one dial).

        Raises:
            PathUnavailable: it cannot be reached.
        """
        conn = self._conns.get(endpoint)
        if conn is not None and conn.broken is None:
            return conn
        task = self._connecting.get(endpoint)
        if task is None:
            task = asyncio.create_task(self._connect(endpoint), name=f"kvbus-{self.kind.value}-connect")
            self._connecting[endpoint] = task
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._connecting.pop(endpoint, None)

    async def _connect(self, endpoint: K) -> TxConnection:
        channel, peer = await self.dial(endpoint)
        conn = TxConnection(self.kind.value, channel, peer, self._forget, wire_overhead=self.wire_overhead)
        self._conns[endpoint] = conn
        return conn

    def _forget(self, conn: TxConnection) -> None:
        for key, c in list(self._conns.items()):
            if c is conn:
                del self._conns[key]

    @property
    def connections(self) -> int:
        """Open connections to peers (for tests and `kvbus top`)."""
        return len(self._conns)

    async def close(self) -> None:
        """Close every connection (sessions on them fail with `PathBroken`), then the listener."""
        for task in self._connecting.values():
            task.cancel()
        for conn in list(self._conns.values()):
            conn.close()
        self._conns.clear()
        await self.close_listener()
