"""The receiver's side of one streamed transfer: chunks checked and placed, credit, repair requests.

Chunks arrive on the transfer's data subject. Each is checked against the digest the sender's
`Open` announced for its index (`kvbus.bus.chunking.ChunkVerifier`); one with a bad index, size
or digest is dropped and asked for again from the sender, whatever its headers say; duplicates
are dropped. Every ``ack_every`` chunks (and whenever a gap shows) the receiver acknowledges its
position and lists what is missing. When the last chunk is in, the agent's finish callback
decodes and delivers the payload and sends the final verdict (`IncomingTransfer.report`).
Only a chunk that passes its digest counts as progress (`last_progress`): junk keeps nothing alive.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.trace import INVALID_SPAN, Span

from kvbus.bus.chunking import ChunkPlan, ChunkVerifier, Reassembly
from kvbus.bus.config import BusConfig
from kvbus.net.transport import Transport
from kvbus.protocol import CHUNK_INDEX_HEADER, Ack, Open, Reason, packb, unpackb

logger = logging.getLogger(__name__)


class IncomingTransfer:
    """The receiver's side of one streamed transfer: reassembly, verification, repair requests."""

    def __init__(
        self,
        transport: Transport,
        open_msg: Open,
        rx: str,
        config: BusConfig,
        finish: Callable[[IncomingTransfer], Awaitable[None]],
        plan: ChunkPlan | None = None,
    ) -> None:
        self.transport = transport
        plan = plan or ChunkPlan(open_msg.sizes, open_msg.chunk_size)
        # While it waits for chunks a partial keeps its codec metadata packed and its sizes in the
        # plan's array: what it holds is then known to the byte (`overhead`), not a decoded map of
        # whatever a hostile sender packed into it.
        self._meta = packb(open_msg.meta)
        self.open = dataclasses.replace(open_msg, meta={}, sizes=[])
        """The transfer's `Open`, without its metadata and sizes (see `opened`)."""
        self.rx = rx
        self.config = config
        self._finish = finish
        self.assembly = Reassembly(plan.sizes, open_msg.chunk_size, plan)
        self.verifier = ChunkVerifier(plan, open_msg.digests)
        self.overhead = len(self._meta) + len(open_msg.digests) + 9 * plan.n_chunks + 32 * len(plan.sizes) + 2048
        """Bytes of bookkeeping this partial holds besides the payload (what the overhead cap counts)."""
        self.have = bytearray(open_msg.n_chunks)
        self.count = 0
        self.next = 0
        self.corrupt = 0
        self.duplicates = 0
        self.last_progress = time.monotonic()
        """When the transfer last made valid progress (its Open, then each chunk that passed its digest)."""
        self.started = time.perf_counter()
        self.completed = False
        self._sub: Subscription | None = None
        self._since_ack = 0
        self._asked: set[int] = set()
        self._done_task: asyncio.Task[None] | None = None
        self.spans: tuple[Span, Span] = (INVALID_SPAN, INVALID_SPAN)
        """The receiver's ``kvbus.receive`` and ``kvbus.reassemble`` spans (set by the agent)."""

    @property
    def nbytes(self) -> int:
        """Bytes the payload will take once whole (what the partial caps count)."""
        return self.open.total

    def opened(self) -> Open:
        """The whole `Open` again, metadata and sizes included (for the decode)."""
        meta = unpackb(self._meta, "open metadata")
        return dataclasses.replace(self.open, meta=meta, sizes=list(self.assembly.plan.sizes))

    async def start(self) -> None:
        """Subscribe to the transfer's data subject."""
        self._sub = await self.transport.subscribe(self.open.data_subject, self._on_chunk)

    async def stop(self) -> None:
        """Unsubscribe (the partial payload is then dropped with this object)."""
        self.completed = True
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:
                logger.debug("unsubscribe failed", exc_info=True)

    async def report(self, *, ok: bool, reason: str = "", code: Reason = Reason.NONE, decode_s: float = 0.0) -> None:
        """Send the final verdict: delivered (``ok``), or refused with ``code`` and ``reason``."""
        await self._ack(done=True, ok=ok, reason=reason, code=code, decode_s=decode_s)

    async def _ack(
        self,
        *,
        missing: list[int] | None = None,
        done: bool = False,
        ok: bool = True,
        reason: str = "",
        code: Reason = Reason.NONE,
        decode_s: float = 0.0,
    ) -> None:
        ack = Ack(
            transfer_id=self.open.transfer_id,
            rx=self.rx,
            next=self.next,
            received=self.count,
            missing=missing or [],
            done=done,
            ok=ok,
            reason=reason,
            decode_s=decode_s,
            code=code,
        )
        try:
            await self.transport.publish(self.open.ack_subject, ack.encode())
        except Exception:
            logger.warning("transfer %s: could not send ack", self.open.transfer_id, exc_info=True)

    async def _on_chunk(self, msg: Msg) -> None:
        if self.completed:
            return
        headers = msg.headers or {}
        try:
            index = int(headers[CHUNK_INDEX_HEADER])
        except (KeyError, ValueError):
            self.corrupt += 1
            logger.warning("transfer %s: chunk without a valid index header dropped", self.open.transfer_id)
            return
        if not 0 <= index < self.open.n_chunks:
            self.corrupt += 1
            logger.warning("transfer %s: chunk index %d out of range dropped", self.open.transfer_id, index)
            return
        if self.have[index]:
            self.duplicates += 1
            return
        data = msg.data
        if not self.verifier.check(index, data):
            self.corrupt += 1
            logger.warning("transfer %s: chunk %d failed its digest, asking again", self.open.transfer_id, index)
            self._asked.discard(index)
            await self._request_missing(index + 1)
            return
        self.last_progress = time.monotonic()
        self.assembly.add(index, data)
        self.have[index] = 1
        self.count += 1
        self._since_ack += 1
        self._asked.discard(index)
        while self.next < self.open.n_chunks and self.have[self.next]:
            self.next += 1
        if self.count == self.open.n_chunks:
            self.completed = True
            # Not in this callback: unsubscribing cancels the task that runs it.
            self._done_task = asyncio.create_task(self._complete(), name=f"kvbus-finish-{self.open.transfer_id}")
            return
        if index > self.next:
            await self._request_missing(index)
        elif self._since_ack >= self.config.ack_every:
            self._since_ack = 0
            await self._ack()

    async def _complete(self) -> None:
        try:
            await self._finish(self)
        except Exception:
            logger.exception("transfer %s: finishing failed", self.open.transfer_id)
            await self.report(ok=False, reason="receiver failed while finishing", code=Reason.INTERNAL)
        finally:
            await self.stop()

    async def _request_missing(self, upto: int) -> None:
        """Ask for every chunk below ``upto`` not yet received and not already asked for."""
        missing = [
            i for i in range(self.next, min(upto, self.open.n_chunks)) if not self.have[i] and i not in self._asked
        ][: self.config.max_missing]
        if missing:
            self._asked.update(missing)
            self._since_ack = 0
            await self._ack(missing=missing)

    def verify(self) -> bool:
        """Whether every chunk is in (each passed the digest the `Open` announced for it)."""
        return self.count == self.open.n_chunks and all(self.have)
