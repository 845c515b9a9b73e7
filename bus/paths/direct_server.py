"""What the receiving side of the direct paths (``tcp``, ``shm``) shares: the session of one
transfer bound on a stream, and the streams of one accepted connection.

A connection (`DirectRxConnection`) must bind a stream with a valid, unused token for an offered
transfer before anything else (`bind_deadline`); a BIND claims the transfer (`claim`), the path
takes its bytes its own way (the ``tcp`` path reads them into the final buffer, the ``shm``
path maps the sender's segment), and `bound` makes the stream current, superseding the same
path's earlier streams of the transfer. The frames are the same on both paths; what differs,
how a frame is read and a reply written, is the subclass's (`writable`, `write`, `shut`).
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from typing import Any, Generic, TypeVar

from kvbus.bus.paths.base import TransferSpec
from kvbus.bus.paths.errors import PathBroken, PathProtocolError, TokenRefused
from kvbus.bus.paths.frames import MAX_CTRL, Frame, FrameType, pack, parse_bind
from kvbus.bus.paths.registry import Expectations, Expected
from kvbus.protocol import PathName

logger = logging.getLogger(__name__)

#: Ended stream ids remembered per connection (late frames on them are dropped, not an error).
MAX_ENDED = 4096
#: Bytes of a refusal's reason sent back in a REFUSED frame.
MAX_REASON = 256
#: Frames that may still arrive on a stream after it ended (dropped).
_LATE = (FrameType.DATA, FrameType.CTRL, FrameType.END)


class DirectRxSession:
    """One transfer bound on one stream of a direct connection (`ReceiveSession`)."""

    kind: PathName = PathName.TCP

    def __init__(self, conn: DirectRxConnection[Any], stream: int, expected: Expected, generation: int) -> None:
        self.conn = conn
        self.stream = stream
        self.expected = expected
        self.generation = generation
        self.spec: TransferSpec = expected.spec
        self.closed = False

    @property
    def current(self) -> bool:
        """Whether chunks named on this stream are still taken (not closed, not withdrawn, not superseded)."""
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
        if self.closed or not self.conn.writable:
            raise PathBroken(self.kind.value, "the connection is closed", peer=self.spec.sender)
        self.conn.write(pack(FrameType.CTRL, self.stream, len(data)) + data)

    def close(self) -> None:
        """Stop taking bytes for this transfer here and tell the sender (END)."""
        if self.closed:
            return
        self.conn.end_stream(self)
        self.conn.write(pack(FrameType.END, self.stream))

    def drop(self) -> None:
        """Mark closed (a path that lent this session memory lets go of it too)."""
        self.closed = True


S = TypeVar("S", bound=DirectRxSession)


class DirectRxConnection(ABC, Generic[S]):
    """The streams of one accepted direct connection, whose sessions are ``S``.

    Args:
        registry: the transfers offered (what a BIND may claim).
        bind_timeout: seconds the connection has to bind its first stream (`arm_bind_deadline`).
    """

    kind: PathName

    def __init__(self, registry: Expectations, bind_timeout: float) -> None:
        self.registry = registry
        self.bind_timeout = bind_timeout
        self.peer = ""
        """Who connected, for the logs."""
        self.streams: dict[int, S] = {}
        self.ended: set[int] = set()
        """Streams that ended: late frames for them are dropped."""
        self._timer: asyncio.TimerHandle | None = None

    @property
    @abstractmethod
    def writable(self) -> bool:
        """Whether frames can still go to the sender."""

    @abstractmethod
    def write(self, data: bytes) -> None:
        """Send the frame ``data`` to the sender, after those sent before (dropped once the connection is closed)."""

    @abstractmethod
    def shut(self, why: str) -> None:
        """Close the connection at once, for ``why``; nothing more it sends is looked at."""

    # -- binding -------------------------------------------------------------------------------

    def arm_bind_deadline(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the connection unless it binds a stream within `bind_timeout` (call once it is accepted)."""
        self._timer = loop.call_later(self.bind_timeout, self._bind_deadline)

    def _bind_deadline(self) -> None:
        self._timer = None
        if not self.streams:
            logger.warning(
                "%s data connection from %s closed: no valid BIND within %.1f s",
                self.kind.value,
                self.peer,
                self.bind_timeout,
            )
            self.shut("no valid BIND in time")

    def claim(self, frame: Frame, payload: bytes | memoryview) -> tuple[Expected, int] | None:
        """The transfer a BIND on ``frame.stream`` claims with its token, and the stream's generation;
        None when the token was refused on a connection with other streams (the sender was told).

        Raises:
            PathProtocolError: a malformed BIND, a stream bound twice, or a refused token on a
                connection that bound nothing yet (it is closed).
        """
        path = self.kind.value
        token, tid = parse_bind(payload, path)
        if frame.stream in self.streams or frame.stream in self.ended:
            raise PathProtocolError(path, f"stream {frame.stream} is already bound")
        try:
            return self.registry.claim(tid, token, self.kind)
        except TokenRefused as exc:
            if not self.streams:
                raise PathProtocolError(path, f"transfer {tid[:64]}: {exc.code}") from None
            self.refuse(frame.stream, exc.code)
            return None

    def bound(self, session: S) -> None:
        """Take ``session``, whose stream claimed its transfer: the same path's earlier streams of
        the transfer end (the sender gave up on them), the sender is told BOUND and the sink
        `path_opened`."""
        expected = session.expected
        for old in list(expected.sessions):
            if isinstance(old, DirectRxSession) and old.kind is self.kind:
                old.conn.end_stream(old)  # superseded: the sender gave up on it
        self.streams[session.stream] = session
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.on_bound(session)
        self.write(pack(FrameType.BOUND, session.stream))
        expected.notify_opened(session)

    def on_bound(self, session: S) -> None:
        """Called by `bound` before the sender is told (default: nothing)."""

    def refuse(self, stream: int, reason: str) -> None:
        """Tell the sender the BIND on ``stream`` is refused, and why."""
        data = reason.encode()[:MAX_REASON]
        self.write(pack(FrameType.REFUSED, stream, len(data)) + data)

    # -- frames on bound streams ---------------------------------------------------------------

    def session_of(self, frame: Frame) -> S | None:
        """The session ``frame`` is for; None for a late frame on a stream that ended (drop it).

        Raises:
            PathProtocolError: the stream was never bound.
        """
        session = self.streams.get(frame.stream)
        if session is None and not (frame.stream in self.ended and frame.type in _LATE):
            raise PathProtocolError(
                self.kind.value, f"{frame.type.name} frame on stream {frame.stream}, which is not bound"
            )
        return session

    def check_data(self, session: S, frame: Frame) -> None:
        """Raise for a DATA frame that names no chunk of ``session``'s transfer, or not its size.

        Raises:
            PathProtocolError: it does not fit.
        """
        spec = session.spec
        if not 0 <= frame.index < spec.n_chunks or frame.length != spec.chunk_len(frame.index):
            raise PathProtocolError(
                self.kind.value,
                f"DATA for chunk {frame.index} of {frame.length} bytes does not fit "
                f"the transfer's {spec.n_chunks} chunks",
            )

    def unexpected(self, frame: Frame) -> PathProtocolError:
        """The error for a frame type receivers never take."""
        return PathProtocolError(self.kind.value, f"a receiver does not take {frame.type.name} frames")

    # -- ending --------------------------------------------------------------------------------

    def end_stream(self, session: S) -> None:
        """Forget ``session`` (it ended) and let go of what it holds; later frames on its stream are dropped."""
        session.drop()
        session.expected.sessions.discard(session)
        if self.streams.pop(session.stream, None) is not None:
            self.ended.add(session.stream)
            if len(self.ended) > MAX_ENDED:
                self.ended.discard(min(self.ended))

    def lose_streams(self, why: str) -> None:
        """The connection is gone: every session still bound is reported lost, with ``why``."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for session in self.streams.values():
            if not session.closed:
                session.drop()
                session.expected.notify_lost(session, PathBroken(self.kind.value, why, peer=session.spec.sender))
        self.streams.clear()
