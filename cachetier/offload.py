"""`Offloader`: the write side of the remote tier, for blocks that shedding chose to keep remotely.

A block another tier (or an earlier life of this one) already stored with the same codec is
adopted: its stub is kept without a write. The others are encoded (the next batch in a worker
thread while this one is written) and written in pipelined batches; a block becomes a stub only
once the server confirmed its write. Blocks that could not be written are handed back for the
caller to drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbus.cachetier.blocks import Block
from kvbus.cachetier.config import CacheTierConfig
from kvbus.cachetier.errors import RemoteUnavailable, UnsuitableCodec
from kvbus.cachetier.policy import BlockInfo
from kvbus.cachetier.record import Stub, adoptable, build_record
from kvbus.cachetier.remote import RemoteStore, batches
from kvbus.cachetier.types import TierStats
from kvbus.codecs import Codec
from kvbus.signature import ModelSignature

if TYPE_CHECKING:
    from kvbus.cachetier.residency import Notify, Residency

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Offloaded:
    """What one `Offloader.offload` did."""

    written: int = 0
    """Blocks written and confirmed."""
    adopted: int = 0
    """Blocks whose record the remote tier already held."""
    nbytes: int = 0
    """Payload bytes written."""
    failed: list[Block] = field(default_factory=list)
    """Blocks still resident without a stub, to drop."""


class Offloader:
    """Writes blocks to a `RemoteStore` (or, without one, hands every block back as failed)."""

    def __init__(
        self,
        remote: RemoteStore | None,
        config: CacheTierConfig,
        signature: ModelSignature,
        stats: TierStats,
        *,
        codec_for: Callable[[BlockInfo], Codec],
        notify: Notify,
    ) -> None:
        """Args:
        remote: the remote tier, or None for a memory-only tier.
        config: the write batch size.
        signature: the model of the blocks (for size estimates).
        stats: the tier's counters.
        codec_for: the storage codec of a block (the policy's choice).
        notify: the tier's listener hook.
        """
        self.remote = remote
        self.config = config
        self.signature = signature
        self.stats = stats
        self.codec_for = codec_for
        self.notify = notify

    async def offload(self, victims: list[tuple[BlockInfo, Block]], table: Residency) -> Offloaded:
        """Write ``victims`` (resident blocks of ``table`` without a stub) and leave them as stubs."""
        if not victims:
            return Offloaded()
        if self.remote is None:
            return Offloaded(failed=[b for _, b in victims])
        remote = self.remote
        for _, block in victims:
            block.busy = True
        todo: list[tuple[Block, Codec]] = []
        for info, block in victims:
            try:
                todo.append((block, self.codec_for(info)))
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
                stub = adoptable(raw, block.key, block.kv, codec.name)
                if stub is None:
                    rest.append((block, codec))
                else:
                    table.to_stub(block, stub)
                    adopted_keys.append(rk)
            adopted = len(adopted_keys)
            self.stats.adopted += adopted
            if adopted_keys:
                await remote.touch(adopted_keys)
            todo = rest
            planned = batches(
                [(b, c.name, c.estimate_nbytes(self.signature, b.n_tokens, b.tokens.shape[0])) for b, c in todo],
                self.config.write_batch_bytes,
                size=lambda t: t[2],
            )
            # The next batch is encoded in a thread while this one is written.
            async with contextlib.aclosing(_ahead(_encode_batch, planned)) as encoded_batches:
                async for encoded in encoded_batches:
                    records = [(remote.record_key(stub.codec, stub.key), fields) for _, stub, fields in encoded]
                    confirmed = await remote.write(records)
                    keys = []
                    for (block, stub, _), ok in zip(encoded, confirmed):
                        if ok:
                            table.to_stub(block, stub)
                            keys.append(block.key)
                            written += 1
                            nbytes += stub.size
                            self.stats.offloaded += 1
                            self.stats.bytes_written += stub.size
                    if keys:
                        self.notify("offloaded", keys)
        except RemoteUnavailable as exc:
            self.stats.remote_errors += 1
            logger.warning("remote tier write failed; dropping blocks that were not written: %s", exc.reason)
        finally:
            for _, block in victims:
                block.busy = False
        failed = [
            b
            for _, b in victims
            if b.stub is None and b.resident and table.blocks.get(b.key) is b and not table.pins[b.key]
        ]
        return Offloaded(written=written, adopted=adopted, nbytes=nbytes, failed=failed)


async def _ahead(fn: Callable[[Any], Any], items: list[Any]) -> AsyncGenerator[Any, None]:
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


def _encode_batch(batch: list[tuple[Block, str, int]]) -> list[tuple[Block, Stub, dict[bytes, Any]]]:
    """Build the records of a batch of blocks (in a worker thread); a block that fails to encode is left out."""
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
