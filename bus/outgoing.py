"""The sender's side of one transfer: `Open`, credit window, pacing, repair, pause and resume.

The sender announces a transfer with an `Open` request to each receiver's inbox, then
publishes chunks once on a per-transfer data subject that every receiver subscribed to (so a
broadcast leaves the sender once and NATS fans it out). Flow control is by credit: a sender
keeps at most ``window`` chunks beyond the slowest receiver's acknowledged position. Each chunk
carries its index and digest in NATS headers; the last chunk (or the `Open`, for an inline
payload) carries the whole payload's digest (`kvbus.bus.chunking`). Receivers ask for missing
chunks; a sender without acknowledgements asks each lagging receiver where it stands.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field

from opentelemetry.trace import INVALID_SPAN, Span

from kvbus.bus.chunking import ChunkSource, chunk_digest, tree_digest
from kvbus.bus.config import BusConfig
from kvbus.bus.errors import ReceiverGone, TransferError, TransferRejected, TransferTimeout
from kvbus.bus.pacing import TokenBucket
from kvbus.net.transport import NoResponders, Transport
from kvbus.protocol import (
    CHUNK_INDEX_HEADER,
    CHUNK_SUM_HEADER,
    ROOT_SUM_HEADER,
    Ack,
    Open,
    OpenReply,
    Reason,
    agent_subject,
    bcast_subject,
    data_subject,
    inbox_subject,
)

logger = logging.getLogger(__name__)


@dataclass
class ReceiverOutcome:
    """How one receiver's side of a transfer ended."""

    ok: bool = False
    error: BaseException | None = None
    decode_s: float = 0.0


@dataclass
class StreamStats:
    """What one outgoing transfer did: chunks and bytes sent, retransmits, pauses."""

    chunks_sent: int = 0
    """Chunk messages published, retransmissions included."""
    retransmits: int = 0
    bytes_sent: int = 0
    pauses: int = 0
    declined_pauses: int = 0
    """Pause requests refused because too much had been sent already."""
    rate_changes: int = 0
    paused_s: float = 0.0
    """Time spent paused."""
    started: float = field(default_factory=time.perf_counter)
    finished: float = 0.0


class OutgoingTransfer:
    """The sender's side of one transfer to one or more receivers."""

    def __init__(
        self,
        transport: Transport,
        *,
        transfer_id: str,
        src: str,
        codec: str,
        meta: dict,
        buffers: list[memoryview],
        receivers: list[str],
        config: BusConfig,
        chunk_size: int,
        window: int,
        rate_bps: float = 0.0,
        inline_limit: int = 0,
        traceparent: str | None = None,
        trace_link: str | None = None,
    ) -> None:
        self.transport = transport
        self.transfer_id = transfer_id
        self.src = src
        self.receivers = list(receivers)
        self.config = config
        self.window = window
        self.plan = ChunkSource(buffers, chunk_size)
        self.sizes = [b.nbytes for b in buffers]
        # Views for chunks within one buffer; small buffers packed together are joined once here.
        self._chunks = [self.plan.chunk(i) for i in range(self.plan.n_chunks)]
        # Chunk digests are computed as chunks first go out, while the sender would otherwise
        # wait for credit; the whole-payload digest rides on the last chunk (or in the Open for
        # an inline payload).
        self._digests: list[str] = [""] * self.plan.n_chunks
        self.digest = ""
        # Unicast chunks go under the receiver's prefix, broadcasts under the sender's: the
        # permission scheme (kvbus.security) lets only the addressed agents subscribe.
        self.data_subject = (
            data_subject(self.receivers[0], transfer_id)
            if len(self.receivers) == 1
            else bcast_subject(src, transfer_id)
        )
        self.open = Open(
            transfer_id=transfer_id,
            src=src,
            codec=codec,
            meta=meta,
            sizes=self.sizes,
            total=self.plan.total,
            chunk_size=chunk_size,
            n_chunks=self.plan.n_chunks,
            digest=self.digest,
            window=window,
            data_subject=self.data_subject,
            ack_subject=agent_subject(src, "ack"),
            inline=False,
            traceparent=traceparent,
            trace_link=None if traceparent else trace_link,
        )
        # Inline when small enough and the framed Open (header + payload) fits the server's max_payload.
        room = transport.max_payload - len(self.open.encode()) - 1024
        if self.plan.total <= min(inline_limit, room):
            self._digests = [chunk_digest(c) for c in self._chunks]
            self.digest = tree_digest(self._digests, self.plan.total)
            self.open = dataclasses.replace(self.open, inline=True, digest=self.digest)
        self.bucket = TokenBucket(rate_bps, burst=max(chunk_size, rate_bps * 0.02))
        self.outcomes: dict[str, ReceiverOutcome] = {rx: ReceiverOutcome() for rx in self.receivers}
        self.stats = StreamStats()
        self._acked: dict[str, int] = {}
        self._resend: set[int] = set()
        self._next = 0
        self._progress = asyncio.Event()
        self._running = asyncio.Event()
        self._running.set()
        self._paused_at = 0.0
        self._started = False
        self.span: Span = INVALID_SPAN
        """The sender's ``kvbus.stream`` span: pause, resume and retransmit become its events."""
        self._last_progress = time.monotonic()

    # -- control from the scheduler --------------------------------------------------------

    @property
    def paused(self) -> bool:
        """Whether the scheduler has paused the transfer."""
        return not self._running.is_set()

    @property
    def fraction_sent(self) -> float:
        """Share of the payload's bytes that have gone out at least once (exact, at chunk boundaries)."""
        if not self._started:
            return 0.0
        if self.open.inline:
            return 1.0
        if not self.plan.total or not self._next:
            return 0.0
        return self.plan.plan.ranges[self._next - 1][1] / self.plan.total

    def pause(self, max_fraction: float = 1.0) -> bool:
        """Stop at the next chunk boundary, unless ``max_fraction`` or more of the payload has been sent.

        Returns whether the transfer is paused. An inline payload, once started, travels in one
        message and cannot pause. Chunks already sent are not sent again on `resume`.
        """
        if self._started and (self.open.inline or self.fraction_sent >= max_fraction):
            self.stats.declined_pauses += 1
            self.span.add_event("pause.declined", {"kvbus.fraction_sent": self.fraction_sent})
            return False
        if self._running.is_set():
            self.stats.pauses += 1
            self.span.add_event("pause", {"kvbus.fraction_sent": self.fraction_sent})
            self._paused_at = time.monotonic()
            self._running.clear()
            self._progress.set()  # wake a sender waiting for credit so it sees the pause
        return True

    def resume(self) -> None:
        """Continue from the first chunk not yet sent."""
        if not self._running.is_set():
            self.stats.paused_s += time.monotonic() - self._paused_at
            self.bucket.restart()  # no burst of credit saved up while paused
            self.span.add_event("resume", {"kvbus.fraction_sent": self.fraction_sent})
        self._last_progress = time.monotonic()
        self._running.set()

    def set_rate(self, rate_bps: float) -> None:
        """Pace the rest of the transfer at ``rate_bps`` bytes/s (0 = unpaced)."""
        self.stats.rate_changes += 1
        self.bucket.set_rate(rate_bps, burst=max(self.plan.chunk_size, rate_bps * 0.02))

    def cancel(self, reason: str) -> None:
        """Give up: every receiver still pending fails with ``reason``."""
        for outcome in self.outcomes.values():
            if not outcome.ok and outcome.error is None:
                outcome.error = TransferRejected(
                    self.transfer_id, "scheduler", reason or "cancelled", code=Reason.CANCELLED
                )
        self.resume()
        self._progress.set()

    @property
    def fraction_acked(self) -> float:
        """Share of the chunks the slowest pending receiver has acknowledged."""
        if not self.plan.n_chunks:
            return 1.0
        active = [self._acked.get(rx, 0) for rx in self._active()]
        return (min(active) if active else self.plan.n_chunks) / self.plan.n_chunks

    # -- acks -------------------------------------------------------------------------------

    def on_ack(self, ack: Ack) -> None:
        """Apply a receiver's acknowledgement (called by the agent's ack subscription)."""
        outcome = self.outcomes.get(ack.rx)
        if outcome is None or outcome.ok or outcome.error is not None:
            return
        if ack.done:
            if ack.ok:
                outcome.ok = True
                outcome.decode_s = ack.decode_s
            else:
                outcome.error = TransferRejected(
                    self.transfer_id, ack.rx, ack.reason or "receiver gave up", code=ack.code or Reason.OTHER
                )
        else:
            if ack.next > self._acked.get(ack.rx, 0):
                self._acked[ack.rx] = min(ack.next, self.plan.n_chunks)
            for m in ack.missing[: self.config.max_missing]:
                if isinstance(m, int) and 0 <= m < self._next:
                    self._resend.add(m)
        self._last_progress = time.monotonic()
        self._progress.set()

    def _active(self) -> list[str]:
        return [rx for rx, o in self.outcomes.items() if not o.ok and o.error is None]

    # -- the run ------------------------------------------------------------------------------

    async def run(self) -> dict[str, ReceiverOutcome]:
        """Open, stream and wait for every receiver's verdict; never raises for a receiver's failure."""
        inline = self.open.inline
        frame = self.open.frame(b"".join(self.plan.buffers) if inline else b"")
        # Paused before it started (preempted while encoding): start when resumed.
        await self._running.wait()
        if not self._active():
            return self.outcomes
        self._started = True
        if inline:
            # The whole payload goes in the Open: pace it like chunks (0 = unpaced takes no time).
            await self.bucket.take(self.plan.total)
        await asyncio.gather(*(self._open(rx, frame) for rx in self.receivers))
        if not inline:
            await self._stream()
        self.stats.finished = time.perf_counter()
        return self.outcomes

    async def _open(self, rx: str, frame: bytes) -> None:
        outcome = self.outcomes[rx]
        # An unanswered Open is asked again (the same transfer id: a receiver that got the first
        # one answers with where it stands) until ``peer_timeout``: a request lost while the
        # server restarted or the receiver was busy does not fail the transfer.
        started = time.monotonic()
        give_up = started + max(self.config.peer_timeout, self.config.request_timeout)
        while True:
            left = give_up - time.monotonic()
            try:
                data = await self.transport.request(
                    inbox_subject(rx, self.open.src), frame, timeout=min(self.config.request_timeout, max(left, 0.001))
                )
                break
            except NoResponders:
                outcome.error = ReceiverGone(self.transfer_id, rx, "no agent listens on its inbox")
                return
            except TimeoutError:
                if time.monotonic() >= give_up - 1e-3:
                    outcome.error = TransferTimeout(
                        self.transfer_id, f"waiting for {rx} to accept", time.monotonic() - started, rx
                    )
                    return
                self.span.add_event("open.retry", {"kvbus.receiver": rx})
        try:
            reply = OpenReply.decode(data)
        except Exception as exc:  # noqa: BLE001 - a broken reply fails this receiver only
            outcome.error = TransferError(self.transfer_id, f"bad reply from {rx}: {exc}", peer=rx)
            return
        if not reply.ok:
            outcome.error = TransferRejected(self.transfer_id, rx, reply.reason, code=reply.code or Reason.OTHER)
        elif reply.done:
            outcome.ok = True
            outcome.decode_s = reply.decode_s
        else:
            self._acked[rx] = max(self._acked.get(rx, 0), reply.next)

    async def _send_chunk(self, index: int) -> None:
        data = self._chunks[index]
        digest = self._digests[index]
        if not digest:
            digest = self._digests[index] = chunk_digest(data)
        headers = {CHUNK_INDEX_HEADER: str(index), CHUNK_SUM_HEADER: digest}
        if index == self.plan.n_chunks - 1:
            # Every earlier chunk went out before this one, so all digests are known.
            if not self.digest:
                self.digest = tree_digest(self._digests, self.plan.total)
            headers[ROOT_SUM_HEADER] = self.digest
        await self.bucket.take(len(data))
        await self.transport.publish(self.data_subject, data, headers=headers)
        self.stats.chunks_sent += 1
        self.stats.bytes_sent += len(data)

    async def _stream(self) -> None:
        n = self.plan.n_chunks
        window = self.window
        while True:
            active = self._active()
            if not active:
                return
            if not self._running.is_set():
                await self._running.wait()
                continue
            if self._resend:
                index = min(self._resend)
                self._resend.discard(index)
                self.stats.retransmits += 1
                self.span.add_event("retransmit", {"kvbus.chunk": index})
                await self._send_chunk(index)
                continue
            low = min(self._acked.get(rx, 0) for rx in active)
            if self._next < n and self._next < low + window:
                await self._send_chunk(self._next)
                self._next += 1
                continue
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), self.config.ack_timeout)
            except TimeoutError:
                await self._stalled()

    async def _stalled(self) -> None:
        """No ack for a while: ask each lagging receiver where it stands (this also tells if it is alive)."""
        waited = time.monotonic() - self._last_progress
        frame = self.open.frame(b"")
        for rx in self._active():
            outcome = self.outcomes[rx]
            try:
                data = await self.transport.request(
                    inbox_subject(rx, self.open.src), frame, timeout=self.config.request_timeout
                )
                reply = OpenReply.decode(data)
            except NoResponders:
                outcome.error = ReceiverGone(self.transfer_id, rx, "it stopped answering mid-transfer")
                continue
            except Exception:  # noqa: BLE001 - timeouts and bad replies count as no progress
                reply = None
            if reply is not None and not reply.ok:
                outcome.error = TransferRejected(self.transfer_id, rx, reply.reason, code=reply.code or Reason.OTHER)
            elif reply is not None and reply.done:
                outcome.ok = True
                outcome.decode_s = reply.decode_s
            elif waited > self.config.peer_timeout:
                outcome.error = TransferTimeout(self.transfer_id, f"streaming to {rx}", waited, rx)
            elif reply is not None:
                # Tail loss: resend what it has not got, up to a window's worth.
                start = max(reply.next, self._acked.get(rx, 0))
                self._acked[rx] = start
                self._resend.update(range(start, min(self._next, start + self.window)))
                logger.info("transfer %s: %s stalled at chunk %d, resending", self.transfer_id, rx, start)
                self.span.add_event("stalled", {"kvbus.receiver": rx, "kvbus.chunk": start})
