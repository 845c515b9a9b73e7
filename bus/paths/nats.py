"""The ``nats`` path: chunk messages on the transfer's data subject, as kvbus always sent them
(index and xxh3-64 in NATS headers, the whole-payload digest on the last), published without
joining the pieces (`kvbus.net.transport.NatsTransport.publish_views`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvbus.bus.paths.base import ChunkSink, DataPath, OpenRequest, Pacer, TransferSpec, chunk_digest
from kvbus.bus.paths.errors import PathBroken, PathUnavailable
from kvbus.net.transport import Transport, publish_views
from kvbus.protocol import CHUNK_INDEX_HEADER, CHUNK_SUM_HEADER, ROOT_SUM_HEADER, PathName, PathOffer

logger = logging.getLogger(__name__)


class NatsSendSession:
    """One transfer's chunks published on its data subject (`SendSession`)."""

    kind = PathName.NATS

    def __init__(self, transport: Transport, spec: TransferSpec) -> None:
        self.transport = transport
        self.spec = spec
        self._broken: PathBroken | None = None
        self._closed = False

    @property
    def segment(self) -> memoryview | None:
        """No shared segment on NATS."""
        return None

    @property
    def broken(self) -> PathBroken | None:
        """Why publishing failed, once it has."""
        return self._broken

    async def send_chunk(self, index: int, pieces: Sequence[memoryview], digest: str, *, root: str = "") -> None:
        """Publish chunk ``index`` (see `SendSession.send_chunk`); while NATS reconnects, it is buffered."""
        if self._broken is not None:
            raise self._broken
        if not 0 <= index < self.spec.n_chunks:
            raise ValueError(f"chunk {index} is out of range (0..{self.spec.n_chunks - 1})")
        if sum(memoryview(p).nbytes for p in pieces) != self.spec.chunk_len(index):
            raise ValueError(f"chunk {index}'s pieces do not add up to its {self.spec.chunk_len(index)} bytes")
        headers = {CHUNK_INDEX_HEADER: str(index), CHUNK_SUM_HEADER: digest}
        if root:
            headers[ROOT_SUM_HEADER] = root
        try:
            await publish_views(self.transport, self.spec.data_subject, pieces, headers)
        except (nats.errors.ConnectionClosedError, nats.errors.OutboundBufferLimitError, OSError) as exc:
            self._broken = PathBroken("nats", f"publish failed ({type(exc).__name__})", peer=self.spec.receiver)
            raise self._broken from None

    def pace(self, pacer: Pacer | None) -> None:
        """NATS is not paced by the kernel here: the sender's own pacing holds the rate."""

    async def close(self, *, completed: bool = True) -> None:
        """Nothing to end on NATS."""
        self._closed = True


class NatsReceiveSession:
    """The receiver's subscription to one transfer's data subject (`ReceiveSession`)."""

    kind = PathName.NATS

    def __init__(self, transport: Transport, spec: TransferSpec, sink: ChunkSink) -> None:
        self.transport = transport
        self.spec = spec
        self.sink = sink
        self.dropped = 0
        """Messages without a usable index (counted, dropped)."""
        self._sub: Subscription | None = None
        self.closed = False

    @property
    def can_control(self) -> bool:
        """Acks go on NATS by the transfer logic, not through this session."""
        return False

    async def send_control(self, data: bytes) -> None:
        """Not on this path.

        Raises:
            PathUnavailable: always (publish acks on the sender's ack subject instead).
        """
        raise PathUnavailable("nats", "control messages go on the sender's ack subject")

    async def start(self) -> None:
        """Subscribe to the data subject."""
        self._sub = await self.transport.subscribe(self.spec.data_subject, self._on_chunk)

    async def _on_chunk(self, msg: Msg) -> None:
        if self.closed:
            return
        headers = msg.headers or {}
        try:
            index = int(headers[CHUNK_INDEX_HEADER])
        except (KeyError, ValueError):
            self.dropped += 1
            logger.warning("transfer %s: chunk without a valid index header dropped", self.spec.transfer_id)
            return
        if not 0 <= index < self.spec.n_chunks:
            self.dropped += 1
            logger.warning("transfer %s: chunk index %d out of range dropped", self.spec.transfer_id, index)
            return
        data = msg.data
        digest = headers.get(CHUNK_SUM_HEADER, "")
        if len(data) != self.spec.chunk_len(index) or chunk_digest(data) != digest:
            self.sink.chunk_corrupt(index, PathName.NATS)
            return
        self.sink.chunk_arrived(index, memoryview(data), digest, headers.get(ROOT_SUM_HEADER, ""))

    def close(self) -> None:
        """Unsubscribe (in the background; the callback is not called any more)."""
        self.closed = True  # no more chunks into the sink, whatever is still queued
        sub, self._sub = self._sub, None
        if sub is not None:
            asyncio.get_running_loop().create_task(_unsubscribe(sub))


async def _unsubscribe(sub: Subscription) -> None:
    try:
        await sub.unsubscribe()
    except Exception:
        logger.debug("unsubscribe failed", exc_info=True)


class NatsPath(DataPath):
    """The ``nats`` path (`DataPath`)."""

    kind = PathName.NATS

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    async def start(self) -> None:
        """Nothing to start: the NATS connection is the bus's."""

    async def close(self) -> None:
        """Nothing to close here."""

    def reachable(self, offer: PathOffer | None, local_host: str) -> bool:
        """NATS reaches every receiver."""
        return True

    async def open_session(self, request: OpenRequest) -> NatsSendSession:
        """A session publishing on the spec's data subject.

        Raises:
            PathUnavailable: the spec names no data subject.
        """
        spec = request.spec
        if not spec.data_subject:
            raise PathUnavailable("nats", "the transfer has no data subject", peer=spec.receiver)
        return NatsSendSession(self.transport, spec)

    async def receive(self, spec: TransferSpec, sink: ChunkSink) -> NatsReceiveSession:
        """Subscribe ``sink`` to ``spec``'s data subject.

        Raises:
            PathUnavailable: the spec names no data subject.
        """
        if not spec.data_subject:
            raise PathUnavailable("nats", "the transfer has no data subject", peer=spec.sender)
        session = NatsReceiveSession(self.transport, spec, sink)
        await session.start()
        return session
