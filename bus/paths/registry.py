"""The receiver's side of the direct paths: the transfers it has offered, by transfer id, and
the claim a connection makes on one with its token."""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvbus.bus.paths.base import ChunkSink, ReceiveSession, TransferSpec
from kvbus.bus.paths.errors import PathError, TokenRefused
from kvbus.bus.paths.tokens import Claim, TokenTable
from kvbus.protocol import PathName

logger = logging.getLogger(__name__)


#: Buffers from this size up are anonymous mappings advised to use huge pages: the kernel then
#: faults in 2 MB at a time (fresh 4 KB pages fill at a quarter of memcpy speed on some VMs).
HUGE_FROM = 4 << 20


def _mapping(nbytes: int) -> mmap.mmap:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass  # no transparent huge pages here: 4 KB pages then
    return m


def allocate_buffer(nbytes: int) -> memoryview:
    """A fresh, writable byte buffer of ``nbytes`` (tensors can be built over it without a copy).

    Large ones are their own anonymous mapping with ``MADV_HUGEPAGE``; the memory goes back to
    the kernel when the last view or tensor over it is gone.
    """
    if nbytes < HUGE_FROM:
        return torch.empty(nbytes, dtype=torch.uint8).numpy().data.cast("B")
    return memoryview(_mapping(nbytes))


def _unused(m: mmap.mmap) -> bool:
    """Whether no view of ``m`` is left (resizing to the same size is refused while one exists)."""
    try:
        m.resize(len(m))
    except BufferError:
        return False
    except (OSError, ValueError, SystemError):
        return False
    return True


class BufferPool:
    """Receive buffers kept for reuse, up to ``max_bytes`` resident.

    Memory the kernel has not handed out yet costs page faults and zeroing to write into (on
    some VMs a quarter of memcpy speed or less); a buffer whose deliveries were all dropped is
    handed out again instead. One is reused only when no view or tensor over it is left, so a
    delivery that is still in use is never written over.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._maps: list[mmap.mmap] = []

    @property
    def pooled_bytes(self) -> int:
        """Bytes of the buffers the pool keeps (in use or not)."""
        return sum(len(m) for m in self._maps)

    def get(self, nbytes: int) -> memoryview:
        """A writable buffer of ``nbytes``."""
        if nbytes < HUGE_FROM:
            return allocate_buffer(nbytes)
        for m in self._maps:
            if nbytes <= len(m) <= 2 * nbytes and _unused(m):
                return memoryview(m)[:nbytes]
        m = _mapping(nbytes)
        if nbytes <= self.max_bytes:
            while self._maps and self.pooled_bytes + nbytes > self.max_bytes:
                free = [x for x in self._maps if _unused(x)]
                if not free:
                    break
                self._maps.remove(max(free, key=len))
            if self.pooled_bytes + nbytes <= self.max_bytes:
                self._maps.append(m)
        return memoryview(m)[:nbytes]

    def clear(self) -> None:
        """Forget every pooled buffer (views in use keep theirs)."""
        self._maps.clear()


@dataclass(eq=False)
class Expected:
    """One transfer a receiver offered direct paths for.

    ``have`` marks chunks verified on a direct path (later copies of them are read and dropped,
    never written over bytes the sink holds); ``generation`` grows with each bind, so a stream
    of an earlier bind (a connection the sender gave up on) cannot write any more.
    """

    spec: TransferSpec
    sink: ChunkSink
    paths: frozenset[PathName]
    buffer: memoryview | None = None
    have: bytearray = field(default_factory=bytearray)
    generation: int = 0
    sessions: set[ReceiveSession] = field(default_factory=set)
    withdrawn: bool = False
    allocate: Callable[[int], memoryview] = allocate_buffer

    def __post_init__(self) -> None:
        if not self.have:
            self.have = bytearray(self.spec.n_chunks)

    def receive_buffer(self) -> memoryview:
        """The final receive buffer of the ``tcp`` path (allocated on first use)."""
        if self.buffer is None:
            self.buffer = self.allocate(self.spec.total)
        return self.buffer

    def notify_arrived(self, index: int, data: memoryview, digest: str, root: str) -> None:
        """Mark ``index`` verified and tell the sink (its failures are logged, never raised into a path)."""
        self.have[index] = 1
        try:
            self.sink.chunk_arrived(index, data, digest, root)
        except Exception:
            logger.exception("transfer %s: the sink failed on chunk %d", self.spec.transfer_id, index)

    def notify_corrupt(self, index: int, kind: PathName) -> None:
        """Tell the sink chunk ``index`` failed its digest on ``kind``."""
        try:
            self.sink.chunk_corrupt(index, kind)
        except Exception:
            logger.exception("transfer %s: the sink failed on a corrupt chunk", self.spec.transfer_id)

    def notify_opened(self, session: ReceiveSession) -> None:
        """Record ``session`` and tell the sink."""
        self.sessions.add(session)
        try:
            self.sink.path_opened(session)
        except Exception:
            logger.exception("transfer %s: the sink failed on path_opened", self.spec.transfer_id)

    def notify_lost(self, session: ReceiveSession, error: PathError) -> None:
        """Forget ``session`` and tell the sink its path failed."""
        self.sessions.discard(session)
        if self.withdrawn:
            return
        try:
            self.sink.path_lost(session, error)
        except Exception:
            logger.exception("transfer %s: the sink failed on path_lost", self.spec.transfer_id)


class _Detached:
    """The sink of a withdrawn transfer: hears nothing."""

    def chunk_arrived(self, index: int, data: memoryview, digest: str, root: str) -> None:
        """Dropped."""

    def chunk_corrupt(self, index: int, path: PathName) -> None:
        """Dropped."""

    def path_opened(self, session: ReceiveSession) -> None:
        """Dropped."""

    def path_lost(self, session: ReceiveSession, error: PathError) -> None:
        """Dropped."""


_DETACHED = _Detached()


class Expectations:
    """The transfers offered on direct paths, and their tokens."""

    def __init__(self, tokens: TokenTable | None = None, *, pool_bytes: int = 0) -> None:
        self.tokens = tokens or TokenTable()
        self.pool = BufferPool(pool_bytes)
        self._expected: dict[str, Expected] = {}

    def expect(
        self,
        spec: TransferSpec,
        sink: ChunkSink,
        *,
        paths: frozenset[PathName],
        ttl: float,
        buffer: memoryview | None = None,
    ) -> str:
        """Offer ``spec`` on ``paths``; returns the token a connection must present.

        Raises:
            ValueError: ``buffer`` is not ``spec.total`` bytes.
        """
        if buffer is not None and buffer.nbytes != spec.total:
            raise ValueError(f"receive buffer of {buffer.nbytes} bytes for a payload of {spec.total}")
        old = self._expected.get(spec.transfer_id)
        if old is None:
            self._expected[spec.transfer_id] = Expected(spec, sink, paths, buffer, allocate=self.pool.get)
        return self.tokens.issue(spec.transfer_id, ttl)

    def reissue(self, transfer_id: str, ttl: float) -> str | None:
        """A new token for an offered transfer (its sender re-sent the `Open`); None if not offered."""
        if transfer_id not in self._expected:
            return None
        return self.tokens.issue(transfer_id, ttl)

    def claim(self, transfer_id: str, token: bytes, kind: PathName) -> tuple[Expected, int]:
        """Bind a stream to ``transfer_id`` with ``token`` on ``kind``: the transfer and the stream's generation.

        Raises:
            TokenRefused: the token is not valid for it (``code`` says why), or ``kind`` was not offered.
        """
        outcome = self.tokens.claim(transfer_id, token)
        expected = self._expected.get(transfer_id)
        if outcome is Claim.OK and expected is not None and kind not in expected.paths:
            outcome = Claim.UNKNOWN
        if outcome is not Claim.OK or expected is None:
            raise TokenRefused(kind.value, outcome.value)
        expected.generation += 1
        return expected, expected.generation

    def get(self, transfer_id: str) -> Expected | None:
        """The offered transfer, if any."""
        return self._expected.get(transfer_id)

    def withdraw(self, transfer_id: str) -> Expected | None:
        """The transfer ended: its token stops working and its direct sessions are closed."""
        self.tokens.revoke(transfer_id)
        expected = self._expected.pop(transfer_id, None)
        if expected is not None:
            expected.withdrawn = True
            for session in list(expected.sessions):
                session.close()
            expected.sessions.clear()
            # A sink that keeps its sessions would make a reference cycle with us and keep a
            # shared mapping alive until the next garbage collection.
            expected.sink = _DETACHED
        return expected

    def __len__(self) -> int:
        return len(self._expected)
