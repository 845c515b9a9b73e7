"""The ``shm`` path: sender and receiver on one host share the payload's memory.

The sender puts the payload in an anonymous segment (``memfd_create``: no file in ``/dev/shm``
or anywhere, so nothing is left behind by a crash), ideally by encoding straight into it
(`Segment.tensor`), and passes the segment's descriptor over a Unix socket (``SCM_RIGHTS``) in
its BIND. The receiver maps it and verifies each chunk where it lies as its DATA frame
(header only) arrives; the chunk views it hands on are views of that mapping (or, with
`PathsConfig.shm_private`, of its own copy). The socket is in the abstract namespace (no file
either). The memory is the kernel's to reclaim when the last descriptor and mapping are gone:
a process that dies (kill -9 included) drops its own, and its peer, seeing the socket close,
drops the session's.

Segments are sealed against shrinking and growing before they are shared, so neither side can
truncate the memory under the other (which would crash it with SIGBUS), and against writes
through any mapping or descriptor made after the sender's own (``F_SEAL_FUTURE_WRITE``): no
other process can change bytes a receiver verified and holds, not even one of the same user
that opens the descriptor through ``/proc/<pid>/fd`` (it could before: a delivery held in
place changed under its receiver). The seals go on before any payload byte is written, so no
writable mapping of anyone else can predate them. The sending process keeps its one writable
mapping (the pool reuses the segment once the receiver let go). A receiver that does not trust
the sending process itself copies each chunk (`PathsConfig.shm_private`).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import mmap
import os
import secrets
import socket

import numpy as np
import torch

from kvbus.bus.paths.base import ControlHandler, LostHandler, OpenRequest, TransferSpec
from kvbus.bus.paths.config import PathsConfig
from kvbus.bus.paths.direct import DirectPath, DirectSendSession, PacketChannel, TxConnection
from kvbus.bus.paths.errors import PathUnavailable, TokenRefused
from kvbus.bus.paths.frames import FrameType, pack
from kvbus.bus.paths.host import host_identity
from kvbus.bus.paths.registry import Expectations
from kvbus.bus.paths.shm_server import F_SEAL_FUTURE_WRITE, ShmListener, map_fd, remap_private
from kvbus.protocol import PathName, PathOffer

logger = logging.getLogger(__name__)

#: Seals every shared segment carries: its size is fixed and nobody but its maker writes it.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
#: Seals a segment that will be frozen (`Segment.freeze`) carries until then: ``F_SEAL_SEAL``
#: would forbid adding ``F_SEAL_WRITE``.
FREEZABLE_SEALS = SEALS & ~fcntl.F_SEAL_SEAL
#: Seals a frozen segment adds: nobody writes it any more, not even the process that made it.
FROZEN_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14


def address(view: memoryview) -> int:
    """The address of a buffer's first byte."""
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]) if view.nbytes else 0


class Segment:
    """An anonymous shared-memory segment of ``nbytes``, mapped writable by the process that made it.

    Write the payload into `view` (or a codec into `tensor`); a ``shm`` session passes the
    descriptor to the receiver. Close it when the transfer is over; the memory itself goes once
    no mapping of it is left (views and tensors over it keep it).

    Raises:
        OSError: the kernel could not make it (no memory).
        ValueError: ``nbytes`` is not positive.
    """

    def __init__(
        self, nbytes: int, *, name: str = "kvbus-segment", populate: bool = True, freezable: bool = False
    ) -> None:
        if nbytes <= 0:
            raise ValueError("a segment needs at least one byte")
        self.nbytes = nbytes
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            # One descriptor per segment (the one passed to receivers): the mapping keeps none.
            # It is this process's one writable mapping: sealed right after it (before a byte is
            # written), nobody can make another, so only this process ever writes the segment.
            self._map: mmap.mmap | None = map_fd(self.fd, nbytes, shared=True, writable=True)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, FREEZABLE_SEALS if freezable else SEALS)
            if populate:
                _populate(self._map)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self._map)
        self.address = address(self.view)
        self.pooled = False
        """Whether it came from a `SegmentPool` (and goes back to it once nothing holds it)."""
        self.holds = 0
        """Who still uses it (a transfer staged into it, a session whose receiver maps it): it
        goes back to its pool when the last one lets go (`SegmentPool.release`)."""
        self.freezable = freezable
        """Made to be frozen (`freeze`) once its producer is done with it (`Agent.kv_buffer`)."""
        self.frozen = False
        """Whether `freeze` sealed it against every write."""

    def freeze(self) -> bool:
        """Make the segment's bytes immutable for everyone, this process included, and keep this
        process's views of it valid: its writable shared mapping becomes a copy-on-write one of
        the same bytes at the same addresses (a later write through a tensor over it makes a
        private copy of the page and never reaches the segment), then ``F_SEAL_WRITE`` goes on.
        Idempotent. False when the segment could not be frozen (not `freezable`, or the kernel
        refused): it then keeps ``F_SEAL_FUTURE_WRITE``, so that no other process writes it.
        """
        if self.frozen:
            return True
        if not self.freezable or self.fd < 0 or self._map is None:
            return False
        try:
            remap_private(self.address, self.nbytes, self.fd)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, FROZEN_SEALS)
        except OSError as exc:
            logger.warning("shm segment of %d bytes not frozen: %s", self.nbytes, exc)
            return False
        self.frozen = True
        try:  # map the pages again now, read-only (copy-on-write), so the hash reads them without a fault each
            self._map.madvise(MADV_POPULATE_READ)
        except OSError:
            pass  # before Linux 5.14: they fault in as they are read
        return True

    def untouched(self) -> bool:
        """Whether this process's tensors over a frozen segment still read its bytes: no page of
        the copy-on-write mapping `freeze` made has been written (a written page became private
        memory, which ``/proc/self/pagemap`` tells apart from the segment's own pages). False
        when that cannot be read."""
        if not self.frozen:
            return False
        page = mmap.PAGESIZE
        first, n = self.address // page, -(-self.nbytes // page)
        try:
            with open("/proc/self/pagemap", "rb", buffering=0) as f:
                f.seek(first * 8)
                raw = f.read(n * 8)
        except OSError:
            return False
        if len(raw) != n * 8:
            return False
        entries = np.frombuffer(raw, dtype=np.uint64)
        present = (entries >> np.uint64(63)) & np.uint64(1)
        swapped = (entries >> np.uint64(62)) & np.uint64(1)  # only a private copy is swapped from a pte
        shared = (entries >> np.uint64(61)) & np.uint64(1)  # a file or shared page, not a private copy
        return not bool(np.any((present & (shared ^ np.uint64(1))) | swapped))

    def tensor(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """A writable uint8 tensor over ``nbytes`` of the segment from ``offset`` (no copy)."""
        end = self.nbytes if nbytes is None else offset + nbytes
        if not 0 <= offset <= end <= self.nbytes:
            raise ValueError(f"[{offset}, {end}) is outside the segment of {self.nbytes} bytes")
        return torch.frombuffer(self.view, dtype=torch.uint8, count=end - offset, offset=offset)

    def close_fd(self) -> None:
        """Drop this process's descriptor (the mapping stays); idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        """Drop the descriptor and this object's hold on the mapping (views and tensors still keep it)."""
        self.close_fd()
        try:
            self.view.release()
        except BufferError:
            pass  # tensors over it are alive
        m, self._map = self._map, None
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass  # tensors or views over it are alive: unmapped when they go

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)


def _populate(m: mmap.mmap) -> None:
    """Fault every page of the writable mapping ``m`` in now (as ``MAP_POPULATE`` would)."""
    try:
        m.madvise(MADV_POPULATE_WRITE)
    except OSError:  # a kernel before 5.14: touch a byte per page
        np.frombuffer(m, dtype=np.uint8)[:: mmap.PAGESIZE] = 0


class SegmentPool:
    """Segments whose receivers let go of them, kept for reuse: a fresh segment's pages must be
    faulted in and zeroed by the kernel, which is several times slower than copying into
    pages already there."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: list[Segment] = []

    @property
    def free_bytes(self) -> int:
        """Bytes of the segments waiting for reuse."""
        return sum(s.nbytes for s in self._free)

    def get(self, nbytes: int) -> Segment:
        """A segment of at least ``nbytes`` (at most twice that): a free one, else a new one.

        Raises:
            OSError: no memory for a new one.
        """
        fits = [s for s in self._free if nbytes <= s.nbytes <= 2 * nbytes]
        if fits:
            seg = min(fits, key=lambda s: s.nbytes)
            self._free.remove(seg)
            return seg
        seg = Segment(nbytes)
        seg.pooled = True
        return seg

    def release(self, seg: Segment) -> None:
        """One holder of ``seg`` let go: back to the pool when it was the last."""
        seg.holds -= 1
        if seg.holds <= 0:
            self.put(seg)

    def put(self, seg: Segment) -> None:
        """Keep ``seg`` for reuse (its receivers no longer map it), or close it when the pool is full."""
        if seg.fd < 0 or seg in self._free or seg.freezable:
            return  # (a freezable segment belongs to its producer's cache, not to a pool)
        if self.free_bytes + seg.nbytes > self.max_bytes:
            seg.close()
        else:
            self._free.append(seg)

    def close(self) -> None:
        """Close every free segment."""
        for seg in self._free:
            seg.close()
        self._free.clear()


class ShmSendSession(DirectSendSession):
    """One transfer's stream on a ``shm`` connection; its bytes are in `segment`."""

    kind = PathName.SHM

    def __init__(
        self,
        spec: TransferSpec,
        conn: TxConnection,
        seg: Segment,
        *,
        pool: SegmentPool | None,
        peer: str,
        on_control: ControlHandler | None,
        on_lost: LostHandler | None,
    ) -> None:
        super().__init__(spec, conn, peer=peer, on_control=on_control, on_lost=on_lost)
        self.seg = seg
        self._pool = pool
        self._released = False

    def released(self) -> None:
        """The receiver no longer maps the segment (its RELEASE arrived)."""
        self._released = True
        self._recycle()

    def _recycle(self) -> None:
        if self._pool is not None and self._closed and self._released:
            pool, self._pool = self._pool, None
            pool.release(self.seg)

    @property
    def segment(self) -> memoryview | None:
        """The shared segment: write chunk bytes at their payload offsets and `send_chunk` copies nothing."""
        return self.seg.view

    async def _send(self, index: int, pieces: list[memoryview], digest: int, root: str) -> None:
        lo, hi = self.spec.ranges[index]
        if not (len(pieces) == 1 and address(pieces[0]) == self.seg.address + lo):
            dst = np.frombuffer(self.seg.view, dtype=np.uint8, count=hi - lo, offset=lo)
            pos = 0
            for p in pieces:
                n = p.nbytes
                np.copyto(dst[pos : pos + n], np.frombuffer(p, dtype=np.uint8))
                pos += n
        await self.conn.send(
            [memoryview(pack(FrameType.DATA, self.stream, hi - lo, index=index, digest=digest, root=root))]
        )

    async def close(self, *, completed: bool = True) -> None:
        """End the stream; a segment the session took from the pool goes back once the receiver let go of it."""
        await super().close(completed=completed)
        self._recycle()


class ShmPath(DirectPath[str]):
    """The ``shm`` path of one process: its listener (when it receives) and its connections (`DirectPath`)."""

    kind = PathName.SHM

    def __init__(self, registry: Expectations | None, *, config: PathsConfig) -> None:
        super().__init__()
        self.config = config
        self.pool = SegmentPool(config.shm_pool_bytes)
        self.name = f"kvbus-shm-{os.getpid()}-{secrets.token_hex(8)}"
        self.listener = (
            ShmListener(
                registry,
                self.name,
                private=config.shm_private,
                map_cache_bytes=config.shm_map_cache_bytes,
                max_connections=config.max_connections,
                bind_timeout=config.connect_timeout_s,
            )
            if registry is not None
            else None
        )

    async def start(self) -> None:
        """Start the listener, if this process receives on ``shm``."""
        if self.listener is not None:
            self.listener.start()

    @property
    def endpoint(self) -> str:
        """The listener's abstract socket name ('' when not listening)."""
        return self.name if self.listener is not None and self.listener.listening else ""

    def reachable(self, offer: PathOffer | None, local_host: str) -> bool:
        """Whether ``offer`` names a shm listener on this host."""
        return bool(offer is not None and offer.shm and offer.host == local_host)

    async def open_session(self, request: OpenRequest) -> ShmSendSession:
        """Pass the request's segment (or a new one) to the offer's listener and bind a stream for the spec.

        Raises:
            PathUnavailable: not offered, another host, unreachable, empty payload, token refused.
        """
        spec, offer, segment = request.spec, request.offer, request.segment
        if offer is None or not self.reachable(offer, host_identity()):
            raise PathUnavailable("shm", "not offered", peer=spec.receiver)
        if spec.total == 0:
            raise PathUnavailable("shm", "nothing to share in an empty payload", peer=spec.receiver)
        if segment is not None and (not isinstance(segment, Segment) or segment.nbytes < spec.total or segment.fd < 0):
            raise ValueError("segment must be an open Segment of at least the payload's size")
        conn = await self.connection(offer.shm)
        # A segment from this path's pool (`segment`) goes back to it once the receiver let go.
        own = segment is None or (isinstance(segment, Segment) and segment.pooled)
        try:
            seg = segment if isinstance(segment, Segment) else self.pool.get(spec.total)
        except OSError as exc:
            raise PathUnavailable("shm", f"cannot make a segment of {spec.total} bytes ({exc})") from None
        session = ShmSendSession(
            spec,
            conn,
            seg,
            pool=self.pool if own else None,
            peer=offer.shm,
            on_control=request.on_control,
            on_lost=request.on_lost,
        )
        try:
            await conn.bind(session, offer.token, timeout=self.config.connect_timeout_s, fds=[seg.fd])
        except TokenRefused:
            if segment is None:
                self.pool.put(seg)  # refused: the receiver closed the descriptor unmapped
            raise
        if own:
            seg.holds += 1  # let go when the receiver released it and the session closed
        conn.on_release[session.stream] = session.released
        return session

    def segment(self, nbytes: int) -> Segment:
        """A segment for a payload of ``nbytes`` to encode into (pass it to `open`), held by the
        caller: ``pool.release`` it when done (it is reused once no receiver maps it either), or
        keep it.

        Raises:
            OSError: no memory.
        """
        seg = self.pool.get(nbytes)
        seg.holds += 1
        return seg

    async def dial(self, endpoint: str) -> tuple[PacketChannel, str]:
        """A channel to the listener on the abstract socket ``endpoint`` (see `DirectPath.dial`)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(
                asyncio.get_running_loop().sock_connect(sock, "\0" + endpoint), self.config.connect_timeout_s
            )
        except (OSError, TimeoutError) as exc:
            sock.close()
            raise PathUnavailable("shm", f"cannot connect ({type(exc).__name__}: {exc})", peer=endpoint) from None
        return PacketChannel(sock), endpoint

    async def close_listener(self) -> None:
        """Close the segment pool and the listener (`DirectPath.close` closed the connections)."""
        self.pool.close()
        if self.listener is not None:
            self.listener.close()
