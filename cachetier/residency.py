"""`Residency`: the tier's blocks in memory, what they cost, and which of them to shed.

It keeps the block table (resident blocks and stubs), the resident byte count against the
watermarks, the pins of blocks in use, and each block's decayed utility. Past the high watermark
it sheds the least useful unpinned blocks down to the low watermark: a block with a stub only
loses its tensors, the policy drops low-utility ones and hands the rest to the `Offloader`;
whatever the offloader could not write is dropped too (the budget holds, and dropped blocks can
be recomputed).

Everything here runs on the tier's event loop.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from kvbus.cachetier.blocks import Block, split_blocks
from kvbus.cachetier.config import CacheTierConfig
from kvbus.cachetier.keys import BlockSpan, block_spans
from kvbus.cachetier.policy import Action, BlockInfo, ShedPolicy
from kvbus.cachetier.record import Stub
from kvbus.cachetier.types import ShedReport, Status, TierStats
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

if TYPE_CHECKING:
    from kvbus.cachetier.offload import Offloader

#: Called with an event name of `TierListener` and the keys it concerns.
Notify = Callable[[str, list[str]], None]


class Residency:
    """The block table of one tier, its memory accounting and its shedding.

    ``memory`` counts resident KV and the token ids of every block; ``reserved`` counts bytes
    about to become resident (a load or a put in progress), so that concurrent loads do not
    overshoot the budget together.
    """

    def __init__(
        self,
        signature: ModelSignature,
        dtype: torch.dtype,
        config: CacheTierConfig,
        policy: ShedPolicy,
        stats: TierStats,
        *,
        clock: Callable[[], float],
        offloader: Offloader,
        notify: Notify,
    ) -> None:
        """Args:
        signature, dtype: the model and KV dtype of the blocks (for size estimates).
        config: the budget and watermarks.
        policy: utilities and what shedding does with each block.
        stats: the tier's counters (shared with its loader and offloader).
        clock: monotonic seconds, for utility decay.
        offloader: writes shed blocks to the remote tier.
        notify: the tier's listener hook.
        """
        self.signature = signature
        self.dtype = dtype
        self.config = config
        self.policy = policy
        self.stats = stats
        self.clock = clock
        self.offloader = offloader
        self.notify = notify
        self.status = Status.OPEN
        self.blocks: dict[str, Block] = {}
        self.memory = 0
        self.reserved = 0
        self.pins: collections.Counter[str] = collections.Counter()
        self._shed_lock = asyncio.Lock()

    # -- the block table ------------------------------------------------------------------------

    def resident(self, key: str) -> bool:
        """Whether the block ``key`` is known and has its KV in memory."""
        block = self.blocks.get(key)
        return block is not None and block.resident

    def account(self, delta: int) -> None:
        """Add ``delta`` bytes (negative frees) to the resident count and track the peak."""
        self.memory += delta
        if self.memory > self.stats.peak_memory_bytes:
            self.stats.peak_memory_bytes = self.memory

    def set_kv(self, block: Block, kv: KVCache | None) -> None:
        """Give ``block`` its KV (None frees it), keeping the byte count right."""
        before = block.memory
        block.kv = kv
        self.account(block.memory - before)

    def add(self, block: Block) -> None:
        """Put ``block`` in the table and count its bytes."""
        self.blocks[block.key] = block
        self.account(block.memory)

    def remove(self, block: Block) -> None:
        """Take ``block`` out of the table and uncount its bytes (if it is still the one under its key)."""
        if self.blocks.get(block.key) is block:
            del self.blocks[block.key]
            self.account(-block.memory)

    def install(self, span: BlockSpan, kv: KVCache) -> None:
        """Make ``kv`` the resident KV of ``span``'s block (a new block, or one that was only a stub)."""
        block = self.blocks.get(span.key)
        if block is None:
            self.add(Block(key=span.key, tokens=kv.tokens, kv=kv, start=span.start))
        elif not block.resident:
            self.set_kv(block, kv)

    def to_stub(self, block: Block, stub: Stub) -> None:
        """``block`` now has a confirmed remote record: keep the stub, free the tensors (unless in use)."""
        block.stub = stub
        if not self.pins[block.key]:
            self.set_kv(block, None)

    def touch(self, keys: Iterable[str]) -> None:
        """Record an access to the known blocks among ``keys`` (for their decayed utility)."""
        now = self.clock()
        for key in keys:
            block = self.blocks.get(key)
            if block is not None:
                block.usage.touch(now, self.policy.half_life)

    def pin(self, keys: Sequence[str]) -> None:
        """Mark ``keys`` as in use: shedding leaves them alone until `unpin` (pins count)."""
        self.pins.update(keys)

    def unpin(self, keys: Sequence[str]) -> None:
        """Undo one `pin` of ``keys``; a key at zero pins is forgotten."""
        self.pins.subtract(keys)
        for key in keys:
            if self.pins.get(key, 0) <= 0:
                self.pins.pop(key, None)

    def spans(self, ids: torch.Tensor, stop: int | None = None, salt: str = "") -> list[BlockSpan]:
        """The blocks covering token ids ``ids`` ``[batch, n]`` (their first ``stop`` tokens) of ``salt``."""
        return block_spans(ids, self.signature, self.dtype, self.config.block_tokens, stop=stop, salt=salt)

    def estimate(self, span: BlockSpan, batch: int) -> int:
        """Resident bytes ``span``'s block will take (its stub's figure when there is one)."""
        block = self.blocks.get(span.key)
        if block is not None and block.stub is not None:
            return block.stub.nbytes
        per_token = 2 * self.signature.n_layers * self.signature.n_kv_heads * self.signature.head_dim
        return batch * span.n_tokens * (per_token * self.dtype.itemsize + 8)

    def discard(self, spans: Iterable[BlockSpan]) -> int:
        """Forget the blocks of ``spans`` that are not in use; returns how many."""
        n = 0
        for span in spans:
            block = self.blocks.get(span.key)
            if block is not None and not self.pins[span.key] and not block.busy:
                self.remove(block)
                n += 1
        return n

    def clear(self) -> None:
        """Forget every block (resident or stub) and zero the resident byte count."""
        self.blocks.clear()
        self.memory = 0

    # -- storing --------------------------------------------------------------------------------

    async def store(self, kv: KVCache, ids: torch.Tensor, spans: list[BlockSpan]) -> None:
        """Hold copies of ``kv``'s blocks ``spans`` (blocks already resident are shared), then shed if due."""
        keys = [s.key for s in spans]
        new = [s for s in spans if not (s.key in self.blocks and self.blocks[s.key].resident)]
        self.pin(keys)
        try:
            incoming = sum(self.estimate(s, kv.batch) for s in new)
            await self.reserve(incoming)
            try:
                parts = await asyncio.to_thread(split_blocks, kv, ids, new) if new else []
                for span, part in zip(new, parts):
                    self.install(span, part)
            finally:
                self.reserved -= incoming
            self.touch(keys)
        finally:
            self.unpin(keys)
        await self.maybe_shed()

    # -- shedding -------------------------------------------------------------------------------

    async def reserve(self, incoming: int) -> None:
        """Make room for ``incoming`` bytes about to become resident, and count them as reserved.

        The caller subtracts them from `reserved` once they are resident (or not coming).
        """
        async with self._shed_lock:
            if self.memory + self.reserved + incoming > self.config.high_bytes:
                await self._shed_locked(max(0, self.config.low_bytes - incoming))
            self.reserved += incoming

    async def maybe_shed(self) -> None:
        """Shed to the low watermark if resident bytes are past the high one (and the tier is open)."""
        if self.status is Status.OPEN and self.memory + self.reserved > self.config.high_bytes:
            async with self._shed_lock:
                if self.memory + self.reserved > self.config.high_bytes:
                    await self._shed_locked(self.config.low_bytes)

    async def shed(self, limit: int) -> ShedReport:
        """Shed until resident (and reserved) bytes are at most ``limit``."""
        async with self._shed_lock:
            return await self._shed_locked(limit)

    async def _shed_locked(self, limit: int) -> ShedReport:
        excess = self.memory + self.reserved - limit
        if excess <= 0:
            return ShedReport(memory_bytes=self.memory)
        now = self.clock()
        infos: list[tuple[BlockInfo, Block]] = []
        for block in self.blocks.values():
            if block.resident and not block.busy and not self.pins[block.key]:
                info = BlockInfo(
                    block.key, block.start, block.n_tokens, block.memory, self.policy.utility(block.usage, now)
                )
                infos.append((info, block))
        # Least useful first; among equals, later blocks first (earlier ones are shared by more contexts).
        infos.sort(key=lambda ib: (ib[0].utility, -ib[0].start))
        victims: list[tuple[BlockInfo, Block]] = []
        freed = 0
        for info, block in infos:
            if freed >= excess:
                break
            victims.append((info, block))
            freed += block.memory - block.tokens.numel() * block.tokens.element_size()
        before = self.memory
        released = [b for _, b in victims if b.stub is not None]
        drop = [b for i, b in victims if b.stub is None and self.policy.action(i) is Action.DROP]
        offload = [(i, b) for i, b in victims if b.stub is None and self.policy.action(i) is Action.OFFLOAD]
        # Free what needs no I/O before the first await: a `get` that starts meanwhile must not
        # pin a block that is about to disappear under it.
        for block in released:
            self.set_kv(block, None)
        self.drop(drop)
        done = await self.offloader.offload(offload, self)
        self.drop(done.failed)
        self.stats.released += len(released)
        return ShedReport(
            dropped=len(drop) + len(done.failed),
            offloaded=done.written,
            adopted=done.adopted,
            released=len(released),
            bytes_freed=before - self.memory,
            bytes_written=done.nbytes,
            memory_bytes=self.memory,
        )

    def drop(self, blocks: list[Block]) -> None:
        """Remove ``blocks`` without a remote copy, count them and tell the listener (``dropped``)."""
        for block in blocks:
            self.remove(block)
        self.stats.dropped += len(blocks)
        if blocks:
            self.notify("dropped", [b.key for b in blocks])
