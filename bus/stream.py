"""Chunked streaming of one transfer: the sender's and the receiver's state machines.

The sender announces a transfer with an `Open` request to each receiver's inbox, then
publishes chunks once on a per-transfer data subject that every receiver subscribed to (so a
broadcast leaves the sender once and NATS fans it out). Flow control is by credit: a sender
keeps at most ``window`` chunks beyond the slowest receiver's acknowledged position. Each chunk
carries its index and an xxh3-64 digest in NATS headers; the last chunk (or the `Open`, for an
inline payload) carries an xxh3-128 digest of the whole payload, a hash over the chunk digests. A receiver drops corrupt or duplicate chunks, asks for missing ones, and
answers with a final `Ack` only after the whole payload verified and decoded.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch
import xxhash
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.trace import INVALID_SPAN, Span

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
    agent_subject,
    bcast_subject,
    data_subject,
    inbox_subject,
)

logger = logging.getLogger(__name__)


def chunk_digest(data: bytes | memoryview) -> str:
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


#: Buffers below ``chunk_size // PACK_DIVISOR`` are packed together into one chunk; larger
#: ones get chunks of their own (no copy on either side), split when above ``chunk_size``.
PACK_DIVISOR = 16


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
        pieces = [self.buffers[b][s:e] for b, s, e in self.plan.pieces(index)]
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


@dataclass
class ReceiverOutcome:
    """How one receiver's side of a transfer ended."""

    ok: bool = False
    error: BaseException | None = None
    decode_s: float = 0.0


@dataclass
class StreamStats:
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

    def __init__(self, transport: Transport, *, transfer_id: str, src: str, codec: str, meta: dict,
                 buffers: list[memoryview], receivers: list[str], config: BusConfig, chunk_size: int,
                 window: int, rate_bps: float = 0.0, inline_limit: int = 0,
                 traceparent: str | None = None) -> None:
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
        self.data_subject = (data_subject(self.receivers[0], transfer_id) if len(self.receivers) == 1
                             else bcast_subject(src, transfer_id))
        self.open = Open(
            transfer_id=transfer_id, src=src, codec=codec, meta=meta, sizes=self.sizes,
            total=self.plan.total, chunk_size=chunk_size, n_chunks=self.plan.n_chunks, digest=self.digest,
            window=window, data_subject=self.data_subject, ack_subject=agent_subject(src, "ack"),
            inline=False, traceparent=traceparent,
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
        for rx, outcome in self.outcomes.items():
            if not outcome.ok and outcome.error is None:
                outcome.error = TransferRejected(self.transfer_id, "scheduler", reason or "cancelled")
        self.resume()
        self._progress.set()

    @property
    def fraction_acked(self) -> float:
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
                outcome.error = TransferRejected(self.transfer_id, ack.rx, ack.reason or "receiver gave up")
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
                data = await self.transport.request(inbox_subject(rx, self.open.src), frame,
                                                    timeout=min(self.config.request_timeout, max(left, 0.001)))
                break
            except NoResponders:
                outcome.error = ReceiverGone(self.transfer_id, rx, "no agent listens on its inbox")
                return
            except TimeoutError:
                if time.monotonic() >= give_up - 1e-3:
                    outcome.error = TransferTimeout(self.transfer_id, f"waiting for {rx} to accept",
                                                    time.monotonic() - started, rx)
                    return
                self.span.add_event("open.retry", {"kvbus.receiver": rx})
        try:
            reply = OpenReply.decode(data)
        except Exception as exc:  # noqa: BLE001 - a broken reply fails this receiver only
            outcome.error = TransferError(self.transfer_id, f"bad reply from {rx}: {exc}", peer=rx)
            return
        if not reply.ok:
            outcome.error = TransferRejected(self.transfer_id, rx, reply.reason)
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
                data = await self.transport.request(inbox_subject(rx, self.open.src), frame,
                                                    timeout=self.config.request_timeout)
                reply = OpenReply.decode(data)
            except NoResponders:
                outcome.error = ReceiverGone(self.transfer_id, rx, "it stopped answering mid-transfer")
                continue
            except Exception:  # noqa: BLE001 - timeouts and bad replies count as no progress
                reply = None
            if reply is not None and not reply.ok:
                outcome.error = TransferRejected(self.transfer_id, rx, reply.reason)
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
        lo, hi = self.plan.ranges[index]
        return hi - lo

    def add(self, index: int, data: bytes | memoryview) -> None:
        view = memoryview(data)
        self._owners.append(data)
        offset = 0
        for b, start, end in self.plan.pieces(index):
            n = end - start
            if start == 0 and end == self.plan.sizes[b]:
                self.buffers[b] = view[offset:offset + n]
            else:
                target = self.buffers[b]
                if target is None:
                    target = self.buffers[b] = memoryview(torch.empty(self.plan.sizes[b], dtype=torch.uint8).numpy())
                target[start:end] = view[offset:offset + n]
            offset += n

    def result(self) -> list[memoryview]:
        missing = [i for i, b in enumerate(self.buffers) if b is None]
        if missing:
            raise RuntimeError(f"buffers {missing[:8]} were never filled")
        return self.buffers  # type: ignore[return-value]


def split_inline(open_msg: Open, payload: memoryview) -> tuple[list[memoryview], str]:
    """Buffers and recomputed tree digest of an inline payload."""
    plan = ChunkPlan(open_msg.sizes, open_msg.chunk_size)
    digests = [chunk_digest(payload[lo:hi]) for lo, hi in plan.ranges]
    buffers = [payload[s:s + n] for s, n in zip(plan.starts, plan.sizes)]
    return buffers, tree_digest(digests, plan.total)


class IncomingTransfer:
    """The receiver's side of one streamed transfer: reassembly, verification, repair requests."""

    def __init__(self, transport: Transport, open_msg: Open, rx: str, config: BusConfig,
                 finish: Callable[[IncomingTransfer], Awaitable[None]], plan: Reassembly | None = None) -> None:
        self.transport = transport
        self.open = open_msg
        self.rx = rx
        self.config = config
        self._finish = finish
        self.assembly = plan or Reassembly(open_msg.sizes, open_msg.chunk_size)
        self.digests: list[str] = [""] * open_msg.n_chunks
        self.root = open_msg.digest
        self.have = bytearray(open_msg.n_chunks)
        self.count = 0
        self.next = 0
        self.corrupt = 0
        self.duplicates = 0
        self.last_activity = time.monotonic()
        self.started = time.perf_counter()
        self.completed = False
        self._sub: Subscription | None = None
        self._since_ack = 0
        self._asked: set[int] = set()
        self._done_task: asyncio.Task[None] | None = None
        self.spans: tuple[Span, Span] = (INVALID_SPAN, INVALID_SPAN)
        """The receiver's ``kvbus.receive`` and ``kvbus.reassemble`` spans (set by the agent)."""

    async def start(self) -> None:
        self._sub = await self.transport.subscribe(self.open.data_subject, self._on_chunk)

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection may be gone already
                logger.debug("unsubscribe failed", exc_info=True)

    async def _ack(self, *, missing: list[int] | None = None, done: bool = False, ok: bool = True,
                   reason: str = "", decode_s: float = 0.0) -> None:
        ack = Ack(transfer_id=self.open.transfer_id, rx=self.rx, next=self.next, received=self.count,
                  missing=missing or [], done=done, ok=ok, reason=reason, decode_s=decode_s)
        try:
            await self.transport.publish(self.open.ack_subject, ack.encode())
        except Exception:  # noqa: BLE001 - the sender will ask again
            logger.warning("transfer %s: could not send ack", self.open.transfer_id, exc_info=True)

    async def _on_chunk(self, msg: Msg) -> None:
        if self.completed:
            return
        self.last_activity = time.monotonic()
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
        digest = headers.get(CHUNK_SUM_HEADER, "")
        if len(data) != self.assembly.chunk_len(index) or chunk_digest(data) != digest:
            self.corrupt += 1
            logger.warning("transfer %s: chunk %d failed its checksum, asking again", self.open.transfer_id, index)
            self._asked.discard(index)
            await self._request_missing(index + 1)
            return
        self.assembly.add(index, data)
        self.digests[index] = digest
        if index == self.open.n_chunks - 1:
            self.root = headers.get(ROOT_SUM_HEADER, "")
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
            await self._ack(done=True, ok=False, reason="receiver failed while finishing")
        finally:
            await self.stop()

    async def _request_missing(self, upto: int) -> None:
        """Ask for every chunk below ``upto`` not yet received and not already asked for."""
        missing = [i for i in range(self.next, min(upto, self.open.n_chunks))
                   if not self.have[i] and i not in self._asked][: self.config.max_missing]
        if missing:
            self._asked.update(missing)
            self._since_ack = 0
            await self._ack(missing=missing)

    def verify(self) -> bool:
        """Whether the chunk digests add up to the sender's whole-payload digest."""
        return bool(self.root) and tree_digest(self.digests, self.assembly.plan.total) == self.root
