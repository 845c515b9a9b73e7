"""The receiving side of the ``tcp`` path: a listener whose connections read every chunk
straight into its transfer's final receive buffer (an `asyncio.BufferedProtocol`: the socket
(or TLS) layer writes into the buffer, nothing in between).

A connection must bind a stream with a valid, unused token for an offered transfer before
anything else; the first frame that is not such a BIND closes it, so a client that merely
reaches the port can neither write into a transfer nor read anything. A later bad BIND on an
authenticated connection is refused for that stream only.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl

import xxhash

from kvbus.bus.paths.base import PathKind, TransferSpec, digest_hex
from kvbus.bus.paths.errors import PathBroken, PathProtocolError, TokenRefused
from kvbus.bus.paths.frames import (
    HEADER_SIZE,
    MAX_CTRL,
    RECEIVER,
    TOKEN_BYTES,
    Frame,
    FrameType,
    pack,
    parse_bind,
    unpack,
)
from kvbus.bus.paths.registry import Expectations, Expected

logger = logging.getLogger(__name__)

_HEADER, _SMALL, _DATA, _DISCARD = range(4)
#: Scratch space for bytes read only to be dropped (duplicates, superseded streams).
_SCRATCH = 1 << 20
#: Ended stream ids remembered per connection (late frames on them are dropped, not an error).
MAX_ENDED = 4096


class TcpRxSession:
    """One transfer bound on one connection (`ReceiveSession`)."""

    kind = PathKind.TCP

    def __init__(self, conn: RxConnection, stream: int, expected: Expected, generation: int) -> None:
        self.conn = conn
        self.stream = stream
        self.expected = expected
        self.generation = generation
        self.spec: TransferSpec = expected.spec
        self.closed = False

    @property
    def current(self) -> bool:
        """Whether this stream may still write into the transfer's buffer."""
        return not self.closed and not self.expected.withdrawn and self.generation == self.expected.generation

    @property
    def can_control(self) -> bool:
        """Control messages can go back on the connection."""
        return True

    async def send_control(self, data: bytes) -> None:
        """Send ``data`` to the sender as a CTRL frame.

        Raises:
            PathBroken: the connection is gone or the stream closed.
            ValueError: more than 64 KB.
        """
        if len(data) > MAX_CTRL:
            raise ValueError(f"control message of {len(data)} bytes is over {MAX_CTRL}")
        if self.closed or self.conn.transport is None or self.conn.transport.is_closing():
            raise PathBroken("tcp", "the connection is closed", peer=self.spec.sender)
        self.conn.transport.write(pack(FrameType.CTRL, self.stream, len(data)) + data)

    def close(self) -> None:
        """Stop taking bytes for this transfer here and tell the sender (END)."""
        if self.closed:
            return
        self.conn.end_stream(self)
        t = self.conn.transport
        if t is not None and not t.is_closing():
            t.write(pack(FrameType.END, self.stream))


class RxConnection(asyncio.BufferedProtocol):
    """One accepted connection: a state machine over frames, reading payloads in place."""

    def __init__(self, listener: TcpListener) -> None:
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.streams: dict[int, TcpRxSession] = {}
        self.ended: set[int] = set()
        """Streams that ended: late frames for them are read and dropped."""
        self._hdr = bytearray(HEADER_SIZE)
        self._hview = memoryview(self._hdr)
        self._state = _HEADER
        self._got = 0
        self._frame: Frame | None = None
        self._small = memoryview(bytearray())
        self._target = memoryview(b"")
        self._session: TcpRxSession | None = None
        self._left = 0
        self._scratch = memoryview(bytearray(_SCRATCH))
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio callbacks ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """asyncio: a connection arrived (too many: closed at once; else a BIND is due within the timeout)."""
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if len(self.listener.connections) >= self.listener.max_connections:
            logger.warning("tcp data listener: too many connections, closing the one from %s", self.peer)
            transport.abort()  # type: ignore[attr-defined]
            return
        self.listener.connections.add(self)
        self.listener.accepted += 1
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self._timer = asyncio.get_running_loop().call_later(self.listener.bind_timeout, self._bind_deadline)

    def get_buffer(self, sizehint: int) -> memoryview:
        """asyncio: where the next bytes go (header, small payload, the chunk's place in its buffer, scratch)."""
        if self._state == _DATA:
            if self._session is not None and not self._session.current:
                # Superseded or ended mid-chunk: not one more byte into the buffer.
                self._state, self._left = _DISCARD, len(self._target) - self._got
            else:
                return self._target[self._got :]
        if self._state == _HEADER:
            return self._hview[self._got :]
        if self._state == _SMALL:
            return self._small[self._got :]
        return self._scratch[: min(self._left, _SCRATCH)]

    def buffer_updated(self, nbytes: int) -> None:
        """asyncio: ``nbytes`` arrived in the buffer last handed out."""
        try:
            self._advance(nbytes)
        except PathProtocolError as exc:
            logger.warning("tcp data connection from %s closed: %s", self.peer, exc.detail)
            self._abort()

    def eof_received(self) -> bool:
        """asyncio: the sender closed its side; the connection closes."""
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        """asyncio: the connection is gone; its bound transfers are told."""
        if self._timer is not None:
            self._timer.cancel()
        self.listener.connections.discard(self)
        why = f"connection from {self.peer} lost" + (f" ({exc})" if exc else "")
        for session in self.streams.values():
            if not session.closed:
                session.closed = True
                session.expected.notify_lost(session, PathBroken("tcp", why, peer=session.spec.sender))
        self.streams.clear()

    # -- frames -----------------------------------------------------------------------------

    def _advance(self, nbytes: int) -> None:
        if self._state == _DISCARD:
            self._left -= nbytes
            if self._left == 0:
                self._next_header()
            return
        self._got += nbytes
        if self._state == _HEADER:
            if self._got == HEADER_SIZE:
                self._got = 0
                self._begin(unpack(self._hdr, "tcp", RECEIVER))
        elif self._state == _SMALL:
            if self._got == len(self._small):
                self._small_done()
        elif self._got == len(self._target):
            self._data_done()

    def _next_header(self) -> None:
        self._state, self._got, self._session = _HEADER, 0, None

    def _discard(self, n: int) -> None:
        if n:
            self._state, self._left = _DISCARD, n
        else:
            self._next_header()

    def _begin(self, frame: Frame) -> None:
        self._frame = frame
        kind = frame.type
        if kind is FrameType.BIND:
            if frame.length <= TOKEN_BYTES:
                raise PathProtocolError("tcp", "BIND without a transfer id")
            self._state, self._small = _SMALL, memoryview(bytearray(frame.length))
            return
        session = self.streams.get(frame.stream)
        if session is None:
            if frame.stream in self.ended and kind in (FrameType.DATA, FrameType.CTRL, FrameType.END):
                self._discard(frame.length)
                return
            raise PathProtocolError("tcp", f"{kind.name} frame on stream {frame.stream}, which is not bound")
        if kind is FrameType.DATA:
            spec = session.spec
            if not 0 <= frame.index < spec.n_chunks or frame.length != spec.chunk_len(frame.index):
                raise PathProtocolError(
                    "tcp",
                    f"DATA for chunk {frame.index} of {frame.length} bytes does not fit "
                    f"the transfer's {spec.n_chunks} chunks",
                )
            if not session.current or session.expected.have[frame.index]:
                self._discard(frame.length)
                return
            lo, hi = spec.ranges[frame.index]
            self._state, self._session = _DATA, session
            self._target = session.expected.receive_buffer()[lo:hi]
        elif kind is FrameType.END:
            self.end_stream(session)
            self._next_header()
        elif kind is FrameType.CTRL:
            self._discard(frame.length)  # nothing flows this way yet; read and dropped
        else:
            raise PathProtocolError("tcp", f"a receiver does not take {kind.name} frames")

    def _small_done(self) -> None:
        frame = self._frame
        assert frame is not None  # set by _begin, which put us in this state
        token, tid = parse_bind(self._small, "tcp")
        self._next_header()
        if frame.stream in self.streams or frame.stream in self.ended:
            raise PathProtocolError("tcp", f"stream {frame.stream} is already bound")
        try:
            expected, generation = self.listener.registry.claim(tid, token, PathKind.TCP)
        except TokenRefused as exc:
            if not self.streams:
                logger.warning("tcp data connection from %s closed: transfer %s: %s", self.peer, tid[:64], exc.code)
                self._abort()
            else:
                reason = exc.code.encode()
                assert self.transport is not None
                self.transport.write(pack(FrameType.REFUSED, frame.stream, len(reason)) + reason)
            return
        for old in list(expected.sessions):
            if isinstance(old, TcpRxSession):
                old.conn.end_stream(old)  # superseded: the sender gave up on it
        session = TcpRxSession(self, frame.stream, expected, generation)
        self.streams[frame.stream] = session
        expected.receive_buffer()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        assert self.transport is not None
        self.transport.write(pack(FrameType.BOUND, frame.stream))
        expected.notify_opened(session)

    def _data_done(self) -> None:
        frame, session, target = self._frame, self._session, self._target
        self._next_header()
        assert frame is not None and session is not None
        value = xxhash.xxh3_64_intdigest(target)
        if value == frame.digest:
            session.expected.notify_arrived(frame.index, target, digest_hex(value), frame.root_hex)
        else:
            logger.warning("transfer %s: chunk %d failed its digest on tcp", session.spec.transfer_id, frame.index)
            session.expected.notify_corrupt(frame.index, PathKind.TCP)

    def end_stream(self, session: TcpRxSession) -> None:
        """Forget ``session`` (it ended); later frames on its stream are dropped."""
        session.closed = True
        session.expected.sessions.discard(session)
        if self.streams.pop(session.stream, None) is not None:
            self.ended.add(session.stream)
            if len(self.ended) > MAX_ENDED:
                self.ended.discard(min(self.ended))

    def _bind_deadline(self) -> None:
        self._timer = None
        if not self.streams:
            logger.warning(
                "tcp data connection from %s closed: no valid BIND within %.1f s", self.peer, self.listener.bind_timeout
            )
            self._abort()

    def _abort(self) -> None:
        self._state, self._left = _DISCARD, 1 << 62  # nothing more is looked at
        if self.transport is not None:
            self.transport.abort()


class TcpListener:
    """The per-process data listener of the ``tcp`` path."""

    def __init__(
        self,
        registry: Expectations,
        *,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None,
        bind_timeout: float,
        max_connections: int,
    ) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self.ssl_context = ssl_context
        self.bind_timeout = bind_timeout
        self.max_connections = max_connections
        self.connections: set[RxConnection] = set()
        self.accepted = 0
        """Connections accepted so far (for tests and `kvbus top`)."""
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Listen (``port`` 0: on a free port, then set)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: RxConnection(self),
            self.host,
            self.port,
            ssl=self.ssl_context,
            reuse_address=True,
            ssl_handshake_timeout=self.bind_timeout if self.ssl_context else None,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("tcp data listener on %s:%d%s", self.host, self.port, " (TLS)" if self.ssl_context else "")

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
        await server.wait_closed()
