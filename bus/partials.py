"""The partial transfers a receiver holds: caps on their number and bytes, eviction, idle deadline.

Every streamed transfer being reassembled counts against three caps, ``BusConfig.max_partials``,
``BusConfig.max_partial_bytes`` (its announced size: what it will hold once whole) and
``BusConfig.max_partial_overhead`` (its bookkeeping: chunk digests and plan, packed codec
metadata). A new one that would go over them makes room by dropping the partial whose last
valid progress is oldest; one idle for ``partial_timeout`` (no chunk that passed its digest) is dropped by the
janitor. A dropped partial's sender gets a final `Ack` with `Reason.PARTIAL_DROPPED`, so it
fails at once instead of waiting for its own timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from kvbus import telemetry
from kvbus.bus.config import BusConfig
from kvbus.bus.errors import TransferError
from kvbus.bus.incoming import IncomingTransfer
from kvbus.protocol import Reason

logger = logging.getLogger(__name__)


class PartialTransfers:
    """The streamed transfers a receiver is reassembling, by id, within its caps."""

    def __init__(self, config: BusConfig) -> None:
        self._config = config
        self._by_id: dict[str, IncomingTransfer] = {}
        self.nbytes = 0
        """Announced bytes of every partial transfer held."""
        self.overhead = 0
        """Bytes of bookkeeping (digests, chunk plan, packed metadata) of every partial transfer held."""
        self.dropped = 0
        """Partial transfers dropped so far (idle or evicted)."""

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[IncomingTransfer]:
        return iter(list(self._by_id.values()))

    def get(self, transfer_id: str) -> IncomingTransfer | None:
        """The partial transfer ``transfer_id``, if held."""
        return self._by_id.get(transfer_id)

    def too_large(self, nbytes: int) -> bool:
        """Whether one transfer of ``nbytes`` alone is over the byte cap."""
        return nbytes > self._config.max_partial_bytes

    def _over(self, new: IncomingTransfer) -> bool:
        cfg = self._config
        return (
            len(self._by_id) >= cfg.max_partials
            or self.nbytes + new.nbytes > cfg.max_partial_bytes
            or self.overhead + new.overhead > cfg.max_partial_overhead
        )

    async def make_room(self, new: IncomingTransfer) -> None:
        """Drop the partials with the oldest valid progress until ``new`` fits the caps."""
        cfg = self._config
        while self._by_id and self._over(new):
            oldest = min(self._by_id.values(), key=lambda p: p.last_progress)
            await self.drop(
                oldest,
                f"evicted: the receiver holds {len(self._by_id)} partial transfers of {self.nbytes} bytes "
                f"and {self.overhead} bytes of bookkeeping (caps {cfg.max_partials}, {cfg.max_partial_bytes} "
                f"and {cfg.max_partial_overhead}), and this one progressed least recently",
            )

    def add(self, incoming: IncomingTransfer) -> None:
        """Hold a new partial transfer (after `make_room`)."""
        self._by_id[incoming.open.transfer_id] = incoming
        self.nbytes += incoming.nbytes
        self.overhead += incoming.overhead

    def pop(self, transfer_id: str) -> IncomingTransfer | None:
        """Stop counting ``transfer_id`` (it finished, or is being dropped)."""
        incoming = self._by_id.pop(transfer_id, None)
        if incoming is not None:
            self.nbytes -= incoming.nbytes
            self.overhead -= incoming.overhead
        return incoming

    async def drop(self, incoming: IncomingTransfer, why: str) -> None:
        """Drop a partial transfer: unsubscribe, free it, tell its sender with `Reason.PARTIAL_DROPPED`."""
        tid = incoming.open.transfer_id
        if self.pop(tid) is None:
            return
        self.dropped += 1
        logger.warning(
            "transfer %s from %s: dropping %d of %d chunks (%s)",
            tid,
            incoming.open.src,
            incoming.count,
            incoming.open.n_chunks,
            why,
        )
        for span in reversed(incoming.spans):
            telemetry.fail(span, TransferError(tid, why))
            span.end()
        await incoming.stop()
        await incoming.report(ok=False, reason=f"partial transfer dropped: {why}", code=Reason.PARTIAL_DROPPED)

    async def expire(self, now: float | None = None) -> None:
        """Drop every partial without valid progress for ``partial_timeout``."""
        now = time.monotonic() if now is None else now
        timeout = self._config.partial_timeout
        for incoming in self:
            idle = now - incoming.last_progress
            if idle > timeout:
                await self.drop(incoming, f"no valid chunk for {idle:.1f} s")

    async def stop(self) -> None:
        """Drop every partial, telling each sender with `Reason.SHUTTING_DOWN` (the agent is closing)."""
        for incoming in self:
            self.pop(incoming.open.transfer_id)
            await incoming.stop()
            await incoming.report(ok=False, reason="the receiver is closing", code=Reason.SHUTTING_DOWN)
