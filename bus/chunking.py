"""How a payload is cut into chunks and put back together, and the digests that check it.

Both sides compute the same `ChunkPlan` from the buffer sizes in the `Open`: the sender reads
chunks through a `ChunkSource`, the receiver rebuilds the buffers with a `Reassembly`. Each
chunk has an xxh3-64 digest (`chunk_digest`); the whole payload's digest (`tree_digest`) is an
xxh3-128 hash over the chunk digests.
"""

from __future__ import annotations

import bisect
from typing import cast

import torch
import xxhash

from kvbus.protocol import Open

#: Buffers below ``chunk_size // PACK_DIVISOR`` are packed together into one chunk; larger
#: ones get chunks of their own (no copy on either side), split when above ``chunk_size``.
PACK_DIVISOR = 16


def chunk_digest(data: bytes | memoryview) -> str:
    """The xxh3-64 digest of one chunk, as carried in its header."""
    return xxhash.xxh3_64_hexdigest(data)


def tree_digest(chunk_digests: list[str], total: int) -> str:
    """The whole-payload digest: xxh3-128 over the chunks' digests and the total size.

    Every chunk is verified against its own digest on arrival, so hashing the digests (a
    one-level hash tree) checks the whole payload without a second pass over its bytes.
    """
    h = xxhash.xxh3_128(str(total).encode())
    for d in chunk_digests:
        h.update(d.encode())
    return h.hexdigest()


class ChunkPlan:
    """Deterministic split of a list of buffer sizes into chunks, computed alike on both sides.

    A chunk is either a slice of one buffer or several whole small buffers back to back, so a
    buffer that fits in a chunk never straddles two: the sender publishes views without joining
    and the receiver builds tensors over the chunk it received without copying.
    """

    def __init__(self, sizes: list[int], chunk_size: int) -> None:
        self.sizes = list(sizes)
        self.chunk_size = chunk_size
        self.total = sum(sizes)
        self.starts: list[int] = []
        offset = 0
        for n in sizes:
            self.starts.append(offset)
            offset += n
        small = max(1, chunk_size // PACK_DIVISOR)
        #: Per chunk: (first byte, end byte) of the payload taken back to back.
        self.ranges: list[tuple[int, int]] = []
        run_start = run_end = -1
        for start, n in zip(self.starts, self.sizes):
            if n == 0:
                continue
            if n < small and run_start >= 0 and run_end - run_start + n <= chunk_size:
                run_end += n
                continue
            if run_start >= 0:
                self.ranges.append((run_start, run_end))
                run_start = -1
            if n < small:
                run_start, run_end = start, start + n
                continue
            for off in range(0, n, chunk_size):
                self.ranges.append((start + off, start + min(off + chunk_size, n)))
        if run_start >= 0:
            self.ranges.append((run_start, run_end))
        self.n_chunks = len(self.ranges)

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


class Reassembly:
    """Builds the receiver's buffers from verified chunks.

    A buffer that lies inside one chunk becomes a view of that chunk's bytes (no copy); a buffer
    split over several chunks is allocated once and the pieces are copied in as they arrive.
    """

    def __init__(self, sizes: list[int], chunk_size: int) -> None:
        self.plan = ChunkPlan(sizes, chunk_size)
        self.buffers: list[memoryview | None] = [memoryview(b"") if n == 0 else None for n in sizes]
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


def split_inline(open_msg: Open, payload: memoryview) -> tuple[list[memoryview], str]:
    """Buffers and recomputed tree digest of an inline payload."""
    plan = ChunkPlan(open_msg.sizes, open_msg.chunk_size)
    digests = [chunk_digest(payload[lo:hi]) for lo, hi in plan.ranges]
    buffers = [payload[s : s + n] for s, n in zip(plan.starts, plan.sizes)]
    return buffers, tree_digest(digests, plan.total)
