"""`CacheTier`: an agent's KV memory, in blocks, with a compressed remote tier behind it.

A context's KV is held in blocks of ``block_tokens`` tokens keyed by the content hash of their
token prefix (`kvbus.cachetier.keys`). Each block is in one of two local states:

- resident: its KV tensors are in memory (it may also have a stub, when the remote tier holds
  the same payload: shedding it again then costs no write);
- remote: only its stub (key, codec, shape, dtype, checksum, size) and token ids are kept.

A block the tier knows nothing about (never stored, or dropped) is looked up in the remote tier
(another agent may have stored it: records are shared by key) and, failing that, recomputed
from its tokens by the model runner. A record that is missing, expired, corrupt or not the block
asked for is a miss, never wrong data.

When resident bytes would pass the high watermark, the least useful unpinned blocks are shed
until the low watermark: those with a stub lose their tensors, low-utility ones are dropped,
the rest are encoded (int8 by default: the policy chooses) and written in pipelined batches;
a block becomes a stub only once the server confirmed its write. If the remote tier fails, the
blocks still waiting are dropped: the budget holds, and they can be recomputed.

Concurrency: the tier's state is touched only on its event loop; encoding, decoding, checksums,
splitting and assembling run in worker threads. Loads of one block are single-flight: a second
`get` or prefetch of a block that is being loaded waits for the first instead of reading again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvbus.cachetier.blocks import Block, assemble, prefill_blocks, split_blocks
from kvbus.cachetier.config import CacheTierConfig
from kvbus.cachetier.errors import BlockUnavailable, ContextMismatch, RemoteUnavailable, TierClosed, UnsuitableCodec
from kvbus.cachetier.keys import BlockSpan, block_spans
from kvbus.cachetier.policy import Action, BlockInfo, ShedPolicy, UtilityPolicy
from kvbus.cachetier.record import Stub, build_record, open_record, parse_record, storage_codec
from kvbus.cachetier.remote import RemoteStore
from kvbus.cachetier.types import ShedReport, Status, TierListener, TierStats
from kvbus.codecs import Codec, ModelRunner
from kvbus.errors import KVBusError
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature, dtype_name

logger = logging.getLogger(__name__)

#: How often `get` retries blocks whose concurrent loader gave up before it raises.
LOAD_ATTEMPTS = 3


@dataclass(eq=False, slots=True)
class _Load:
    """A remote read of one block and what came of it."""

    span: BlockSpan
    record_key: str
    stub: Stub | None
    """The stub this tier kept (None: the block is unknown here, any valid record will do)."""
    size: int
    kv: KVCache | None = None
    record: Stub | None = None
    reason: str = ""


class CacheTier:
    """An agent's KV memory manager with a Redis-protocol remote tier.

    Create with ``await CacheTier.connect(redis_url, runner=runner)`` (or without a URL for a
    memory-only tier that drops what it sheds) and use as ``async with``. Hand it to
    ``bus.agent(..., cache=tier)``: probes report `memory_bytes` and `Agent.prefetch` calls
    `prefetch`.
    """

    def __init__(self, signature: ModelSignature | None = None, *, runner: ModelRunner | None = None,
                 remote: RemoteStore | None = None, config: CacheTierConfig | None = None,
                 policy: ShedPolicy | None = None, listener: TierListener | None = None,
                 clock: Callable[[], float] = time.monotonic, dtype: torch.dtype | None = None) -> None:
        """Build a tier on an already connected remote store (see `connect`).

        Args:
            signature: the model whose KV the tier holds (default: the runner's).
            runner: the model, to recompute blocks that are neither resident nor remote.
            remote: the remote tier; None keeps everything in memory and drops what it sheds.
            config: sizes, watermarks and remote settings (default: `CacheTierConfig.from_env`).
            policy: utility and shedding decisions (default: `UtilityPolicy` from the config).
            listener: hook called on offloads, fetches, misses, drops and recomputes.
            clock: monotonic seconds, for utility decay (tests pass a fake one).
            dtype: the KV dtype (default: the signature's).
        """
        if signature is None:
            signature = getattr(runner, "signature", None)
        if signature is None:
            raise ValueError("a cache tier needs the model signature (or a runner that has one)")
        self.signature = signature
        self.dtype = dtype or signature.torch_dtype
        dtype_name(self.dtype)
        self.runner = runner
        self.remote = remote
        self.config = config or CacheTierConfig.from_env()
        self.policy = policy or UtilityPolicy(codec=self.config.codec, half_life=self.config.half_life,
                                              drop_below=self.config.drop_below)
        self._codecs: dict[str, Codec] = {}
        # Fail now, not at the first offload, on a codec that cannot store blocks.
        self._codec(self.policy.codec_for(BlockInfo("0" * 32, 0, self.config.block_tokens, 0, 1.0)))
        self.listener = listener or TierListener()
        self.clock = clock
        self.stats = TierStats()
        self.status = Status.OPEN
        self._blocks: dict[str, Block] = {}
        self._memory = 0
        self._reserved = 0
        self._pins: collections.Counter[str] = collections.Counter()
        self._inflight: dict[str, asyncio.Future[None]] = {}
        self._shed_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()

    @classmethod
    async def connect(cls, redis_url: str | None, *, signature: ModelSignature | None = None,
                      runner: ModelRunner | None = None, config: CacheTierConfig | None = None,
                      policy: ShedPolicy | None = None, listener: TierListener | None = None,
                      clock: Callable[[], float] = time.monotonic, dtype: torch.dtype | None = None) -> CacheTier:
        """A tier whose remote tier is the Redis-protocol server at ``redis_url``.

        Args:
            redis_url: ``redis://[[user]:password@]host:port/db`` or ``rediss://`` (TLS); None
                for a memory-only tier.
            signature, runner, config, policy, listener, clock, dtype: as for the constructor.

        Raises:
            RemoteUnavailable: the server cannot be reached or refuses the credentials.
        """
        config = config or CacheTierConfig.from_env()
        remote = await RemoteStore.connect(redis_url, config) if redis_url else None
        try:
            return cls(signature, runner=runner, remote=remote, config=config, policy=policy, listener=listener,
                       clock=clock, dtype=dtype)
        except BaseException:
            if remote is not None:
                await remote.close()
            raise

    # -- state ----------------------------------------------------------------------------------

    @property
    def memory_bytes(self) -> int:
        """Bytes the tier holds in memory: resident KV and the token ids of every block."""
        return self._memory

    @property
    def budget_bytes(self) -> int:
        return self.config.budget_bytes

    def __len__(self) -> int:
        """Blocks the tier knows (resident or remote)."""
        return len(self._blocks)

    def resident_blocks(self) -> int:
        return sum(1 for b in self._blocks.values() if b.resident)

    def stubs(self) -> list[Stub]:
        """The stubs of blocks that are only remote."""
        return [b.stub for b in self._blocks.values() if b.stub is not None and not b.resident]

    def spans(self, context: KVCache | torch.Tensor) -> list[BlockSpan]:
        """The blocks (keys and token ranges) covering ``context``."""
        return self._spans(self._ids(context))

    def lookup(self, context: KVCache | torch.Tensor) -> int:
        """Tokens at the start of ``context`` whose blocks the tier holds, resident or remote (no I/O)."""
        held = 0
        for span in self.spans(context):
            if span.key not in self._blocks:
                break
            held = span.stop
        return held

    def _account(self, delta: int) -> None:
        self._memory += delta
        if self._memory > self.stats.peak_memory_bytes:
            self.stats.peak_memory_bytes = self._memory

    def _set_kv(self, block: Block, kv: KVCache | None) -> None:
        before = block.memory
        block.kv = kv
        self._account(block.memory - before)

    def _add(self, block: Block) -> None:
        self._blocks[block.key] = block
        self._account(block.memory)

    def _remove(self, block: Block) -> None:
        if self._blocks.get(block.key) is block:
            del self._blocks[block.key]
            self._account(-block.memory)

    def _check_open(self) -> None:
        if self.status is Status.CLOSED:
            raise TierClosed()

    # -- contexts -------------------------------------------------------------------------------

    def _ids(self, context: KVCache | torch.Tensor) -> torch.Tensor:
        tokens = context.tokens if isinstance(context, KVCache) else context
        if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point or tokens.dim() not in (1, 2):
            raise ContextMismatch("token ids (an integer tensor [n] or [batch, n])", f"{tokens!r:.80}")
        ids = tokens.to(torch.int64)
        return ids.unsqueeze(0) if ids.dim() == 1 else ids

    def _spans(self, ids: torch.Tensor, stop: int | None = None) -> list[BlockSpan]:
        return block_spans(ids, self.signature, self.dtype, self.config.block_tokens, stop=stop)

    def _check_kv(self, kv: KVCache) -> None:
        if not kv.signature.compatible_with(self.signature):
            raise ContextMismatch(f"KV of {self.signature.model} ({self.signature.digest()})",
                                  f"KV of {kv.signature.model} ({kv.signature.digest()})")
        if not kv.has_kv:
            raise ContextMismatch("a context with KV", "a token-only context")
        if kv.dtype != self.dtype:
            raise ContextMismatch(f"KV in {self.dtype}", f"KV in {kv.dtype}")
        if kv.positions is not None:
            raise ContextMismatch("KV at positions 0..n-1", "a sparsified cache (explicit positions)")
        try:
            kv.validate()
        except KVBusError as exc:
            raise ContextMismatch("a cache that fits its signature", str(exc)) from None

    def _touch(self, keys: Iterable[str]) -> None:
        now = self.clock()
        for key in keys:
            block = self._blocks.get(key)
            if block is not None:
                block.usage.touch(now, self.policy.half_life)

    def _codec(self, spec: str) -> Codec:
        """The storage codec a policy's spec names (cached; its ``name`` is the canonical spec).

        Raises:
            UnsuitableCodec: the spec is malformed or names a codec that cannot store blocks.
        """
        codec = self._codecs.get(spec)
        if codec is None:
            codec = self._codecs[spec] = storage_codec(spec)
        return codec

    def _estimate(self, span: BlockSpan, batch: int) -> int:
        block = self._blocks.get(span.key)
        if block is not None and block.stub is not None:
            return block.stub.nbytes
        per_token = 2 * self.signature.n_layers * self.signature.n_kv_heads * self.signature.head_dim
        return batch * span.n_tokens * (per_token * self.dtype.itemsize + 8)

    # -- public API -----------------------------------------------------------------------------

    async def put(self, kv: KVCache) -> list[str]:
        """Hold ``kv``'s KV (the prefix of tokens it covers), in blocks; the tier copies it.

        Blocks already held are shared, not stored twice. Sheds first if the new blocks would
        pass the high watermark.

        Returns:
            The keys of the blocks that cover ``kv``'s KV.

        Raises:
            ContextMismatch: ``kv`` is of another model or dtype, token-only, or sparsified.
        """
        self._check_open()
        self._check_kv(kv)
        ids = self._ids(kv)
        spans = self._spans(ids, stop=kv.seq_len)
        keys = [s.key for s in spans]
        self.stats.puts += 1
        new = [s for s in spans if not (s.key in self._blocks and self._blocks[s.key].resident)]
        self._pin(keys)
        try:
            incoming = sum(self._estimate(s, kv.batch) for s in new)
            await self._reserve(incoming)
            try:
                parts = await asyncio.to_thread(split_blocks, kv, ids, new) if new else []
                for span, part in zip(new, parts):
                    self._install(span, part)
            finally:
                self._reserved -= incoming
            self._touch(keys)
        finally:
            self._unpin(keys)
        await self._maybe_shed()
        return keys

    async def get(self, context: KVCache | torch.Tensor) -> KVCache:
        """The KV of every token of ``context`` (token ids, or a `KVCache` whose tokens count).

        Resident blocks are used as they are; stubs are fetched, verified and decoded; blocks
        neither resident nor remote (or whose record is gone) are recomputed by the runner.
        The result is a new cache (its tensors are copies).

        Raises:
            BlockUnavailable: blocks are missing and the tier has no runner to recompute them.
            ContextMismatch: the token ids are malformed.
        """
        self._check_open()
        ids = self._ids(context)
        spans = self._spans(ids)
        keys = [s.key for s in spans]
        self.stats.gets += 1
        self._pin(keys)
        try:
            waiting = [s for s in spans if not self._resident(s.key)]
            self.stats.hits += len(spans) - len(waiting)
            if waiting:
                t0 = time.perf_counter()
                try:
                    await self._ensure(waiting, ids)
                finally:
                    self.stats.stall_seconds += time.perf_counter() - t0
            self._check_open()
            self._touch(keys)
            parts = [self._blocks[k].kv for k in keys]
            kv = await asyncio.to_thread(assemble, parts, ids, self.signature, self.dtype)
        finally:
            self._unpin(keys)
        await self._maybe_shed()
        return kv

    def prefetch(self, context: KVCache | torch.Tensor) -> asyncio.Task[int]:
        """Workflow hint: ``context`` is needed soon; load its blocks in the background.

        Remote blocks are fetched and missing ones recomputed (when the tier has a runner), so
        that a later `get` finds them resident. Counts as an access of its blocks.

        Returns:
            The background task; its result is the number of blocks it loaded.
        """
        self._check_open()
        ids = self._ids(context)
        task = asyncio.get_running_loop().create_task(self._prefetch(ids), name="kvbus-cachetier-prefetch")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    async def load(self, context: KVCache | torch.Tensor) -> int:
        """Make every block of ``context`` resident (what `prefetch` runs); returns how many it loaded.

        Raises:
            BlockUnavailable: blocks are missing and the tier has no runner to recompute them.
        """
        self._check_open()
        return await self._prefetch(self._ids(context))

    async def shed(self, target_bytes: int | None = None) -> ShedReport:
        """Shed blocks until resident bytes are at most ``target_bytes`` (default: the low watermark).

        The group scheduler's memory hint lands here. Blocks in use by a running `get` stay.
        """
        self._check_open()
        limit = self.config.low_bytes if target_bytes is None else max(0, int(target_bytes))
        async with self._shed_lock:
            return await self._shed_locked(limit)

    def discard(self, context: KVCache | torch.Tensor) -> int:
        """Forget ``context``'s blocks here (remote records stay for other agents); returns how many."""
        n = 0
        for span in self.spans(context):
            block = self._blocks.get(span.key)
            if block is not None and not self._pins[span.key] and not block.busy:
                self._remove(block)
                n += 1
        return n

    async def close(self) -> None:
        """Stop background prefetches, release memory, close the remote connection."""
        if self.status is Status.CLOSED:
            return
        self.status = Status.CLOSED
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._blocks.clear()
        self._memory = 0
        if self.remote is not None:
            await self.remote.close()

    async def __aenter__(self) -> CacheTier:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __del__(self) -> None:
        if getattr(self, "status", Status.CLOSED) is not Status.CLOSED and getattr(self, "remote", None) is not None:
            warnings.warn("kvbus CacheTier was not closed", ResourceWarning, stacklevel=1)

    def __repr__(self) -> str:
        return (f"<CacheTier {self.signature.model} blocks={len(self._blocks)} "
                f"memory={self._memory}/{self.config.budget_bytes} remote={self.remote.url if self.remote else None}>")

    # -- pins, residency, background tasks ------------------------------------------------------

    def _pin(self, keys: Sequence[str]) -> None:
        self._pins.update(keys)

    def _unpin(self, keys: Sequence[str]) -> None:
        self._pins.subtract(keys)
        for key in keys:
            if self._pins.get(key, 0) <= 0:
                self._pins.pop(key, None)

    def _resident(self, key: str) -> bool:
        block = self._blocks.get(key)
        return block is not None and block.resident

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # logged where it happened; retrieved here so asyncio does not warn again

    async def _prefetch(self, ids: torch.Tensor) -> int:
        try:
            spans = self._spans(ids)
            keys = [s.key for s in spans]
            waiting = [s for s in spans if not self._resident(s.key)]
            self.stats.hits += len(spans) - len(waiting)
            self._pin(keys)
            try:
                if waiting:
                    await self._ensure(waiting, ids)
                self._touch(keys)
            finally:
                self._unpin(keys)
            if not waiting:
                return 0
            await self._maybe_shed()
            return len(waiting)
        except asyncio.CancelledError:
            raise
        except KVBusError as exc:
            logger.warning("prefetch of %d tokens failed: %s", ids.shape[-1], exc)
            raise
        except Exception:
            logger.exception("prefetch of %d tokens failed", ids.shape[-1])
            raise

    # -- loading --------------------------------------------------------------------------------

    async def _ensure(self, spans: list[BlockSpan], ids: torch.Tensor) -> None:
        """Make the blocks of ``spans`` resident (the caller has pinned them)."""
        for _ in range(LOAD_ATTEMPTS):
            waiting = [s for s in spans if not self._resident(s.key)]
            if not waiting:
                return
            await self._load(waiting, ids)
        waiting = [s.key for s in spans if not self._resident(s.key)]
        if waiting:
            raise BlockUnavailable(waiting, "their loads kept failing")

    async def _load(self, spans: list[BlockSpan], ids: torch.Tensor) -> None:
        """Load ``spans`` once each: blocks another task is loading are waited for, not read again."""
        loop = asyncio.get_running_loop()
        mine: list[BlockSpan] = []
        waits: list[asyncio.Future[None]] = []
        for span in spans:
            fut = self._inflight.get(span.key)
            if fut is None:
                self._inflight[span.key] = loop.create_future()
                mine.append(span)
            else:
                waits.append(fut)
        try:
            if mine:
                await self._fetch_or_recompute(mine, ids)
        finally:
            for span in mine:
                fut = self._inflight.pop(span.key)
                if not fut.done():
                    fut.set_result(None)
        if waits:
            await asyncio.wait(waits)  # not `await fut`: our cancellation must not cancel theirs

    async def _fetch_or_recompute(self, spans: list[BlockSpan], ids: torch.Tensor) -> None:
        incoming = sum(self._estimate(s, int(ids.shape[0])) for s in spans)
        await self._reserve(incoming)
        try:
            fetched = await self._fetch(spans, ids)
            rest = [s for s in spans if s.key not in fetched and not self._resident(s.key)]
            if rest:
                await self._recompute(rest, ids)
        finally:
            self._reserved -= incoming

    async def _fetch(self, spans: list[BlockSpan], ids: torch.Tensor) -> set[str]:
        """Read, verify and decode the remote records of ``spans``; returns the keys now resident."""
        if self.remote is None:
            return set()
        loads: list[_Load] = []
        for span in spans:
            block = self._blocks.get(span.key)
            if block is not None and block.resident:
                continue  # a concurrent put brought it back
            if block is not None and block.stub is not None:
                stub = block.stub
                loads.append(_Load(span, self.remote.record_key(stub.codec, span.key), stub, stub.size))
            elif block is None:
                size = self._estimate(span, int(ids.shape[0]))
                info = BlockInfo(span.key, span.start, span.n_tokens, size, 0.0)
                try:
                    codec = self._codec(self.policy.codec_for(info)).name
                except UnsuitableCodec as exc:
                    logger.warning("not looking for block %s remotely: %s", span.key[:16], exc)
                    continue
                loads.append(_Load(span, self.remote.record_key(codec, span.key), None, size))
        if not loads:
            return set()
        done: set[str] = set()
        pending: asyncio.Task[list[_Load]] | None = None
        try:
            for batch in _batches(loads, self.config.read_batch_bytes):
                try:
                    records = await self.remote.read([ld.record_key for ld in batch])
                except RemoteUnavailable as exc:
                    self.stats.remote_errors += 1
                    logger.warning("remote tier read failed, recomputing %d block(s): %s", len(batch), exc.reason)
                    break
                self.stats.remote_reads += len(batch)
                # Verify and decode this batch in a thread while the next one is read (one decode
                # at a time, as in `_ahead`).
                if pending is not None:
                    done |= self._install_loads(await pending)
                pending = asyncio.ensure_future(asyncio.to_thread(_open_batch, batch, records, ids, self.signature))
            if pending is not None:
                done |= self._install_loads(await pending)
                pending = None
        finally:
            if pending is not None:
                pending.cancel()
        return done

    def _install_loads(self, loads: list[_Load]) -> set[str]:
        ok: list[str] = []
        missed: list[str] = []
        for ld in loads:
            key = ld.span.key
            block = self._blocks.get(key)
            if ld.kv is not None and ld.record is not None:
                self.stats.bytes_read += ld.record.size
                if block is None:
                    block = Block(key=key, tokens=ld.kv.tokens, start=ld.span.start)
                    self._add(block)
                block.stub = ld.record
                if not block.resident:
                    self._set_kv(block, ld.kv)
                ok.append(key)
            else:
                if ld.stub is not None:
                    logger.info("block %s is gone from the remote tier (%s): recomputing", key[:16], ld.reason)
                if block is not None and not block.resident:
                    self._remove(block)
                elif block is not None:
                    block.stub = None
                missed.append(key)
        self.stats.fetched += len(ok)
        self.stats.misses += len(missed)
        if ok:
            self._notify("fetched", ok)
        if missed:
            self._notify("missed", missed)
        return set(ok)

    async def _recompute(self, spans: list[BlockSpan], ids: torch.Tensor) -> None:
        runner = self.runner
        if runner is None:
            raise BlockUnavailable([s.key for s in spans], "not in memory nor in the remote tier, and the tier "
                                                           "has no model runner to recompute them")
        stop = max(s.stop for s in spans)
        parts = await asyncio.to_thread(prefill_blocks, runner, ids, stop, spans)
        for span, part in zip(spans, parts):
            self._check_recomputed(part)
            self._install(span, part)
        self.stats.recomputed += len(spans)
        self.stats.recompute_tokens += stop
        self._notify("recomputed", [s.key for s in spans])

    def _check_recomputed(self, kv: KVCache) -> None:
        if not kv.signature.compatible_with(self.signature) or kv.dtype != self.dtype:
            raise ContextMismatch(f"the runner to compute KV of {self.signature.model} in {self.dtype}",
                                  f"KV of {kv.signature.model} in {kv.dtype}")

    def _install(self, span: BlockSpan, kv: KVCache) -> None:
        block = self._blocks.get(span.key)
        if block is None:
            self._add(Block(key=span.key, tokens=kv.tokens, kv=kv, start=span.start))
        elif not block.resident:
            self._set_kv(block, kv)

    # -- shedding -------------------------------------------------------------------------------

    async def _reserve(self, incoming: int) -> None:
        """Make room for ``incoming`` bytes about to become resident, and count them as reserved."""
        async with self._shed_lock:
            if self._memory + self._reserved + incoming > self.config.high_bytes:
                await self._shed_locked(max(0, self.config.low_bytes - incoming))
            self._reserved += incoming

    async def _maybe_shed(self) -> None:
        if self.status is Status.OPEN and self._memory + self._reserved > self.config.high_bytes:
            async with self._shed_lock:
                if self._memory + self._reserved > self.config.high_bytes:
                    await self._shed_locked(self.config.low_bytes)

    async def _shed_locked(self, limit: int) -> ShedReport:
        excess = self._memory + self._reserved - limit
        if excess <= 0:
            return ShedReport(memory_bytes=self._memory)
        now = self.clock()
        infos: list[tuple[BlockInfo, Block]] = []
        for block in self._blocks.values():
            if block.resident and not block.busy and not self._pins[block.key]:
                info = BlockInfo(block.key, block.start, block.n_tokens, block.memory,
                                 self.policy.utility(block.usage, now))
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
        before = self._memory
        released = [b for _, b in victims if b.stub is not None]
        drop = [b for i, b in victims if b.stub is None and self.policy.action(i) is Action.DROP]
        offload = [(i, b) for i, b in victims if b.stub is None and self.policy.action(i) is Action.OFFLOAD]
        # Free what needs no I/O before the first await: a `get` that starts meanwhile must not
        # pin a block that is about to disappear under it.
        for block in released:
            self._set_kv(block, None)
        self._drop(drop)
        written, adopted, nbytes, failed = await self._offload(offload)
        self._drop(failed)
        self.stats.released += len(released)
        return ShedReport(dropped=len(drop) + len(failed), offloaded=written, adopted=adopted,
                          released=len(released), bytes_freed=before - self._memory, bytes_written=nbytes,
                          memory_bytes=self._memory)

    def _drop(self, blocks: list[Block]) -> None:
        for block in blocks:
            self._remove(block)
        self.stats.dropped += len(blocks)
        if blocks:
            self._notify("dropped", [b.key for b in blocks])

    async def _offload(self, victims: list[tuple[BlockInfo, Block]]) -> tuple[int, int, int, list[Block]]:
        """Write ``victims`` to the remote tier; returns (written, adopted, bytes, blocks that failed)."""
        if not victims:
            return 0, 0, 0, []
        if self.remote is None:
            return 0, 0, 0, [b for _, b in victims]
        remote = self.remote
        for _, block in victims:
            block.busy = True
        todo: list[tuple[Block, Codec]] = []
        for info, block in victims:
            try:
                todo.append((block, self._codec(self.policy.codec_for(info))))
            except UnsuitableCodec as exc:
                logger.warning("dropping block %s instead of offloading it: %s", block.key[:16], exc)
        written = adopted = nbytes = 0
        try:
            # Deduplication: a record another tier (or an earlier life of this one) wrote is adopted.
            rkeys = [remote.record_key(codec.name, b.key) for b, codec in todo]
            metas = await remote.metas(rkeys)
            rest: list[tuple[Block, Codec]] = []
            adopted_keys: list[str] = []
            for (block, codec), rk, raw in zip(todo, rkeys, metas):
                stub = _adoptable(raw, block, codec.name)
                if stub is None:
                    rest.append((block, codec))
                else:
                    self._to_stub(block, stub)
                    adopted_keys.append(rk)
            adopted = len(adopted_keys)
            self.stats.adopted += adopted
            if adopted_keys:
                await remote.touch(adopted_keys)
            todo = rest
            batches = _batches([(b, c.name, c.estimate_nbytes(self.signature, b.n_tokens, b.tokens.shape[0]))
                                for b, c in todo], self.config.write_batch_bytes, size=lambda t: t[2])
            # The next batch is encoded in a thread while this one is written.
            async with contextlib.aclosing(_ahead(_encode_batch, batches)) as encoded_batches:
                async for encoded in encoded_batches:
                    records = [(remote.record_key(stub.codec, stub.key), fields) for _, stub, fields in encoded]
                    confirmed = await remote.write(records)
                    keys = []
                    for (block, stub, _), ok in zip(encoded, confirmed):
                        if ok:
                            self._to_stub(block, stub)
                            keys.append(block.key)
                            written += 1
                            nbytes += stub.size
                            self.stats.offloaded += 1
                            self.stats.bytes_written += stub.size
                    if keys:
                        self._notify("offloaded", keys)
        except RemoteUnavailable as exc:
            self.stats.remote_errors += 1
            logger.warning("remote tier write failed; dropping blocks that were not written: %s", exc.reason)
        finally:
            for _, block in victims:
                block.busy = False
        failed = [b for _, b in victims if b.stub is None and b.resident and self._blocks.get(b.key) is b
                  and not self._pins[b.key]]
        return written, adopted, nbytes, failed

    def _to_stub(self, block: Block, stub: Stub) -> None:
        """``block`` now has a confirmed remote record: keep the stub, free the tensors (unless in use)."""
        block.stub = stub
        if not self._pins[block.key]:
            self._set_kv(block, None)

    def _notify(self, event: str, keys: list[str]) -> None:
        try:
            getattr(self.listener, event)(keys)
        except Exception:
            logger.exception("cache tier listener failed on %s", event)


# -- work done in threads ------------------------------------------------------------------------


async def _ahead(fn: Callable[[Any], Any], items: list[Any]) -> AsyncIterator[Any]:
    """``fn(item)`` for each item in order, each computed in a worker thread while the caller
    handles the previous result (one at a time: torch already spreads one call over the cores)."""
    if not items:
        return
    nxt = asyncio.ensure_future(asyncio.to_thread(fn, items[0]))
    try:
        for i in range(len(items)):
            result = await nxt
            if i + 1 < len(items):
                nxt = asyncio.ensure_future(asyncio.to_thread(fn, items[i + 1]))
            yield result
    finally:
        nxt.cancel()


def _batches(items: list[Any], limit: int, *, size: Callable[[Any], int] = lambda ld: ld.size) -> list[list[Any]]:
    """``items`` in order, in batches of at most ``limit`` bytes (a bigger item is a batch alone)."""
    out: list[list[Any]] = []
    current: list[Any] = []
    total = 0
    for item in items:
        n = size(item)
        if current and total + n > limit:
            out.append(current)
            current, total = [], 0
        current.append(item)
        total += n
    if current:
        out.append(current)
    return out


def _encode_batch(batch: list[tuple[Block, str, int]]) -> list[tuple[Block, Stub, dict[bytes, Any]]]:
    out = []
    for block, codec, _ in batch:
        kv = block.kv
        if kv is None:  # cannot happen: busy blocks keep their tensors until written
            continue
        try:
            stub, fields, _encoded = build_record(block.key, kv, codec)
        except Exception:  # the block is dropped instead (it can be recomputed); a bug, so say it loudly
            logger.exception("encoding block %s with %s failed", block.key[:16], codec)
            continue
        out.append((block, stub, fields))
    return out


def _open_batch(batch: list[_Load], records: list[dict[bytes, bytes]], ids: torch.Tensor,
                signature: ModelSignature) -> list[_Load]:
    for ld, fields in zip(batch, records):
        if not fields:
            ld.reason = "no record"
            continue
        try:
            record, encoded = parse_record(fields, ld.span.key, ld.stub)
            tokens = ids[:, ld.span.start:ld.span.stop]
            ld.kv = open_record(record, encoded, tokens, signature)
            ld.record = record
        except KVBusError as exc:
            ld.reason = str(exc)
            logger.warning("remote record of block %s is unusable: %s", ld.span.key[:16], exc)
        except Exception as exc:  # a codec bug must cost a recompute, not wrong data
            ld.reason = f"{type(exc).__name__}: {exc}"
            logger.exception("decoding the remote record of block %s failed", ld.span.key[:16])
    return batch


def _adoptable(raw: bytes | None, block: Block, codec: str) -> Stub | None:
    """The stub of an existing record that holds ``block`` with ``codec``, else None."""
    if raw is None:
        return None
    try:
        stub = Stub.from_bytes(raw)
    except KVBusError:
        return None  # a damaged record is overwritten by ours
    kv = block.kv
    if (stub.key != block.key or stub.codec != codec or kv is None or stub.dtype != dtype_name(kv.dtype)
            or stub.shape != tuple(kv.keys[0].shape) or stub.nbytes != kv.nbytes):
        return None
    return stub
