"""How a payload is cut into chunks and put back together, and the digests that check it.

Both sides compute the same `ChunkPlan` from the buffer sizes in the `Open`: the sender reads
chunks through a `ChunkSource`, the receiver rebuilds the buffers with a `Reassembly`. Each
chunk has an xxh3-64 digest. A streamed `Open` carries every chunk's digest (`Open.digests`,
`ChunkSource.digests`) and their root (`digests_root`); the receiver checks each chunk against
that list (`ChunkVerifier`), never against anything a chunk message says about itself, so a
forged or injected chunk is dropped and asked for again from the sender. An inline payload's
digest (`tree_digest`) is a hash over its chunks' digests.

This module is the one place of chunk framing and verification: every data path (NATS today)
checks an `Open` with `check_open_plan` and its chunks with a `ChunkVerifier`.
"""

from __future__ import annotations

import asyncio
import bisect
from array import array
from collections.abc import Iterator, Sequence
from typing import cast

import numpy as np
import torch
import xxhash

from kvbus.bus.paths.shm import address
from kvbus.errors import WireFormatError
from kvbus.protocol import DIGEST_BYTES, MAX_CHUNKS, Open

#: Buffers below ``chunk_size // PACK_DIVISOR`` are packed together into one chunk; larger
#: ones get chunks of their own (no copy on either side), split when above ``chunk_size``.
PACK_DIVISOR = 16


def chunk_digest(data: bytes | memoryview) -> str:
    """The xxh3-64 digest of one chunk, in hex."""
    return xxhash.xxh3_64_hexdigest(data)


def chunk_digest_bytes(data: bytes | memoryview) -> bytes:
    """The xxh3-64 digest of one chunk, as the `DIGEST_BYTES` it takes in `Open.digests`."""
    return xxhash.xxh3_64_digest(data)


def tree_digest(chunk_digests: Sequence[str], total: int) -> str:
    """The whole-payload digest of an inline payload: xxh3-128 over the chunks' hex digests and the size.

    Every chunk is hashed once, so hashing the digests (a one-level hash tree) checks the whole
    payload without a second pass over its bytes.
    """
    h = xxhash.xxh3_128(str(total).encode())
    for d in chunk_digests:
        h.update(d.encode())
    return h.hexdigest()


def digests_root(digests: bytes, total: int) -> str:
    """The whole-payload digest of a streamed payload: xxh3-128 over the size and the digest list."""
    h = xxhash.xxh3_128(str(total).encode())
    h.update(digests)
    return h.hexdigest()


def _small(chunk_size: int) -> int:
    return max(1, chunk_size // PACK_DIVISOR)


def _ends(sizes: Sequence[int], chunk_size: int, out: array | None) -> int:
    """Walk the chunk plan of ``sizes``: the number of chunks, and (into ``out``) each chunk's end byte.

    A chunk is either a slice of one buffer or several whole small buffers back to back; chunks
    cover the payload contiguously from byte 0, so their ends describe them.
    """
    small = _small(chunk_size)
    count = 0
    run_len = -1  # bytes of the open run of small buffers, -1 when none is open
    pos = 0
    for n in sizes:
        if n == 0:
            continue
        if n < small and run_len >= 0 and run_len + n <= chunk_size:
            run_len += n
            pos += n
            continue
        if run_len >= 0:
            count += 1
            if out is not None:
                out.append(pos)
            run_len = -1
        if n < small:
            run_len = n
            pos += n
            continue
        pieces = -(-n // chunk_size)
        count += pieces
        if out is not None:
            out.extend(range(pos + chunk_size, pos + n, chunk_size))
            out.append(pos + n)
        pos += n
    if run_len >= 0:
        count += 1
        if out is not None:
            out.append(pos)
    return count


class _Ranges(Sequence[tuple[int, int]]):
    """Per chunk ``(first byte, end byte)``, read off a compact array of chunk ends."""

    def __init__(self, ends: array) -> None:
        self._ends = ends

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, index: int) -> tuple[int, int]:  # type: ignore[override]
        if index < 0:
            index += len(self._ends)
        if not 0 <= index < len(self._ends):
            raise IndexError(index)
        return (self._ends[index - 1] if index else 0), self._ends[index]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        lo = 0
        for hi in self._ends:
            yield lo, hi
            lo = hi


class ChunkPlan:
    """Deterministic split of a list of buffer sizes into chunks, computed alike on both sides.

    A chunk is either a slice of one buffer or several whole small buffers back to back, so a
    buffer that fits in a chunk never straddles two: the sender publishes views without joining
    and the receiver builds tensors over the chunk it received without copying. The plan takes
    8 bytes per chunk and 16 per buffer.
    """

    def __init__(self, sizes: Sequence[int], chunk_size: int) -> None:
        self.sizes = array("q", sizes)
        self.chunk_size = chunk_size
        self.starts = array("q")
        offset = 0
        for n in self.sizes:
            self.starts.append(offset)
            offset += n
        self.total = offset
        self.ends = array("q")
        self.n_chunks = _ends(self.sizes, chunk_size, self.ends)
        #: Per chunk: (first byte, end byte) of the payload taken back to back.
        self.ranges: Sequence[tuple[int, int]] = _Ranges(self.ends)

    @staticmethod
    def count(sizes: Sequence[int], chunk_size: int) -> int:
        """The number of chunks the plan of ``sizes`` has, in O(len(sizes)) and without building it."""
        return _ends(sizes, chunk_size, None)

    def pieces(self, index: int) -> list[tuple[int, int, int]]:
        """(buffer index, start, end within that buffer) of the buffers chunk ``index`` covers."""
        lo, hi = self.ranges[index]
        i = bisect.bisect_right(self.starts, lo) - 1
        while i + 1 < len(self.starts) and self.starts[i + 1] <= lo and self.sizes[i] == 0:
            i += 1
        out = []
        pos = lo
        while pos < hi:
            base, n = self.starts[i], self.sizes[i]
            take = min(hi, base + n) - pos
            if take > 0:
                out.append((i, pos - base, pos - base + take))
                pos += take
            i += 1
        return out


def fit_chunk_size(sizes: Sequence[int], chunk_size: int, largest: int) -> int:
    """``chunk_size``, doubled (up to ``largest``) until the plan of ``sizes`` has at most `MAX_CHUNKS` chunks.

    The caller checks the result's count: a payload that needs more chunks even at ``largest``
    cannot be sent.
    """
    while ChunkPlan.count(sizes, chunk_size) > MAX_CHUNKS and chunk_size < largest:
        chunk_size = min(largest, chunk_size * 2)
    return chunk_size


def check_open_plan(open_msg: Open) -> ChunkPlan:
    """The chunk plan of a checked `Open` (`Open.check`), once it is known to be the one announced.

    The plan's size is computed first (O(number of buffers), nothing allocated) and compared with
    ``n_chunks`` (itself bounded by `MAX_CHUNKS`), so building the plan costs at most that; then,
    for a streamed payload, the digest list must have the announced root.

    Raises:
        WireFormatError: ``n_chunks`` is not the plan's, or the digests do not match their root.
    """
    n = ChunkPlan.count(open_msg.sizes, open_msg.chunk_size)
    if n != open_msg.n_chunks or n > MAX_CHUNKS:
        raise WireFormatError("open message", f"n_chunks {open_msg.n_chunks} does not match the chunk plan ({n})")
    plan = ChunkPlan(open_msg.sizes, open_msg.chunk_size)
    if not open_msg.inline and digests_root(open_msg.digests, open_msg.total) != open_msg.digest:
        raise WireFormatError("open message", "the chunk digests do not match the payload digest")
    return plan


class ChunkVerifier:
    """Checks each chunk of a streamed transfer against the digest its `Open` announced."""

    def __init__(self, plan: ChunkPlan, digests: bytes) -> None:
        self.plan = plan
        self.digests = digests

    def chunk_len(self, index: int) -> int:
        """The size chunk ``index`` must have."""
        lo, hi = self.plan.ranges[index]
        return hi - lo

    def check(self, index: int, data: bytes | memoryview) -> bool:
        """Whether ``data`` is exactly the sender's chunk ``index`` (size and digest)."""
        if len(data) != self.chunk_len(index):
            return False
        at = index * DIGEST_BYTES
        return chunk_digest_bytes(data) == self.digests[at : at + DIGEST_BYTES]


class ChunkSource:
    """The sender's view of its buffers through a `ChunkPlan`."""

    def __init__(self, buffers: list[memoryview], chunk_size: int) -> None:
        self.buffers = [b if b.format == "B" and b.ndim == 1 else b.cast("B") for b in buffers]
        self.plan = ChunkPlan([b.nbytes for b in self.buffers], chunk_size)
        self.total = self.plan.total
        self.n_chunks = self.plan.n_chunks
        self.chunk_size = chunk_size

    def chunk(self, index: int) -> memoryview | bytes:
        """The bytes of chunk ``index``: a view of one buffer, or small buffers joined."""
        pieces = [self.buffers[b][s:e] for b, s, e in self.plan.pieces(index)]
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def in_place(self, base: int) -> list[bool]:
        """Per buffer, whether it already lies at its payload offset from the address ``base``
        (an empty one does): where a payload built in a shared segment needs no copy."""
        return [not b.nbytes or address(b) == base + start for b, start in zip(self.buffers, self.plan.starts)]

    def digest(self, index: int) -> str:
        """`chunk_digest` of chunk ``index``, hashed piece by piece (nothing joined)."""
        h = xxhash.xxh3_64()
        for b, s, e in self.plan.pieces(index):
            h.update(self.buffers[b][s:e])
        return h.hexdigest()


def digest_chunks(chunks: Sequence[bytes | memoryview]) -> bytes:
    """Every chunk's digest back to back (`Open.digests`); xxh3 runs at several GB/s, and a sender
    of a large payload calls this off the event loop."""
    return b"".join(chunk_digest_bytes(c) for c in chunks)


def copy_and_digest(
    source: ChunkSource, dst: memoryview, indices: Sequence[int], in_place: Sequence[bool] = ()
) -> bytes:
    """Copy chunks ``indices`` of ``source`` to their payload offsets in ``dst`` and hash each
    where it landed, while it is still in cache; their digests back to back. Runs in a worker
    thread (numpy's copy and xxh3 release the GIL, so two halves run on two cores).
    ``in_place[b]``: buffer ``b`` already lies at its payload offset in ``dst`` (not copied)."""
    plan = source.plan
    out = []
    for index in indices:
        lo, hi = plan.ranges[index]
        pos = lo
        for b, s, e in plan.pieces(index):
            n = e - s
            if not (in_place and in_place[b]):
                np.copyto(np.frombuffer(dst, np.uint8, n, pos), np.frombuffer(source.buffers[b], np.uint8, n, s))
            pos += n
        out.append(chunk_digest_bytes(dst[lo:hi]))
    return b"".join(out)


async def stage(source: ChunkSource, dst: memoryview, *, workers: int = 2) -> bytes:
    """Copy the payload of ``source`` into ``dst`` (a shared segment, say) and hash its chunks
    there (`Open.digests`), in ``workers`` threads over contiguous runs of chunks: one pass over
    the bytes instead of a hash pass and then a copy. A buffer that already lies at its payload
    offset in ``dst`` (a cache built there, `Agent.kv_buffer`) is only hashed.

    Raises:
        ValueError: ``dst`` is smaller than the payload.
    """
    if dst.nbytes < source.total:
        raise ValueError(f"{dst.nbytes} bytes cannot hold a payload of {source.total}")
    n = source.n_chunks
    if not n:
        return b""
    per = -(-n // max(1, workers))
    runs = [range(lo, min(n, lo + per)) for lo in range(0, n, per)]
    in_place = source.in_place(address(dst))
    parts = await asyncio.gather(*(asyncio.to_thread(copy_and_digest, source, dst, run, in_place) for run in runs))
    return b"".join(parts)


class Reassembly:
    """Builds the receiver's buffers from verified chunks.

    A buffer that lies inside one chunk becomes a view of that chunk's bytes (no copy); a buffer
    split over several chunks is allocated once and the pieces are copied in as they arrive.
    """

    def __init__(self, sizes: Sequence[int], chunk_size: int, plan: ChunkPlan | None = None) -> None:
        self.plan = plan or ChunkPlan(sizes, chunk_size)
        self.buffers: list[memoryview | None] = [memoryview(b"") if n == 0 else None for n in self.plan.sizes]
        self._owners: list[object] = []

    def chunk_len(self, index: int) -> int:
        """The size chunk ``index`` must have."""
        lo, hi = self.plan.ranges[index]
        return hi - lo

    def add(self, index: int, data: bytes | memoryview) -> None:
        """Place the verified bytes of chunk ``index``."""
        view = memoryview(data)
        self._owners.append(data)
        offset = 0
        for b, start, end in self.plan.pieces(index):
            n = end - start
            if start == 0 and end == self.plan.sizes[b]:
                self.buffers[b] = view[offset : offset + n]
            else:
                target = self.buffers[b]
                if target is None:
                    target = self.buffers[b] = torch.empty(self.plan.sizes[b], dtype=torch.uint8).numpy().data
                target[start:end] = view[offset : offset + n]
            offset += n

    def result(self) -> list[memoryview]:
        """The rebuilt buffers (every one must have been filled)."""
        missing = [i for i, b in enumerate(self.buffers) if b is None]
        if missing:
            raise RuntimeError(f"buffers {missing[:8]} were never filled")
        return cast(list[memoryview], self.buffers)  # none is None: checked above


def split_inline(open_msg: Open, payload: memoryview, plan: ChunkPlan | None = None) -> tuple[list[memoryview], str]:
    """Buffers and recomputed tree digest of an inline payload."""
    plan = plan or ChunkPlan(open_msg.sizes, open_msg.chunk_size)
    digests = [chunk_digest(payload[lo:hi]) for lo, hi in plan.ranges]
    buffers = [payload[s : s + n] for s, n in zip(plan.starts, plan.sizes)]
    return buffers, tree_digest(digests, plan.total)
