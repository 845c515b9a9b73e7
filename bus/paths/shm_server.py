"""The receiving side of the ``shm`` path: an abstract-namespace ``SOCK_SEQPACKET`` listener.

Each message is one frame. A BIND brings the segment's descriptor; with a valid, unused token
the receiver checks the segment (its size is the payload's, it is sealed against resizing and
against writes by anyone but the process that made it),
maps it copy-on-write and closes the descriptor at once (no mapping keeps one: `map_fd`);
DATA frames name chunks to verify in place. A connection whose first frame is not a valid BIND
is closed (and any descriptor it passed with it).
"""

from __future__ import annotations

import array
import asyncio
import collections
import ctypes
import fcntl
import logging
import mmap
import os
import socket
import threading
import weakref
from collections.abc import Callable

import numpy as np
import xxhash

from kvbus.bus.paths.base import digest_hex
from kvbus.bus.paths.direct_server import DirectRxConnection, DirectRxSession
from kvbus.bus.paths.errors import PathProtocolError
from kvbus.bus.paths.frames import HEADER_SIZE, MAX_BIND, MAX_CTRL, RECEIVER, Frame, FrameType, pack, unpack
from kvbus.bus.paths.registry import Expectations, Expected
from kvbus.protocol import PathName

logger = logging.getLogger(__name__)

_MAX_FDS = 4
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1
"""No new write access from anyone: ``write``, writable shared mappings and hole punching are
refused; mappings made before it keep theirs (the sender's own)."""
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_WRITE_SEALS = fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE
#: A batch of DATA frames up to this many bytes is verified on the event loop (about 0.1 ms);
#: a larger one in `CHECK_THREADS` worker threads.
INLINE_CHECK_BYTES = 1 << 20
CHECK_THREADS = max(1, min(4, os.cpu_count() or 1))
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)  # Linux
_libc = ctypes.CDLL(None, use_errno=True)
_libc_mmap = _libc.mmap
_libc_mmap.restype = ctypes.c_void_p
_libc_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


def map_fd(fd: int, size: int, *, shared: bool, writable: bool, populate: bool = False) -> mmap.mmap:
    """A mapping of the first ``size`` bytes of ``fd`` that holds no descriptor of it.

    CPython's ``mmap.mmap(fd, ...)`` keeps a ``dup`` of the descriptor for as long as the mapping
    lives (3.13's ``trackfd=False`` does not), so every delivery a receiver holds would hold a
    descriptor too, up to the process's limit. Here an anonymous mapping of the same size (no
    descriptor) reserves the range and the file is mapped over it in place (``MAP_FIXED``): the
    `mmap.mmap` owns the range as usual (unmapped by ``close`` or when its last view goes) and
    the caller may close ``fd`` at once.

    Args:
        shared: ``MAP_SHARED`` (else copy-on-write, ``MAP_PRIVATE``).
        writable: mapped read-write (else read-only: writes through the object are refused).
        populate: fault every page in now (``MAP_POPULATE``).

    Raises:
        OSError: the kernel refused either mapping.
    """
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    placeholder = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE, prot=prot)
    try:
        start = np.frombuffer(placeholder, dtype=np.uint8).ctypes.data
        flags = (mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE) | _MAP_FIXED
        if populate:
            flags |= mmap.MAP_POPULATE
        got = _libc_mmap(start, size, prot, flags, fd, 0)
        if got != start:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    except BaseException:
        placeholder.close()
        raise
    return placeholder


def remap_private(start: int, size: int, fd: int) -> None:
    """Replace the mapping of ``fd`` at ``start`` by a copy-on-write (``MAP_PRIVATE``) one of the
    same bytes, in place: the addresses stay valid, reads see the file's pages, and a write
    makes a private copy of its page instead of changing the file.

    Raises:
        OSError: the kernel refused the mapping.
    """
    got = _libc_mmap(start, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_FIXED, fd, 0)
    if got != start:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class ShmRxSession(DirectRxSession):
    """One transfer bound on one ``shm`` connection (`ReceiveSession`); ``view`` is its mapping."""

    kind = PathName.SHM

    def __init__(
        self,
        conn: ShmRxConnection,
        stream: int,
        expected: Expected,
        generation: int,
        view: memoryview,
        check: memoryview | None = None,
    ) -> None:
        super().__init__(conn, stream, expected, generation)
        self.view: memoryview | None = view
        self.twin: memoryview | None = None
        """A second copy-on-write mapping of the same bytes (None with a private copy): what the
        receiver keeps as the sender's delta base instead of a copy."""
        self.check = check
        """The same bytes through the listener's kept read-only mapping of the segment (page tables
        filled by earlier transfers): chunks are hashed there; None: hashed in `view`."""

    def drop(self) -> None:
        """Mark closed and let go of the mapping (views handed on keep it)."""
        super().drop()
        self.view = None
        self.twin = None
        self.check = None


_W = tuple[ShmRxSession, Frame, memoryview, int, int]
"""One DATA frame to verify: its session, the frame, the bytes to hash and their range."""


class ShmRxConnection(DirectRxConnection[ShmRxSession]):
    """One accepted ``shm`` connection."""

    kind = PathName.SHM

    def __init__(self, listener: ShmListener, sock: socket.socket) -> None:
        super().__init__(listener.registry, listener.bind_timeout)
        self.listener = listener
        self.sock = sock
        self.fd = sock.fileno()
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self._out: collections.deque[bytes] = collections.deque()
        self._writing = False
        self._unchecked: collections.deque[tuple[ShmRxSession, Frame]] = collections.deque()
        """DATA frames read and not yet verified, in the order they came (and an END behind them)."""
        self._checking = False
        """A batch of them is being hashed in worker threads (the next waits for it: order holds)."""
        try:
            pid, uid, _ = array.array("i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            self.peer = f"pid {pid} (uid {uid})"
        except OSError:
            self.peer = "a local process"
        self.loop.add_reader(self.fd, self._readable)
        self.arm_bind_deadline(self.loop)

    def _readable(self) -> None:
        try:
            self._read()
        finally:
            self._check()

    def _read(self) -> None:
        while not self.closed:
            try:
                msg, anc, flags, _ = self.sock.recvmsg(HEADER_SIZE + MAX_CTRL, socket.CMSG_SPACE(4 * _MAX_FDS))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.close(f"read failed ({exc})")
                return
            fds = _fds(anc)
            if not msg and not fds:
                self.close("the sender closed the connection")
                return
            try:
                if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
                    raise PathProtocolError("shm", "message or descriptors truncated")
                self._frame(msg, fds)
            except PathProtocolError as exc:
                logger.warning("shm data connection from %s closed: %s", self.peer, exc.detail)
                self.close(exc.detail)
            finally:
                for fd in fds:  # whatever was not taken over
                    if fd >= 0:
                        os.close(fd)

    def _frame(self, msg: bytes, fds: list[int]) -> None:
        if len(msg) < HEADER_SIZE:
            raise PathProtocolError("shm", f"a message of {len(msg)} bytes is shorter than a frame header")
        frame = unpack(msg, "shm", RECEIVER)
        payload = msg[HEADER_SIZE:]
        if frame.type is not FrameType.DATA and len(payload) != frame.length:
            raise PathProtocolError("shm", f"{frame.type.name} frame says {frame.length} bytes, carries {len(payload)}")
        if frame.type is FrameType.BIND:
            if len(fds) != 1 or frame.length > MAX_BIND:
                raise PathProtocolError("shm", "a BIND carries exactly one segment")
            self._bind(frame, payload, fds)
            return
        if fds:
            raise PathProtocolError("shm", f"a {frame.type.name} frame carries no descriptors")
        if frame.type is FrameType.DATA and payload:
            raise PathProtocolError("shm", "a shm DATA frame carries no payload")
        session = self.session_of(frame)
        if session is None:
            return
        if frame.type is FrameType.DATA:
            self._data(session, frame)
        elif frame.type is FrameType.END:
            if self._unchecked or self._checking:
                self._unchecked.append((session, frame))  # after the chunks sent before it
            else:
                self.end_stream(session)
        elif frame.type is not FrameType.CTRL:
            raise self.unexpected(frame)

    def _bind(self, frame: Frame, payload: bytes, fds: list[int]) -> None:
        claimed = self.claim(frame, payload)
        if claimed is None:
            return
        expected, generation = claimed
        fd = fds[0]
        total = expected.spec.total
        try:
            size = os.fstat(fd).st_size
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            size, seals = -1, 0
        if size < total or seals & _SIZE_SEALS != _SIZE_SEALS or not seals & _WRITE_SEALS:
            # Unsealed against writes, any process that can open it could change bytes after
            # they were verified, under a delivery held in place.
            self.refuse(
                frame.stream,
                f"segment of {size} bytes for a payload of {total}, sealed {seals:#x} "
                "(it must be sealed against resizing and writes)",
            )
            return
        try:
            # Copy-on-write: the receiver may write its tensors; the sender's bytes stay as they are.
            # The twin is a second such mapping, for the receiver to keep as the sender's delta
            # base without copying the payload (pages are shared until either side writes).
            # Neither keeps a descriptor (`map_fd`): a held delivery holds memory, not a descriptor.
            mapped = map_fd(fd, total, shared=False, writable=True)
            twin = None if self.listener.private else map_fd(fd, total, shared=False, writable=True)
        except OSError as exc:
            self.refuse(frame.stream, f"cannot map the segment ({exc})")
            return
        check = self.listener.maps.view(self, fd, size, keep=not seals & fcntl.F_SEAL_WRITE)
        os.close(fd)
        fds[0] = -1
        # When the last view of both mappings is gone (possibly in a worker thread), the sender may reuse the segment.
        lent = _Lent(self.loop, self._released, frame.stream, 1 if twin is None else 2)
        weakref.finalize(mapped, lent.gone)
        if twin is not None:
            weakref.finalize(twin, lent.gone)
        session = ShmRxSession(self, frame.stream, expected, generation, memoryview(mapped), check)
        session.twin = None if twin is None else memoryview(twin)
        self.bound(session)

    def on_bound(self, session: ShmRxSession) -> None:
        """With a private copy, the transfer's own buffer is made now."""
        if self.listener.private:
            session.expected.receive_buffer()

    def _data(self, session: ShmRxSession, frame: Frame) -> None:
        self.check_data(session, frame)
        if _mapping(session, frame.index) is not None:
            self._unchecked.append((session, frame))

    def _check(self) -> None:
        """Verify the DATA frames read so far: a chunk or two here, a larger batch split over
        worker threads (xxh3 releases the GIL), so hashing runs on every core and not on the loop."""
        while not self._checking and self._unchecked and not self.closed:
            batch = []
            while self._unchecked and self._unchecked[0][1].type is FrameType.DATA:
                batch.append(self._unchecked.popleft())
            if not batch:
                self.end_stream(self._unchecked.popleft()[0])
                continue
            work = [w for w in (self._chunk(session, frame) for session, frame in batch) if w is not None]
            if sum(hi - lo for _, _, _, lo, hi in work) <= INLINE_CHECK_BYTES:
                self._checked(work, _hash([check for _, _, check, _, _ in work]))
                continue
            self._checking = True
            parts = _split(work, CHECK_THREADS)
            gathered = asyncio.gather(
                *(self.loop.run_in_executor(None, _hash, [check for _, _, check, _, _ in part]) for part in parts)
            )
            gathered.add_done_callback(lambda fut, work=work: self._hashed(work, fut))  # type: ignore[misc]

    def _hashed(self, work: list[_W], fut: asyncio.Future[list[list[int]]]) -> None:
        self._checking = False
        if fut.cancelled() or self.closed:
            return
        self._checked(work, [v for values in fut.result() for v in values])
        self._check()

    def _chunk(self, session: ShmRxSession, frame: Frame) -> _W | None:
        """What verifying one DATA frame hashes: the chunk's bytes (copied first with a private copy)."""
        view = _mapping(session, frame.index)
        if view is None:
            return None
        lo, hi = session.spec.ranges[frame.index]
        check = view[lo:hi] if session.check is None else session.check[lo:hi]
        if self.listener.private:
            own = session.expected.receive_buffer()[lo:hi]
            own[:] = check
            check = own
        return session, frame, check, lo, hi

    def _checked(self, work: list[_W], values: list[int]) -> None:
        for (session, frame, check, lo, hi), value in zip(work, values, strict=True):
            expected = session.expected
            view = _mapping(session, frame.index)
            if view is None:
                continue  # the stream ended or the chunk came another way meanwhile
            if value == frame.digest:
                data = check if self.listener.private else view[lo:hi]
                expected.notify_arrived(frame.index, data, digest_hex(value), frame.root_hex)
            else:
                logger.warning("transfer %s: chunk %d failed its digest on shm", session.spec.transfer_id, frame.index)
                expected.notify_corrupt(frame.index, PathName.SHM)

    def _released(self, stream: int) -> None:
        self.write(pack(FrameType.RELEASE, stream))

    @property
    def writable(self) -> bool:
        """Whether frames can still go to the sender (the connection is open)."""
        return not self.closed

    def write(self, data: bytes) -> None:
        """Send ``data`` as one message, in order after what is queued (dropped once closed)."""
        if self.closed:
            return
        self._out.append(data)
        if not self._writing:
            self._flush()

    def _flush(self) -> None:
        while self._out and not self.closed:
            try:
                self.sock.send(self._out[0])
            except (BlockingIOError, InterruptedError):
                if not self._writing:
                    self._writing = True
                    self.loop.add_writer(self.fd, self._flush)
                return
            except OSError as exc:
                self.close(f"write failed ({exc})")
                return
            self._out.popleft()
        if self._writing:
            self._writing = False
            self.loop.remove_writer(self.fd)

    def shut(self, why: str) -> None:
        """Close at once (see `close`)."""
        self.close(why)

    def close(self, why: str) -> None:
        """Close the connection; sessions still bound are reported lost."""
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.fd)
        if self._writing:
            self.loop.remove_writer(self.fd)
        self.sock.close()
        self.listener.connections.discard(self)
        self.listener.maps.forget(self)
        self.lose_streams(why)


def _mapping(session: ShmRxSession, index: int) -> memoryview | None:
    """The mapping chunk ``index`` is verified in, while it is still to verify (the stream is
    taken, the chunk not in yet); else None."""
    if not session.current or session.expected.have[index]:
        return None
    return session.view


def _hash(views: list[memoryview]) -> list[int]:
    return [xxhash.xxh3_64_intdigest(v) for v in views]


def _split(work: list[_W], n: int) -> list[list[_W]]:
    """``work`` in at most ``n`` contiguous runs of about equal bytes."""
    total = sum(w[4] - w[3] for w in work)
    parts: list[list[_W]] = [[]]
    done = 0
    for w in work:
        if parts[-1] and done >= total * len(parts) / n and len(parts) < n:
            parts.append([])
        parts[-1].append(w)
        done += w[4] - w[3]
    return parts


class _Lent:
    """Counts the mappings of one lent segment still alive; when none is, tells the sender (from
    whichever thread dropped the last one)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, released: Callable[[int], None], stream: int, n: int) -> None:
        self.loop = loop
        self.released = released
        self.stream = stream
        self.left = n
        self._lock = threading.Lock()

    def gone(self) -> None:
        with self._lock:
            self.left -= 1
            last = self.left == 0
        if last:
            _call_soon(self.loop, self.released, self.stream)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: object, *args: object) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)  # type: ignore[arg-type]
    except RuntimeError:
        pass  # the loop is closed: no one to tell


def _fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - len(data) % arr.itemsize])
            fds.extend(arr)
    return fds


class SegmentMaps:
    """Read-only shared mappings of the segments senders passed, kept between transfers.

    A sender reuses its segments (`SegmentPool`), so the next transfer in one of them is
    verified through page tables that are already filled, instead of faulting every page of a
    new mapping in again (which costs as much as hashing them). The deliveries themselves map
    the segment anew (copy-on-write, see `ShmRxConnection`). At most ``max_bytes`` stay mapped
    (least recently used go first); a connection's go when it closes, so a sender that died
    leaves nothing mapped here.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._maps: collections.OrderedDict[tuple[int, int, int], mmap.mmap] = collections.OrderedDict()
        self.bytes = 0
        """Bytes mapped now."""

    def __len__(self) -> int:
        return len(self._maps)

    def view(self, conn: ShmRxConnection, fd: int, size: int, *, keep: bool = True) -> memoryview | None:
        """A read-only view of the ``size`` bytes of segment ``fd`` passed on ``conn``: the kept
        mapping when that segment was seen before, else a new one kept from now on (None when it
        does not fit the budget or cannot be mapped).

        With ``keep`` false (a frozen segment, which its sender never writes again and so never
        reuses) the mapping is this transfer's alone, unmapped when its last view goes: kept, it
        would hold the segment's memory after its sender and every delivery let go of it (the
        four engines of `bench agents` held 0.6-1.2 GB each of such mappings after two rounds).
        """
        if size <= 0:
            return None
        if not keep:
            try:
                return memoryview(map_fd(fd, size, shared=True, writable=False))
            except OSError:
                return None
        if size > self.max_bytes:
            return None
        try:
            st = os.fstat(fd)
        except OSError:
            return None
        key = (id(conn), st.st_dev, st.st_ino)
        kept = self._maps.get(key)
        if kept is not None and len(kept) >= size:
            self._maps.move_to_end(key)
            return memoryview(kept)[:size]
        if kept is not None:
            self._drop(key)
        try:
            kept = map_fd(fd, size, shared=True, writable=False)
        except OSError:
            return None
        self._maps[key] = kept
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._maps)))
        return memoryview(kept)

    def forget(self, conn: ShmRxConnection) -> None:
        """Unmap the segments passed on ``conn`` (it closed)."""
        for key in [k for k in self._maps if k[0] == id(conn)]:
            self._drop(key)

    def _drop(self, key: tuple[int, int, int]) -> None:
        kept = self._maps.pop(key)
        self.bytes -= len(kept)
        try:
            kept.close()
        except BufferError:
            pass  # a chunk is being hashed through it: unmapped when that view goes

    def close(self) -> None:
        """Unmap everything."""
        for key in list(self._maps):
            self._drop(key)


class ShmListener:
    """The per-process ``shm`` listener, on an abstract Unix socket (nothing in the file system)."""

    def __init__(
        self,
        registry: Expectations,
        name: str,
        *,
        private: bool,
        max_connections: int,
        bind_timeout: float,
        map_cache_bytes: int = 0,
    ) -> None:
        self.registry = registry
        self.name = name
        self.private = private
        self.max_connections = max_connections
        self.bind_timeout = bind_timeout
        self.connections: set[ShmRxConnection] = set()
        self.maps = SegmentMaps(map_cache_bytes)
        self.accepted = 0
        """Connections accepted so far (for tests and `kvbus top`)."""
        self._sock: socket.socket | None = None

    @property
    def listening(self) -> bool:
        """Whether the listener is up."""
        return self._sock is not None

    def start(self) -> None:
        """Listen on the abstract socket ``\\0<name>``."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        sock.bind("\0" + self.name)
        sock.listen(128)
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._accept)
        logger.info("shm data listener on @%s", self.name)

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                logger.warning("shm listener: accept failed", exc_info=True)
                return
            if len(self.connections) >= self.max_connections:
                conn.close()
                continue
            conn.setblocking(False)
            self.accepted += 1
            self.connections.add(ShmRxConnection(self, conn))

    def close(self) -> None:
        """Stop listening and close every connection."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        asyncio.get_running_loop().remove_reader(sock.fileno())
        sock.close()
        for conn in list(self.connections):
            conn.close("the receiver closed its listener")
        self.maps.close()
