"""The receiving side of the ``tcp`` path: a listener whose connections read every chunk
straight into its transfer's final receive buffer (an `asyncio.BufferedProtocol`: the socket
(or TLS) layer writes into the buffer, nothing in between).

A connection must bind a stream with a valid, unused token for an offered transfer before
anything else; the first frame that is not such a BIND closes it, so a client that merely
reaches the port can neither write into a transfer nor read anything. A later bad BIND on an
authenticated connection is refused for that stream only.

Until its first BIND a connection costs a few hundred bytes here (a frame header and the BIND's
payload; with TLS, also asyncio's TLS buffer): at most `PathsConfig.tcp_max_unbound` such
connections are kept, `PathsConfig.tcp_max_unbound_per_source` of them from one address, each
for `PathsConfig.tcp_bind_deadline_s` (TLS handshake included); more are closed at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import ssl
import time

import xxhash

from kvbus.bus.paths.base import digest_hex
from kvbus.bus.paths.direct_server import DirectRxConnection, DirectRxSession
from kvbus.bus.paths.errors import PathProtocolError
from kvbus.bus.paths.frames import HEADER_SIZE, RECEIVER, TOKEN_BYTES, Frame, FrameType, unpack
from kvbus.bus.paths.registry import Expectations
from kvbus.protocol import PathName

logger = logging.getLogger(__name__)

_HEADER, _SMALL, _DATA, _DISCARD = range(4)
#: Scratch space for bytes read only to be dropped (duplicates, superseded streams): one for
#: the process, as nothing ever reads it back.
_SCRATCH = 1 << 20
_DROPPED = memoryview(bytearray(_SCRATCH))
#: Seconds between two warnings about connections turned away.
WARN_EVERY_S = 10.0


class TcpRxSession(DirectRxSession):
    """One transfer bound on one connection (`ReceiveSession`): its chunks are read into the transfer's buffer."""

    kind = PathName.TCP


class RxConnection(DirectRxConnection[TcpRxSession], asyncio.BufferedProtocol):
    """One accepted connection: a state machine over frames, reading payloads in place."""

    kind = PathName.TCP

    def __init__(self, listener: TcpListener) -> None:
        super().__init__(listener.registry, listener.bind_deadline)
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.source = ""
        """The peer's address (without the port): pre-BIND connections are counted per source."""
        self.unbound = False
        """Counted among the listener's connections that have not bound a stream yet."""
        self.gone = False
        self.aborted = False
        """Closed by this side (a bad frame, the deadline, an eviction)."""
        self._hdr = bytearray(HEADER_SIZE)
        self._hview = memoryview(self._hdr)
        self._state = _HEADER
        self._got = 0
        self._frame: Frame | None = None
        self._small = memoryview(bytearray())
        self._target = memoryview(b"")
        self._session: TcpRxSession | None = None
        self._left = 0
        self._held: list[bytes] | None = None
        """Writes held while the TLS handshake completes (frames read right after it may answer
        before `transport` is the TLS one)."""
        self._tls: asyncio.Task[None] | None = None

    @property
    def buffer_bytes(self) -> int:
        """Bytes of buffers this connection holds of its own (a chunk's bytes go to its transfer's buffer)."""
        return len(self._hdr) + self._small.nbytes

    @property
    def writable(self) -> bool:
        """Whether frames can still go to the sender."""
        return not self.gone and self.transport is not None and not self.transport.is_closing()

    def write(self, data: bytes) -> None:
        """Send ``data`` to the sender (dropped once the connection is closing)."""
        t = self.transport
        if self._held is not None:
            self._held.append(data)
        elif not self.gone and t is not None and not t.is_closing():
            t.write(data)

    # -- asyncio callbacks ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """asyncio: a connection arrived, before any TLS handshake (over a cap: closed at once;
        else a BIND is due within the deadline)."""
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.source = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if not self.listener.admit(self):
            transport.abort()  # type: ignore[attr-defined]
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        loop = asyncio.get_running_loop()
        self.arm_bind_deadline(loop)
        if self.listener.ssl_context is not None:
            # Nothing is read until TLS wraps the connection (`loop.start_tls` takes over reading).
            transport.pause_reading()  # type: ignore[attr-defined]
            self._held = []
            self._tls = loop.create_task(self._start_tls(transport), name=f"kvbus-tcp-tls-{self.peer}")

    async def _start_tls(self, plain: asyncio.BaseTransport) -> None:
        assert self.listener.ssl_context is not None
        if self.gone or plain.is_closing():
            return  # closed before its turn came (evicted in the same burst of connections)
        tls: asyncio.BaseTransport | None = None
        try:
            tls = await asyncio.get_running_loop().start_tls(
                plain,  # type: ignore[arg-type]
                self,
                self.listener.ssl_context,
                server_side=True,
                ssl_handshake_timeout=self.listener.bind_deadline,
            )
        except asyncio.CancelledError:
            plain.close()
            self._forget(None)
            raise
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            if not self.aborted:  # (closed by this side: the deadline, an eviction)
                logger.info("tcp data connection from %s closed: TLS handshake failed (%r)", self.peer, exc)
        except Exception:
            logger.exception("tcp data connection from %s: TLS failed", self.peer)
        if tls is None or tls.is_closing():
            plain.close()
            self._forget(None)  # asyncio tells no one of a connection lost in the handshake
            return
        self.transport = tls  # type: ignore[assignment]
        held, self._held = self._held or [], None
        for data in held:
            self.write(data)

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
        return _DROPPED[: min(self._left, _SCRATCH)]

    def buffer_updated(self, nbytes: int) -> None:
        """asyncio: ``nbytes`` arrived in the buffer last handed out."""
        try:
            self._advance(nbytes)
        except PathProtocolError as exc:
            logger.warning("tcp data connection from %s closed: %s", self.peer, exc.detail)
            self.abort()

    def eof_received(self) -> bool:
        """asyncio: the sender closed its side; the connection closes."""
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        """asyncio: the connection is gone; its bound transfers are told."""
        self._forget(exc)

    def _forget(self, exc: Exception | None) -> None:
        if self.gone:
            return
        self.gone = True
        self.listener.forget(self)
        self.lose_streams(f"connection from {self.peer} lost" + (f" ({exc})" if exc else ""))

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
        session = self.session_of(frame)
        if session is None:
            self._discard(frame.length)
            return
        if kind is FrameType.DATA:
            self.check_data(session, frame)
            if not session.current or session.expected.have[frame.index]:
                self._discard(frame.length)
                return
            lo, hi = session.spec.ranges[frame.index]
            self._state, self._session = _DATA, session
            self._target = session.expected.receive_buffer()[lo:hi]
        elif kind is FrameType.END:
            self.end_stream(session)
            self._next_header()
        elif kind is FrameType.CTRL:
            self._discard(frame.length)  # nothing flows this way yet; read and dropped
        else:
            raise self.unexpected(frame)

    def _small_done(self) -> None:
        frame = self._frame
        assert frame is not None  # set by _begin, which put us in this state
        self._next_header()
        claimed = self.claim(frame, self._small)
        if claimed is not None:
            self.bound(TcpRxSession(self, frame.stream, *claimed))

    def on_bound(self, session: TcpRxSession) -> None:
        """The stream's buffer is made now; the connection no longer counts against the pre-BIND caps."""
        session.expected.receive_buffer()
        self.listener.bound(self)

    def _data_done(self) -> None:
        frame, session, target = self._frame, self._session, self._target
        self._next_header()
        assert frame is not None and session is not None
        value = xxhash.xxh3_64_intdigest(target)
        if value == frame.digest:
            session.expected.notify_arrived(frame.index, target, digest_hex(value), frame.root_hex)
        else:
            logger.warning("transfer %s: chunk %d failed its digest on tcp", session.spec.transfer_id, frame.index)
            session.expected.notify_corrupt(frame.index, PathName.TCP)

    def shut(self, why: str) -> None:
        """Close at once (see `abort`)."""
        self.abort()

    def abort(self) -> None:
        """Close the connection at once; nothing more it sends is looked at."""
        self.aborted = True
        self._state, self._left = _DISCARD, 1 << 62  # nothing more is looked at
        if self.transport is not None:
            self.transport.abort()


class TcpListener:
    """The per-process data listener of the ``tcp`` path.

    Args:
        registry: the transfers offered (what a BIND may claim).
        host: address to listen on; port: port (0: a free one, set by `start`).
        ssl_context: TLS of each connection (the handshake runs once it was admitted).
        bind_deadline: seconds a connection has to bind its first stream, TLS handshake included.
        max_connections: connections kept at once, bound or not.
        max_unbound: of those, how many may not have bound a stream yet.
        max_unbound_per_source: of those, how many from one address.
    """

    def __init__(
        self,
        registry: Expectations,
        *,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None,
        bind_deadline: float,
        max_connections: int,
        max_unbound: int,
        max_unbound_per_source: int,
    ) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self.ssl_context = ssl_context
        self.bind_deadline = bind_deadline
        self.max_connections = max_connections
        self.max_unbound = max_unbound
        self.max_unbound_per_source = max_unbound_per_source
        self.connections: set[RxConnection] = set()
        self.unbound: collections.Counter[str] = collections.Counter()
        """Per source address, its connections that have not bound a stream yet."""
        self._waiting: dict[RxConnection, None] = {}
        """The connections that have not bound a stream yet, oldest first."""
        self.accepted = 0
        """Connections accepted so far (for tests and `kvbus top`)."""
        self.refused = 0
        """Connections closed as they came, over a cap (for tests and `kvbus top`)."""
        self.evicted = 0
        """Unbound connections closed to make room for a new one (for tests and `kvbus top`)."""
        self._warned = 0.0
        self._server: asyncio.Server | None = None

    @property
    def turned_away(self) -> int:
        """Connections closed over a cap, refused or evicted."""
        return self.refused + self.evicted

    @property
    def unbound_total(self) -> int:
        """Connections that have not bound a stream yet."""
        return len(self._waiting)

    def admit(self, conn: RxConnection) -> bool:
        """Keep ``conn`` (it just connected) unless a cap says no; counted as unbound until `bound`.

        Over `max_unbound` the oldest unbound connection makes room (a sender binds within a
        round trip, so what waits longest is a stranger's); over `max_unbound_per_source` or
        `max_connections` the new one is closed.
        """
        if len(self.connections) >= self.max_connections:
            self.refused += 1
            self._turn_away(conn, f"{len(self.connections)} connections are open")
            return False
        if self.unbound[conn.source] >= self.max_unbound_per_source:
            self.refused += 1
            self._turn_away(conn, f"{self.unbound[conn.source]} connections from {conn.source} have not bound yet")
            return False
        if len(self._waiting) >= self.max_unbound:
            oldest = next(iter(self._waiting))
            self.bound(oldest)
            self.evicted += 1
            self._turn_away(oldest, f"{self.max_unbound} connections have not bound yet; this one waited longest")
            oldest.abort()
        self.connections.add(conn)
        self.unbound[conn.source] += 1
        self._waiting[conn] = None
        conn.unbound = True
        self.accepted += 1
        return True

    def _turn_away(self, conn: RxConnection, why: str) -> None:
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY_S:
            self._warned = now
            logger.warning(
                "tcp data listener: closing the connection from %s: %s (%d turned away so far)",
                conn.peer,
                why,
                self.turned_away,
            )

    def bound(self, conn: RxConnection) -> None:
        """``conn`` bound its first stream (or is gone): it no longer counts against the pre-BIND caps."""
        if conn.unbound:
            conn.unbound = False
            self._waiting.pop(conn, None)
            self.unbound[conn.source] -= 1
            if self.unbound[conn.source] <= 0:
                del self.unbound[conn.source]

    def forget(self, conn: RxConnection) -> None:
        """``conn`` is gone."""
        self.bound(conn)
        self.connections.discard(conn)

    async def start(self) -> None:
        """Listen (``port`` 0: on a free port, then set)."""
        loop = asyncio.get_running_loop()
        # TLS is started per connection once it is admitted (`RxConnection._start_tls`), so that
        # a handshake in progress counts against the caps too.
        self._server = await loop.create_server(lambda: RxConnection(self), self.host, self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("tcp data listener on %s:%d%s", self.host, self.port, " (TLS)" if self.ssl_context else "")

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for conn in list(self.connections):
            if conn._tls is not None:
                conn._tls.cancel()
            if conn.transport is not None:
                conn.transport.abort()
        await server.wait_closed()
