"""The data-path seam: how a transfer's chunk bytes move once the `Open` has been answered.

Every path keeps the transfer's chunk framing: chunk ``i`` covers bytes ``ranges[i]`` of the
payload laid out back to back, travels with its xxh3-64 digest (and the last one with the
whole-payload digest), and is verified by the receiving side of the path before the transfer
logic sees it. Credit, repair, resume and exactly-once stay with the transfer logic
(`kvbus.bus.stream` today); a path only moves bytes:

- sender: ``session = await path.open(spec, offer, on_control=..., on_lost=...)``, then
  ``await session.send_chunk(i, pieces, digest, root=...)`` for each chunk (in any order, again
  for a repair), ``await session.close()``;
- receiver: the `ChunkSink` of the transfer gets ``chunk_arrived(i, data, digest, root)`` with
  the verified bytes (a view of the final receive buffer, of the shared segment, or of the NATS
  message), ``chunk_corrupt(i, path)``, and ``path_opened`` / ``path_lost`` for the sessions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import xxhash

from kvbus.bus.paths.errors import PathError
from kvbus.protocol import PathName, PathOffer

ControlHandler = Callable[[bytes], None]
"""Called with each control message (e.g. an encoded `Ack`) the receiver sent on the path."""
LostHandler = Callable[[PathError], None]
"""Called once when a session's path fails under it."""


def chunk_digest(data: bytes | bytearray | memoryview) -> str:
    """The per-chunk digest kvbus uses everywhere: xxh3-64, 16 hex characters."""
    return xxhash.xxh3_64_hexdigest(data)


def digest_int(digest: str) -> int:
    """A chunk digest (16 hex characters) as the integer framed on direct paths."""
    return int(digest, 16)


def digest_hex(value: int) -> str:
    """The inverse of `digest_int` (same text as `chunk_digest`)."""
    return f"{value:016x}"


@dataclass(frozen=True, slots=True)
class TransferSpec:
    """What both ends know of one transfer from its `Open`: who, and the chunk layout.

    Attributes:
        transfer_id: the transfer's id (a name: letters, digits, ``-``, ``_``, at most 64).
        sender: sending agent.
        receiver: receiving agent.
        ranges: per chunk, (first byte, end byte) in the payload laid out back to back:
            contiguous from 0, each non-empty (`ChunkPlan.ranges`).
        data_subject: the NATS subject of the chunk messages (the ``nats`` path).

    Raises:
        ValueError: ranges that are not contiguous and non-empty.
    """

    transfer_id: str
    sender: str
    receiver: str
    ranges: tuple[tuple[int, int], ...]
    data_subject: str = ""

    def __post_init__(self) -> None:
        pos = 0
        for lo, hi in self.ranges:
            if lo != pos or hi <= lo:
                raise ValueError(f"chunk ranges must be contiguous from 0 and non-empty, got ({lo}, {hi}) at {pos}")
            pos = hi
        if not 1 <= len(self.transfer_id.encode()) <= 64:
            raise ValueError("transfer_id must be 1-64 bytes")

    @classmethod
    def of(
        cls, transfer_id: str, sender: str, receiver: str, ranges: Sequence[tuple[int, int]], data_subject: str = ""
    ) -> TransferSpec:
        """Build from any sequence of ranges (e.g. ``ChunkPlan(...).ranges``)."""
        return cls(transfer_id, sender, receiver, tuple((int(lo), int(hi)) for lo, hi in ranges), data_subject)

    @property
    def total(self) -> int:
        """Payload bytes."""
        return self.ranges[-1][1] if self.ranges else 0

    @property
    def n_chunks(self) -> int:
        """Number of chunks."""
        return len(self.ranges)

    def chunk_len(self, index: int) -> int:
        """Bytes of chunk ``index``."""
        lo, hi = self.ranges[index]
        return hi - lo


@runtime_checkable
class ChunkSink(Protocol):
    """The receiving transfer: what a path tells it. Called on the event loop; must not block.

    A sink may get the same chunk more than once (a repair, or two paths during a fallback)
    and keeps the first; it must keep ``data`` referenced for as long as it needs the bytes.
    """

    def chunk_arrived(self, index: int, data: memoryview, digest: str, root: str) -> None:
        """Chunk ``index`` arrived and matched ``digest``; ``root`` is the whole-payload digest
        (32 hex characters) when the sender attached it (on the last chunk), else empty."""
        ...

    def chunk_corrupt(self, index: int, path: PathName) -> None:
        """Chunk ``index`` arrived on ``path`` but failed its digest (nothing was kept)."""
        ...

    def path_opened(self, session: ReceiveSession) -> None:
        """A sender connected a direct path for this transfer (``session`` can carry control messages back)."""
        ...

    def path_lost(self, session: ReceiveSession, error: PathError) -> None:
        """``session``'s path failed (the sender died, the connection reset); chunks in flight on it are lost."""
        ...


@runtime_checkable
class Pacer(Protocol):
    """What paces one transfer's writes (`kvbus.bus.pacing.TokenBucket`): its rate in bytes/s
    of payload, 0 when unpaced."""

    rate: float


class SendSession(Protocol):
    """The sender's side of one transfer on one path."""

    kind: PathName
    spec: TransferSpec

    @property
    def segment(self) -> memoryview | None:
        """A writable view of the payload's final place (``shm``: the shared segment, where a
        codec can encode so that `send_chunk` copies nothing); None on other paths."""
        ...

    @property
    def broken(self) -> PathError | None:
        """Why the path failed, once it has."""
        ...

    async def send_chunk(self, index: int, pieces: Sequence[memoryview], digest: str, *, root: str = "") -> None:
        """Send chunk ``index``: ``pieces`` are its bytes in order (scatter-gather, never joined).

        The pieces must stay valid and unchanged until the chunk is acknowledged.

        Raises:
            PathBroken: the path failed; the chunk may or may not have arrived.
            ValueError: ``index`` out of range or the pieces' size is not the chunk's.
        """
        ...

    def pace(self, pacer: Pacer | None) -> None:
        """The transfer's writes are paced by ``pacer`` (its ``rate`` read again before every
        chunk; None: unpaced): a path the kernel paces (``tcp``) holds its connection to the
        rates of its transfers, the others ignore it. Called by the sender once the session is
        open and when the transfer's rate changes."""
        ...

    async def close(self, *, completed: bool = True) -> None:
        """End this transfer on the path (idempotent); the connection stays up for other transfers."""
        ...


@runtime_checkable
class ReceiveSession(Protocol):
    """The receiver's side of one transfer on one path."""

    kind: PathName
    spec: TransferSpec

    @property
    def can_control(self) -> bool:
        """Whether `send_control` works on this path (direct paths: yes; ``nats``: acks go on NATS)."""
        ...

    async def send_control(self, data: bytes) -> None:
        """Send a small control message (at most 64 KB, e.g. an encoded `Ack`) back to the sender.

        Raises:
            PathBroken: the path is gone.
        """
        ...

    def close(self) -> None:
        """Stop taking bytes for this transfer on this path (idempotent)."""
        ...


@dataclass(frozen=True, slots=True)
class OpenRequest:
    """What the sender gives a path to open a session for one transfer (`DataPath.open`).

    Attributes:
        spec: the transfer.
        offer: the receiver's direct-path offer from its `OpenReply` (None: it made none).
        on_control: called with each control message the receiver sends back on the path.
        on_lost: called once when the session's path fails under it.
        segment: where the payload already is (``shm``: a `kvbus.bus.paths.shm.Segment`, so
            nothing is copied); the other paths ignore it.
    """

    spec: TransferSpec
    offer: PathOffer | None
    on_control: ControlHandler | None = None
    on_lost: LostHandler | None = None
    segment: object | None = None


class DataPath(ABC):
    """One way to move chunk bytes, as the sender sees it (receivers register transfers with
    the `kvbus.bus.paths.plane.DataPlane`, which hands them to the path that gets a connection).

    A path implements `start`, `close`, `reachable` and `open_session`; `open` is the same for all.
    """

    kind: PathName

    @abstractmethod
    async def start(self) -> None:
        """Start listening (direct paths that receive); called once, on the event loop, by `DataPlane.start`."""

    @abstractmethod
    async def close(self) -> None:
        """Close listeners and connections; sessions still open fail with `PathBroken`."""

    @abstractmethod
    def reachable(self, offer: PathOffer | None, local_host: str) -> bool:
        """Whether it is worth trying this path for a receiver that made ``offer``."""

    async def open(
        self,
        spec: TransferSpec,
        offer: PathOffer | None,
        *,
        on_control: ControlHandler | None = None,
        on_lost: LostHandler | None = None,
        segment: object | None = None,
    ) -> SendSession:
        """A session for ``spec`` to the receiver that made ``offer`` (the fields of `OpenRequest`).

        Raises:
            PathUnavailable: the path cannot be used for it (nothing was sent).
        """
        return await self.open_session(OpenRequest(spec, offer, on_control, on_lost, segment))

    @abstractmethod
    async def open_session(self, request: OpenRequest) -> SendSession:
        """The path's part of `open`: called on the event loop by `open` (`DataPlane.connect`).

        Raises:
            PathUnavailable: the path cannot be used for it (nothing was sent).
        """
