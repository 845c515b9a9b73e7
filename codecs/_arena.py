"""Output arenas: one allocation for every layer's output of an encode or decode, reused once released.

A decoded Llama-3-8B-shaped cache of 512 tokens is 64 fresh tensors of 1 MB; an int8 encode
makes 64 fresh code tensors. Allocating them costs more than computing them: freed memory goes
back to the kernel (glibc trims or unmaps it), and the next call faults every page in again
(14-17 ms for 64 MB on the 2-core development machine, against 3 ms for a ``copy_`` of it into
pages already faulted; int8 decode into preallocated outputs ran at 0.47-0.5x copy, allocating
them at 0.08x). An `Arena` is one block for all of a call's outputs, carved into aligned views;
an arena whose every view (and every tensor, storage or memoryview derived from one) is gone
goes back to a bounded `ArenaPool`, and the next call of that size reuses its pages.

Lifetime: the block is a numpy array held by the pool. Each checkout is a *fresh* numpy view of
it (the lease), and the arena's tensor is ``torch.from_numpy(lease)``: every tensor viewing the
arena shares that tensor's storage, and the storage holds the lease until its last user is
freed. A `weakref.finalize` on the lease returns the block to the pool only then, so memory a
caller still references is never handed out again (tests/test_codecs_arena.py holds results
while others are made). Only the lease is ever released: the finalizer's callback appends to a
deque (atomic, safe from any thread and from inside a garbage collection), and the pool takes
released blocks back on its next checkout.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch

#: Every view of an arena starts at a multiple of this many bytes (a cache line; every dtype's
#: alignment divides it).
ALIGN = 64
#: Environment variable: the most bytes of released arenas the shared pool keeps (in MiB).
POOL_ENV = "KVBUS_ARENA_POOL_MB"
#: Default of `POOL_ENV`: 1 GiB, two Llama-3-8B caches of 4096 tokens in bf16.
DEFAULT_POOL_BYTES = 1 << 30
#: Blocks are sized in steps of this many bytes (a pooled block then fits calls of nearby sizes).
_GRAIN = 1 << 16


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _aligned_empty(nbytes: int) -> np.ndarray:
    """``nbytes`` uninitialised bytes starting at a multiple of `ALIGN` (numpy itself only promises 16)."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip : skip + nbytes]  # a view: its base keeps ``raw`` alive


class ArenaPool:
    """Released arena blocks, kept for reuse up to ``max_bytes`` in all (least recently released dropped first).

    Thread-safe. A block is reused for a request of ``n`` bytes when it holds at least ``n`` and
    at most ``n + n // 8 + 64 KiB`` bytes (a much larger block would pin its excess).
    """

    def __init__(self, max_bytes: int = DEFAULT_POOL_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._free: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._free_bytes = 0
        self._released: collections.deque[np.ndarray] = collections.deque()
        self.allocated = 0
        """Blocks allocated fresh (for tests and the bench: reuse shows as this not growing)."""
        self.reused = 0
        """Checkouts served from a released block."""

    @property
    def free_bytes(self) -> int:
        """Bytes of released blocks the pool holds now (after taking back what was released)."""
        with self._lock:
            self._take_back()
            return self._free_bytes

    def _release(self, block: np.ndarray) -> None:
        # weakref.finalize callback: may run in any thread, inside a GC, while _lock is held.
        self._released.append(block)

    def _take_back(self) -> None:
        """Move released blocks into the free list (with ``_lock`` held), then trim it to ``max_bytes``."""
        while self._released:
            block = self._released.popleft()
            if block.nbytes > self.max_bytes:
                continue
            self._free[id(block)] = block
            self._free_bytes += block.nbytes
        while self._free_bytes > self.max_bytes:
            _, old = self._free.popitem(last=False)
            self._free_bytes -= old.nbytes

    def clear(self) -> None:
        """Drop every released block (their memory goes back to the allocator)."""
        with self._lock:
            self._take_back()
            self._free.clear()
            self._free_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` bytes (contents undefined) that comes back to the pool when unreferenced."""
        block: np.ndarray | None = None
        with self._lock:
            self._take_back()
            limit = nbytes + nbytes // 8 + _GRAIN
            best = None
            for key, candidate in self._free.items():
                if nbytes <= candidate.nbytes <= limit and (best is None or candidate.nbytes < self._free[best].nbytes):
                    best = key
            if best is not None:
                block = self._free.pop(best)
                self._free_bytes -= block.nbytes
                self.reused += 1
            else:
                self.allocated += 1
        if block is None:
            block = _aligned_empty(max(_GRAIN, _round_up(nbytes, _GRAIN)))
        lease = block[:nbytes]  # a new array object whose base is the block
        weakref.finalize(lease, self._release, block)
        return torch.from_numpy(lease)  # its storage holds the lease until the last view is freed


def _pool_bytes_from_env() -> int:
    raw = os.environ.get(POOL_ENV, "").strip()
    if not raw:
        return DEFAULT_POOL_BYTES
    try:
        mib = float(raw)
    except ValueError:
        raise ValueError(f"{POOL_ENV} must be a number of MiB, got {raw!r}") from None
    if not math.isfinite(mib) or mib < 0:
        raise ValueError(f"{POOL_ENV} must be a non-negative number of MiB, got {raw!r}")
    return int(mib * (1 << 20))


_shared: list[ArenaPool] = []
_shared_lock = threading.Lock()


def shared_pool() -> ArenaPool:
    """The process's pool (its size from `POOL_ENV`, read at first use; ``0`` disables reuse)."""
    if not _shared:
        with _shared_lock:
            if not _shared:
                _shared.append(ArenaPool(_pool_bytes_from_env()))
    return _shared[0]


def carve(specs: Sequence[tuple[torch.dtype, tuple[int, ...]]], pool: ArenaPool | None = None) -> list[torch.Tensor]:
    """Contiguous tensors of the given dtypes and shapes, all views of one arena (contents undefined).

    Each starts at a multiple of `ALIGN` bytes. The arena goes back to ``pool`` (default:
    `shared_pool`) once none of them, nor anything viewing them, is referenced.
    """
    return carve_arena(specs, pool)[0]


def carve_arena(
    specs: Sequence[tuple[torch.dtype, tuple[int, ...]]], pool: ArenaPool | None = None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`carve`, and the arena itself (a uint8 tensor the views lie in, in the order of ``specs``)."""
    offsets: list[int] = []
    end = 0
    for dtype, shape in specs:
        offsets.append(end)
        end = _round_up(end + math.prod(shape) * dtype.itemsize, ALIGN)
    arena = (pool or shared_pool()).take(end)
    out: list[torch.Tensor | None] = [None] * len(specs)
    # The views of one dtype and shape whose offsets step evenly (every layer's buffer of a
    # layout) come from one strided view, unbound: three ops, where a view each costs three
    # ops per view (0.8 ms for the 128 of a 32-layer int8 encode).
    groups: dict[tuple[torch.dtype, tuple[int, ...]], list[int]] = {}
    for i, (dtype, shape) in enumerate(specs):
        groups.setdefault((dtype, tuple(shape)), []).append(i)
    for (dtype, shape), members in groups.items():
        size = dtype.itemsize
        n = math.prod(shape)
        starts = [offsets[i] for i in members]
        step = starts[1] - starts[0] if len(starts) > 1 else 0
        even = len(starts) > 2 and n and step % size == 0 and all(b - a == step for a, b in itertools.pairwise(starts))
        if even:
            flat = arena[starts[0] : starts[-1] + n * size].view(dtype)
            inner = [1] * len(shape)
            for k in range(len(shape) - 2, -1, -1):
                inner[k] = inner[k + 1] * shape[k + 1]
            views = flat.as_strided((len(members), *shape), (step // size, *inner)).unbind(0)
            for i, view in zip(members, views):
                out[i] = view
        else:
            for i in members:
                out[i] = arena[offsets[i] : offsets[i] + n * size].view(dtype).view(shape)
    return out, arena  # type: ignore[return-value]  # every entry is set
