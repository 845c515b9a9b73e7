"""`Loader`: makes blocks resident when they are asked for, or ahead of time on a workflow hint.

A block that is not resident is read from the remote tier (by its stub, or, for a block this
tier does not know, by the record key its policy's codec gives: another agent may have stored
it), verified against the stub it was written with and decoded; what is missing, expired,
corrupt or not the block asked for is a miss, and misses are recomputed from their tokens by the
model runner. Reads go in pipelined batches, each verified and decoded in a worker thread while
the next is read. Loads of one block are single-flight: a second `get` or prefetch of a block
that is being loaded waits for the first instead of reading again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvbus.cachetier.blocks import Block, assemble, prefill_blocks
from kvbus.cachetier.config import CacheTierConfig
from kvbus.cachetier.errors import BlockUnavailable, ContextMismatch, RemoteUnavailable, TierClosed, UnsuitableCodec
from kvbus.cachetier.keys import BlockSpan
from kvbus.cachetier.policy import BlockInfo
from kvbus.cachetier.record import Stub, open_record, parse_record
from kvbus.cachetier.remote import RemoteStore, batches
from kvbus.cachetier.residency import Notify, Residency
from kvbus.cachetier.types import Status, TierStats
from kvbus.codecs import Codec, ModelRunner
from kvbus.errors import KVBusError
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

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


class Loader:
    """Fetches, verifies and recomputes the blocks of one tier's `Residency`."""

    def __init__(
        self,
        table: Residency,
        remote: RemoteStore | None,
        runner: ModelRunner | None,
        config: CacheTierConfig,
        stats: TierStats,
        *,
        codec_for: Callable[[BlockInfo], Codec],
        notify: Notify,
    ) -> None:
        """Args:
        table: the blocks that loads make resident.
        remote: the remote tier, or None for a memory-only tier.
        runner: the model, to recompute blocks (None: missing blocks raise `BlockUnavailable`).
        config: the read batch size.
        stats: the tier's counters.
        codec_for: the storage codec of a block (where to look for a block this tier does not know).
        notify: the tier's listener hook.
        """
        self.table = table
        self.remote = remote
        self.runner = runner
        self.config = config
        self.stats = stats
        self.codec_for = codec_for
        self.notify = notify
        self.signature: ModelSignature = table.signature
        self._inflight: dict[str, asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- access ---------------------------------------------------------------------------------

    async def get(self, ids: torch.Tensor, out: KVCache | None = None, salt: str = "") -> KVCache:
        """The KV of every token of ``ids``: resident blocks as they are, the others loaded first
        (assembled into ``out`` when it has the context's shape, see `assemble`).

        Raises:
            BlockUnavailable: blocks are missing and there is no runner to recompute them.
            TierClosed: the tier was closed while blocks were loading.
        """
        table = self.table
        spans = table.spans(ids, salt=salt)
        keys = [s.key for s in spans]
        self.stats.gets += 1
        table.pin(keys)
        try:
            waiting = [s for s in spans if not table.resident(s.key)]
            self.stats.hits += len(spans) - len(waiting)
            if waiting:
                t0 = time.perf_counter()
                try:
                    await self.ensure(waiting, ids)
                finally:
                    self.stats.stall_seconds += time.perf_counter() - t0
            if table.status is Status.CLOSED:
                raise TierClosed()
            table.touch(keys)
            parts = [table.blocks[k].kv for k in keys]
            kv = await asyncio.to_thread(assemble, parts, ids, table.signature, table.dtype, out)
        finally:
            table.unpin(keys)
        await table.maybe_shed()
        return kv

    # -- prefetch -------------------------------------------------------------------------------

    def spawn_prefetch(self, ids: torch.Tensor, salt: str = "") -> asyncio.Task[int]:
        """`prefetch` of ``ids`` as a background task (cancelled by `cancel`)."""
        task = asyncio.get_running_loop().create_task(self.prefetch(ids, salt), name="kvbus-cachetier-prefetch")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    async def cancel(self) -> None:
        """Cancel the background prefetches and wait for them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # logged where it happened; retrieved here so asyncio does not warn again

    async def prefetch(self, ids: torch.Tensor, salt: str = "") -> int:
        """Make every block of ``ids`` (of ``salt``) resident (an access of each); returns how many were loaded."""
        table = self.table
        try:
            spans = table.spans(ids, salt=salt)
            keys = [s.key for s in spans]
            waiting = [s for s in spans if not table.resident(s.key)]
            self.stats.hits += len(spans) - len(waiting)
            table.pin(keys)
            try:
                if waiting:
                    await self.ensure(waiting, ids)
                table.touch(keys)
            finally:
                table.unpin(keys)
            if not waiting:
                return 0
            await table.maybe_shed()
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

    async def ensure(self, spans: list[BlockSpan], ids: torch.Tensor) -> None:
        """Make the blocks of ``spans`` resident (the caller has pinned them).

        Raises:
            BlockUnavailable: blocks are missing and there is no runner, or their loads kept failing.
        """
        for _ in range(LOAD_ATTEMPTS):
            waiting = [s for s in spans if not self.table.resident(s.key)]
            if not waiting:
                return
            await self._load(waiting, ids)
        missing = [s.key for s in spans if not self.table.resident(s.key)]
        if missing:
            raise BlockUnavailable(missing, "their loads kept failing")

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
        table = self.table
        incoming = sum(table.estimate(s, int(ids.shape[0])) for s in spans)
        await table.reserve(incoming)
        try:
            fetched = await self._fetch(spans, ids)
            rest = [s for s in spans if s.key not in fetched and not table.resident(s.key)]
            if rest:
                await self._recompute(rest, ids)
        finally:
            table.reserved -= incoming

    async def _fetch(self, spans: list[BlockSpan], ids: torch.Tensor) -> set[str]:
        """Read, verify and decode the remote records of ``spans``; returns the keys now resident."""
        if self.remote is None:
            return set()
        loads: list[_Load] = []
        for span in spans:
            block = self.table.blocks.get(span.key)
            if block is not None and block.resident:
                continue  # a concurrent put brought it back
            if block is not None and block.stub is not None:
                stub = block.stub
                loads.append(_Load(span, self.remote.record_key(stub.codec, span.key), stub, stub.size))
            elif block is None:
                size = self.table.estimate(span, int(ids.shape[0]))
                info = BlockInfo(span.key, span.start, span.n_tokens, size, 0.0)
                try:
                    codec = self.codec_for(info).name
                except UnsuitableCodec as exc:
                    logger.warning("not looking for block %s remotely: %s", span.key[:16], exc)
                    continue
                loads.append(_Load(span, self.remote.record_key(codec, span.key), None, size))
        if not loads:
            return set()
        done: set[str] = set()
        pending: asyncio.Future[list[_Load]] | None = None
        try:
            for batch in batches(loads, self.config.read_batch_bytes, size=lambda ld: ld.size):
                try:
                    records = await self.remote.read([ld.record_key for ld in batch])
                except RemoteUnavailable as exc:
                    self.stats.remote_errors += 1
                    logger.warning("remote tier read failed, recomputing %d block(s): %s", len(batch), exc.reason)
                    break
                self.stats.remote_reads += len(batch)
                # Verify and decode this batch in a thread while the next one is read (one decode
                # at a time, as the offloader encodes).
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
        table = self.table
        ok: list[str] = []
        missed: list[str] = []
        for ld in loads:
            key = ld.span.key
            block = table.blocks.get(key)
            if ld.kv is not None and ld.record is not None:
                self.stats.bytes_read += ld.record.size
                if block is None:
                    block = Block(key=key, tokens=ld.kv.tokens, start=ld.span.start)
                    table.add(block)
                block.stub = ld.record
                if not block.resident:
                    table.set_kv(block, ld.kv)
                ok.append(key)
            else:
                if ld.stub is not None:
                    logger.info("block %s is gone from the remote tier (%s): recomputing", key[:16], ld.reason)
                if block is not None and not block.resident:
                    table.remove(block)
                elif block is not None:
                    block.stub = None
                missed.append(key)
        self.stats.fetched += len(ok)
        self.stats.misses += len(missed)
        if ok:
            self.notify("fetched", ok)
        if missed:
            self.notify("missed", missed)
        return set(ok)

    async def _recompute(self, spans: list[BlockSpan], ids: torch.Tensor) -> None:
        runner = self.runner
        if runner is None:
            raise BlockUnavailable(
                [s.key for s in spans],
                "not in memory nor in the remote tier, and the tier has no model runner to recompute them",
            )
        stop = max(s.stop for s in spans)
        parts = await asyncio.to_thread(prefill_blocks, runner, ids, stop, spans)
        for span, part in zip(spans, parts):
            self._check_recomputed(part)
            self.table.install(span, part)
        self.stats.recomputed += len(spans)
        self.stats.recompute_tokens += stop
        self.notify("recomputed", [s.key for s in spans])

    def _check_recomputed(self, kv: KVCache) -> None:
        table = self.table
        if not kv.signature.compatible_with(table.signature) or kv.dtype != table.dtype:
            raise ContextMismatch(
                f"the runner to compute KV of {table.signature.model} in {table.dtype}",
                f"KV of {kv.signature.model} in {kv.dtype}",
            )


def _open_batch(
    batch: list[_Load], records: list[dict[bytes, bytes]], ids: torch.Tensor, signature: ModelSignature
) -> list[_Load]:
    """Verify and decode a batch of records read for ``batch`` (in a worker thread); fills in each load."""
    for ld, fields in zip(batch, records):
        if not fields:
            ld.reason = "no record"
            continue
        try:
            record, encoded = parse_record(fields, ld.span.key, ld.stub)
            tokens = ids[:, ld.span.start : ld.span.stop]
            ld.kv = open_record(record, encoded, tokens, signature)
            ld.record = record
        except KVBusError as exc:
            ld.reason = str(exc)
            logger.warning("remote record of block %s is unusable: %s", ld.span.key[:16], exc)
        except Exception as exc:  # a codec bug must cost a recompute, not wrong data
            ld.reason = f"{type(exc).__name__}: {exc}"
            logger.exception("decoding the remote record of block %s failed", ld.span.key[:16])
    return batch
