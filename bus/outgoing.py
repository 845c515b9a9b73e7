"""The sender's side of one transfer: `Open`, credit window, pacing, repair, pause and resume.

The sender hashes every chunk first (xxh3-64; off the event loop for a large payload) and
announces the transfer with an `Open` request to each receiver's inbox carrying those digests
(`kvbus.bus.chunking`); a receiver checks each chunk against them, so the content it delivers
is the one its sender's `Open` announced, whatever else arrives on the data subject. Chunks go
on a data subject under each receiver's prefix ending in the sender's name. A broadcast outside
secure mode publishes each chunk once on a shared broadcast subject and NATS fans it out; in
secure mode every receiver gets its own stream, so that only addressees can read it (NATS
permissions are per subject). Flow control is by credit: a sender keeps at most ``window``
chunks beyond the slowest receiver's acknowledged position. Receivers ask for missing or bad
chunks (resent to them only, on per-receiver streams); a sender without acknowledgements asks
each lagging receiver where it stands (`kvbus.bus.handshake`). Each receiver's acks come on a
subject ending in its name, and only those count.

While a transfer's bytes go on a direct path (``shm``, ``tcp``), only the acks and the verdict
that come on that path count: its stream is bound with the one-time token the receiver's reply
to this transfer's `Open` handed out, where outside secure mode any client may publish on a NATS
ack subject or answer a status request. The receiver sends its verdict on NATS as well; one that
comes there meanwhile is held, and taken only if the direct path fails and the transfer goes on
over NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry.trace import INVALID_SPAN, Span

from kvbus.bus.chunking import ChunkSource, digest_chunks, digests_root, stage, tree_digest
from kvbus.bus.config import OFFLOAD_BYTES, BusConfig
from kvbus.bus.errors import ReceiverGone, TransferError, TransferInDoubt, TransferRejected, TransferTimeout
from kvbus.bus.handshake import Handshake, ReceiverOutcome
from kvbus.bus.pacing import TokenBucket
from kvbus.bus.paths import DataPlane, PathError, Segment, TransferSpec
from kvbus.bus.route import Route
from kvbus.codecs import Encoded
from kvbus.net.transport import NoResponders, Transport
from kvbus.protocol import (
    CHUNK_INDEX_HEADER,
    Ack,
    Open,
    OpenReply,
    PathName,
    Reason,
    ack_subject,
    bcast_subject,
    data_subject,
)

logger = logging.getLogger(__name__)

__all__ = ["OutgoingTransfer", "StreamPacing", "StreamPayload", "StreamPaths", "StreamStats"]

#: Seconds to wait, per reply for another transfer received so far, before asking a receiver
#: again (a client answering every `Open` with other ids does not make its sender spin).
FOREIGN_BACKOFF_S = 0.02


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
    expired_pauses: int = 0
    """Pauses that outlasted `OutgoingTransfer.max_pause_s` without a resume (the transfer went on)."""
    rate_changes: int = 0
    fallbacks: int = 0
    """Times a direct path failed and the transfer went on over NATS."""
    paused_s: float = 0.0
    """Time spent paused."""
    hash_s: float = 0.0
    """Time spent hashing the chunks before the `Open`."""
    started: float = field(default_factory=time.perf_counter)
    finished: float = 0.0


@dataclass(frozen=True, slots=True)
class StreamPayload:
    """What one outgoing transfer carries, from whom and to whom."""

    transfer_id: str
    src: str
    """The sending agent."""
    receivers: list[str]
    encoded: Encoded
    """The payload in its granted medium: its codec spec and meta go into the `Open`, its
    buffers are the chunks' bytes."""
    idempotency_key: str = ""
    """The send's idempotency key ("" for none)."""
    label: str = ""
    """The send's label ("" for none)."""
    traceparent: str | None = None
    """The sender's span context for the `Open` (None: the sender does not trace)."""
    trace_link: str | None = None
    """The scheduler's root span, sent in the `Open` when ``traceparent`` is None."""
    incarnations: Mapping[str, str] = field(default_factory=dict)
    """Per receiver, the incarnation it had when last heard from (one that restarted since lost our bases)."""
    streamed: bool = False
    """Never inline in the `Open`: the receiver starts work when the `Open` comes (`Codec.prepare`,
    ``split``'s prefill), which only pays while the payload is still on its way."""


@dataclass(frozen=True, slots=True)
class StreamPacing:
    """How fast one outgoing transfer may go: its chunking, credit window and rate."""

    chunk_size: int
    window: int
    """Chunks a sender keeps beyond the slowest receiver's acknowledged position."""
    rate_bps: float = 0.0
    """The granted rate (0: unpaced), when the transfer paces itself."""
    bucket: TokenBucket | None = None
    """The pacing it shares with the other transfers of its rate budget (None: its own, at ``rate_bps``)."""


@dataclass(frozen=True, slots=True)
class StreamPaths:
    """Where one outgoing transfer's bytes may go."""

    plane: DataPlane | None = None
    """The process's data plane, for a direct path to a single receiver (None: NATS only)."""
    per_receiver_streams: bool = False
    """A broadcast gives every receiver its own stream (secure mode) instead of one shared subject."""
    stage_shm: bool = False
    """Its one receiver was reached on ``shm`` last time: stage a large payload in a segment."""
    home: Segment | None = None
    """The segment the cache was built in (`Agent.kv_buffer`): a payload that lies in it as sent
    is hashed there and shared as it is, with no copy."""


class OutgoingTransfer:
    """The sender's side of one transfer to one or more receivers."""

    def __init__(
        self,
        transport: Transport,
        config: BusConfig,
        payload: StreamPayload,
        pacing: StreamPacing,
        paths: StreamPaths,
    ) -> None:
        """A transfer of ``payload``, paced by ``pacing``, its bytes on ``paths``.

        Args:
            transport: the NATS connection the `Open`, the chunks and the acks go through.
            config: the bus's settings (timeouts, the inline limit, repair limits).
        """
        transfer_id, src = payload.transfer_id, payload.src
        chunk_size, window, rate_bps = pacing.chunk_size, pacing.window, pacing.rate_bps
        buffers, plane = payload.encoded.buffers, paths.plane
        self.transport = transport
        self.transfer_id = transfer_id
        self.src = src
        self.receivers = list(payload.receivers)
        self.config = config
        self.window = window
        self.plan = ChunkSource(buffers, chunk_size)
        self.sizes = [b.nbytes for b in buffers]
        # Views for chunks within one buffer; small buffers packed together are joined once, by
        # `_prepare` (an inline payload needs none: its buffers go out as they are).
        self._chunks: list[memoryview | bytes] = []
        # One shared subject (a broadcast outside secure mode), else a stream per receiver.
        self.shared_subject = (
            bcast_subject(src, transfer_id) if len(self.receivers) > 1 and not paths.per_receiver_streams else None
        )
        # Direct paths carry transfers to one receiver; a broadcast's bytes go through NATS.
        self.plane = plane if plane is not None and len(self.receivers) == 1 else None
        offered = [p.kind.value for p in self.plane.paths] if self.plane is not None else [PathName.NATS.value]
        self.open = Open(
            transfer_id=transfer_id,
            src=src,
            codec=payload.encoded.codec,
            meta=payload.encoded.meta,
            sizes=self.sizes,
            total=self.plan.total,
            chunk_size=chunk_size,
            n_chunks=self.plan.n_chunks,
            digest="0" * 32,
            window=window,
            data_subject=self.shared_subject or data_subject(self.receivers[0], src, transfer_id),
            ack_subject=ack_subject(src, self.receivers[0]),
            inline=False,
            traceparent=payload.traceparent,
            paths=offered,
            host=self.plane.host if self.plane is not None else "",
            trace_link=None if payload.traceparent else payload.trace_link,
            idempotency_key=payload.idempotency_key,
            label=payload.label,
        )
        """The `Open` of the first receiver (before its digests are known); each gets its own."""
        # Inline when small enough and the framed Open (header + payload) fits the server's max_payload.
        room = transport.max_payload - len(self.open.encode()) - 1024
        if self.plan.total <= min(config.inline_limit, room) and not payload.streamed:
            self.open = dataclasses.replace(self.open, inline=True)
        known = payload.incarnations
        self.links: dict[str, Handshake] = {rx: Handshake(transport, rx, self.open) for rx in self.receivers}
        for rx, link in self.links.items():
            link.expected = known.get(rx, "")
        self.outcomes: dict[str, ReceiverOutcome] = {rx: link.outcome for rx, link in self.links.items()}
        # Its own pacing at the granted rate, or the pacing it shares with the other transfers
        # of the rate budget it runs under.
        self.bucket = pacing.bucket or TokenBucket(rate_bps, burst=max(chunk_size, rate_bps * 0.02))
        self._shared_pacing = pacing.bucket is not None
        self.stats = StreamStats()
        self._acked: dict[str, int] = {}
        self._held: dict[str, Ack] = {}
        """Per receiver: a verdict that came on NATS while the bytes went on a direct path (taken
        only should the transfer fall back to NATS)."""
        self._resend: dict[int, set[str]] = {}
        """Chunks to send again, each to the receivers that asked."""
        self._next = 0
        self._sent = 0
        """Chunks sent at least once, from the first (all of them: the receiver may have the payload)."""
        self._progress = asyncio.Event()
        self._running = asyncio.Event()
        self._running.set()
        self._paused_at = 0.0
        self.max_pause_s = min(config.grant_timeout, config.partial_timeout / 2)
        """The longest a pause holds the transfer without a resume (`_wait_while_paused`)."""
        self._started = False
        self.route: Route | None = None
        """The data path of a transfer to one receiver (None: NATS for every receiver)."""
        self.span: Span = INVALID_SPAN
        """The sender's ``kvbus.stream`` span: pause, resume and retransmit become its events."""
        self._last_progress = time.monotonic()
        self._stage_shm = paths.stage_shm
        """Its one receiver was reached on ``shm`` last time: stage a large payload in a segment."""
        self._segment: Segment | None = None
        """The shared segment the payload was staged in (`_staging`), held until the transfer ends."""
        self._home = paths.home

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
        self._progress.set()  # wake `_wait_while_paused`

    def set_rate(self, rate_bps: float) -> None:
        """Pace the rest of the transfer at ``rate_bps`` bytes/s (0 = unpaced)."""
        self.stats.rate_changes += 1
        self.bucket.set_rate(rate_bps, burst=max(self.plan.chunk_size, rate_bps * 0.02))
        if self.route is not None:
            self.route.repace()  # the bytes the kernel holds slow down too, not only the next chunk

    def cancel(self, reason: str) -> None:
        """Give up: every receiver still pending fails with ``reason``."""
        for outcome in self.outcomes.values():
            if outcome.pending:
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

    @property
    def restarted(self) -> list[str]:
        """Receivers this transfer met in another incarnation than earlier transfers did."""
        return [rx for rx, link in self.links.items() if link.restarted]

    # -- acks -------------------------------------------------------------------------------

    def on_ack(self, rx: str, ack: Ack, *, direct: bool = False) -> None:
        """Apply an acknowledgement from ``rx``: on its NATS ack subject (called by the agent's ack
        subscription), or on the transfer's direct path (``direct``, called by the `Route`).

        An ack for another transfer is dropped. While the bytes go on a direct path (or it is
        being opened), one from NATS does not count; a verdict among them is held (`_held`).
        """
        if ack.transfer_id != self.transfer_id:
            logger.warning("transfer %s: an ack for transfer %r dropped", self.transfer_id, ack.transfer_id[:64])
            return
        if not direct and self._direct_only:
            if ack.done:
                self._held[rx] = ack
            return
        outcome = self.outcomes.get(rx)
        if outcome is None or not outcome.pending:
            return
        if ack.done:
            if ack.ok:
                outcome.ok = True
                outcome.decode_s = ack.decode_s
            else:
                outcome.error = TransferRejected(
                    self.transfer_id, rx, ack.reason or "receiver gave up", code=ack.code or Reason.OTHER
                )
        else:
            if ack.next > self._acked.get(rx, 0):
                self._acked[rx] = min(ack.next, self.plan.n_chunks)
            for m in ack.missing[: self.config.max_missing]:
                if isinstance(m, int) and 0 <= m < self._next:
                    self._resend.setdefault(m, set()).add(rx)
        self._last_progress = time.monotonic()
        self._progress.set()

    @property
    def _direct_only(self) -> bool:
        """Whether only the direct path's acks count: one is up or being opened for this
        transfer's one receiver (a streamed transfer with a data plane, until it uses NATS)."""
        if self.plane is None or self.open.inline:
            return False
        return self.route is None or self.route.bound

    def _take_held(self, rx: str) -> None:
        """The transfer goes on NATS after all: a verdict that came there meanwhile counts now."""
        if not self._direct_only:
            held = self._held.pop(rx, None)
            if held is not None:
                self.on_ack(rx, held)

    def _active(self) -> list[str]:
        return [rx for rx, o in self.outcomes.items() if o.pending]

    # -- the run ------------------------------------------------------------------------------

    async def run(self) -> dict[str, ReceiverOutcome]:
        """Hash, open, stream and wait for every receiver's verdict; never raises for a receiver's failure."""
        await self._prepare()
        inline = self.open.inline
        payload: list[memoryview] = list(self.plan.buffers) if inline else []  # sent as they are
        # Paused before it started (preempted while encoding): start when resumed.
        await self._wait_while_paused()
        if not self._active():
            return self.outcomes
        self._started = True
        if inline and self._shared_pacing:
            # Under a rate budget the whole payload (one message, the `Open`) goes once what
            # earlier transfers of the budget still owe is earned, and is paid for after: the
            # budget's next transfer waits for it, and the scheduler holds the budgets' use out
            # of the shares it gives. Paid before, a 64 KB critical message granted most of a
            # 320 Mbit/s link waited 1.9 ms and then crossed the link as fast as ever.
            await self.bucket.take(0)
            self.bucket.charge(self.plan.total)
        elif inline:
            # A granted transfer's own pacing has no next transfer to pay later: it pays first
            # (0 = unpaced takes no time), else its bytes would escape the rate, and the
            # inter-group lease, altogether (a0f08cd, reverted).
            await self.bucket.take(self.plan.total)
        try:
            await asyncio.gather(*(self._open(link, payload) for link in self.links.values()))
            if not inline:
                await self._stream()
        finally:
            if self.route is not None:
                await self.route.close(completed=not self._active() and all(o.ok for o in self.outcomes.values()))
            segment, self._segment = self._segment, None
            if segment is not None and segment is not self._home and self.plane is not None:
                self.plane.release(segment)
        self.stats.finished = time.perf_counter()
        for rx, outcome in self.outcomes.items():
            if outcome.error is not None and self._in_doubt(self.links[rx], outcome.error):
                outcome.error = TransferInDoubt(outcome.error)
        return self.outcomes

    def _in_doubt(self, link: Handshake, error: TransferError) -> bool:
        """Whether ``link``'s receiver may have delivered the payload although ``error`` failed it:
        every byte may have reached it (the inline `Open` went out, or every chunk did at least
        once) and no verdict of its own says it did not."""
        if isinstance(error, TransferInDoubt):
            return False
        if isinstance(error, TransferRejected):
            # A refusal is the receiver's verdict, except one that says an earlier incarnation, or
            # a transfer with the same key still under way, may deliver it.
            if error.code not in (Reason.RECEIVER_RESTARTED, Reason.KEY_IN_PROGRESS, Reason.CANCELLED):
                return False
            if error.code is Reason.KEY_IN_PROGRESS:
                return True
        if not link.attempts:
            return False  # no Open went out
        if self.open.inline or not self.plan.n_chunks:
            # The payload travels in the Open: anything but "nobody listens" may hide a delivery.
            return not isinstance(error, ReceiverGone)
        return self._sent >= self.plan.n_chunks

    @property
    def path(self) -> str:
        """The data path the bytes took last (``nats`` for an inline payload or a broadcast)."""
        return self.route.path if self.route is not None and self.route.used else PathName.NATS.value

    @property
    def paths_used(self) -> list[str]:
        """Every path the bytes took, in order (a direct path that failed, then ``nats``)."""
        return list(self.route.used) if self.route is not None and self.route.used else [PathName.NATS.value]

    async def _prepare(self) -> None:
        """Hash every chunk and give each receiver its `Open` (with its own data and ack subjects)."""
        t0 = time.perf_counter()
        if self.open.inline:
            digest = tree_digest([self.plan.digest(i) for i in range(self.plan.n_chunks)], self.plan.total)
            digests = b""
        else:
            segment = await self._in_home()
            if segment is not None:
                # Built in a shared segment (`Agent.kv_buffer`) and frozen: hashed where it lies,
                # in two threads, and shared as it is; nothing is copied.
                self._segment = segment
                digests = await stage(self.plan, segment.view)
                self._chunks = [segment.view[lo:hi] for lo, hi in self.plan.plan.ranges]
            elif (segment := self._staging()) is not None:
                # Same host as last time: copy the payload straight into a shared segment and
                # hash it there (one pass, two cores); ``shm`` then sends only frame headers.
                self._segment = segment
                digests = await stage(self.plan, segment.view)
                self._chunks = [segment.view[lo:hi] for lo, hi in self.plan.plan.ranges]
            else:
                self._chunks = [self.plan.chunk(i) for i in range(self.plan.n_chunks)]
                if self.plan.total > OFFLOAD_BYTES:
                    digests = await asyncio.to_thread(digest_chunks, self._chunks)
                else:
                    digests = digest_chunks(self._chunks)
            digest = digests_root(digests, self.plan.total)
        self.stats.hash_s = time.perf_counter() - t0
        self.open = dataclasses.replace(self.open, digest=digest, digests=digests)
        for rx, link in self.links.items():
            link.open = dataclasses.replace(
                self.open,
                data_subject=self.shared_subject or data_subject(rx, self.src, self.transfer_id),
                ack_subject=ack_subject(self.src, rx),
            )

    async def _in_home(self) -> Segment | None:
        """The segment the cache was built in, frozen, when the payload lies in it buffer for
        buffer at its payload offsets (the ``full`` medium of an untouched `Agent.kv_buffer`)."""
        seg = self._home
        if seg is None or seg.fd < 0 or self.plan.total > seg.nbytes:
            return None
        if not all(self.plan.in_place(seg.address)):
            return None
        if seg.frozen:
            # Sent before: it is the payload only while the producer has not written since (a
            # read of 2 bytes per 4 KB page: about 1 ms at 64 MB, off the event loop).
            return seg if await asyncio.to_thread(seg.untouched) else None
        seg.freeze()  # (when the kernel refuses, it stays sealed against other processes)
        return seg

    def _staging(self) -> Segment | None:
        """A shared segment to stage a large payload in, when its one receiver was reached on ``shm`` last time."""
        plane = self.plane
        if plane is None or not self._stage_shm or self.plan.total <= OFFLOAD_BYTES:
            return None
        try:
            return plane.segment(self.plan.total)
        except OSError:
            return None  # no memory for it: the chunks are copied as they go

    async def _open(self, link: Handshake, payload: Sequence[memoryview]) -> None:
        outcome = link.outcome
        # An unanswered Open is asked again (the same transfer id: a receiver that got the first
        # one answers with where it stands) until ``peer_timeout``: a request lost while the
        # server restarted or the receiver was busy does not fail the transfer.
        started = time.monotonic()
        give_up = started + max(self.config.peer_timeout, self.config.request_timeout)
        reply: OpenReply | None = None
        while True:
            left = give_up - time.monotonic()
            try:
                data = await link.ask(link.frame(payload), timeout=min(self.config.request_timeout, max(left, 0.001)))
            except NoResponders:
                outcome.error = ReceiverGone(self.transfer_id, link.rx, "no agent listens on its inbox")
                return
            except TimeoutError:
                data = None
            if data is not None:
                reply = link.apply(data)
                if reply is not None or not outcome.pending:
                    break
                # A reply for another transfer (outside secure mode anyone may answer an Open):
                # it decides nothing; ask again, a little later each time.
                await asyncio.sleep(min(FOREIGN_BACKOFF_S * link.foreign, max(0.0, give_up - time.monotonic())))
            if time.monotonic() >= give_up - 1e-3:
                foreign = f" ({link.foreign} replies for other transfers ignored)" if link.foreign else ""
                outcome.error = TransferTimeout(
                    self.transfer_id,
                    f"waiting for {link.rx} to accept{foreign}",
                    time.monotonic() - started,
                    link.rx,
                )
                return
            self.span.add_event("open.retry", {"kvbus.receiver": link.rx})
        if reply is not None:
            self._acked[link.rx] = max(self._acked.get(link.rx, 0), reply.next)
            if self.plane is not None and not self.open.inline:
                await self._route(link, reply)

    async def _route(self, link: Handshake, reply: OpenReply) -> None:
        """Choose the receiver's data path from its reply (a direct one when offered and it opens)."""
        spec = TransferSpec.of(
            self.transfer_id, self.src, link.rx, self.plan.plan.ranges, data_subject=link.open.data_subject
        )
        assert self.plane is not None  # checked by the caller
        route = Route(
            self.plane,
            spec,
            self.open.digests,
            segment=self._segment,
            on_ack=lambda ack: self.on_ack(link.rx, ack, direct=True),
            on_lost=lambda error: self._path_lost(link.rx, error),
            pacer=self.bucket,
        )
        self.route = route
        error = await route.open(reply)
        if error is not None and link.outcome.pending:
            link.outcome.error = error
        self._take_held(link.rx)
        self.span.set_attribute("kvbus.path", route.path)

    def _path_lost(self, rx: str, error: PathError) -> None:
        """The direct path to ``rx`` failed: go on over NATS from its last acknowledged chunk (or fail)."""
        outcome = self.outcomes[rx]
        if not outcome.pending:
            return
        self.stats.fallbacks += 1
        self.span.add_event("path.fallback", {"kvbus.path": error.path, "kvbus.receiver": rx})
        if self.route is None or not self.route.fall_back():
            outcome.error = TransferError(
                self.transfer_id, f"the {error.path} path failed and NATS is not allowed: {error.detail}", peer=rx
            )
        else:
            # Chunks past the last acknowledgement may be lost with the path: send them again on
            # NATS (the receiver drops the ones it has), nothing acknowledged is sent twice.
            self._next = min(self._next, self._acked.get(rx, 0))
            self._resend = {i: r for i, r in self._resend.items() if i < self._next}
            self._take_held(rx)
        self._last_progress = time.monotonic()
        self._progress.set()

    def _subjects(self, receivers: set[str] | None) -> list[str]:
        """Where a chunk goes: the shared subject, or the streams of ``receivers`` (default: all pending)."""
        if self.shared_subject is not None:
            return [self.shared_subject]
        wanted = self._active() if receivers is None else [rx for rx in self._active() if rx in receivers]
        return [self.links[rx].open.data_subject for rx in wanted]

    async def _send_chunk(self, index: int, receivers: set[str] | None = None) -> None:
        if index == self._sent:
            self._sent += 1  # before the send: once it starts, the chunk may arrive
        data = self._chunks[index]
        route = self.route
        if route is not None and route.session is not None:
            await self.bucket.take(len(data))  # the granted rate paces every path
            if await route.send(index, data):
                self.stats.chunks_sent += 1
                self.stats.bytes_sent += len(data)
            return  # not sent: the path broke, `_path_lost` rewound the stream
        headers = {CHUNK_INDEX_HEADER: str(index)}
        for subject in self._subjects(receivers):
            await self.bucket.take(len(data))
            # Zero-copy on the connection; a `TransportWrapper` (a fault injector) sees it as a publish.
            await self.transport.publish_views(subject, [data], headers=headers)
            self.stats.chunks_sent += 1
            self.stats.bytes_sent += len(data)

    async def _stream(self) -> None:
        n = self.plan.n_chunks
        while True:
            window = n if self.route is not None and self.route.windowless else self.window
            active = self._active()
            if not active:
                return
            if not self._running.is_set():
                await self._wait_while_paused()
                continue
            if self._resend:
                index = min(self._resend)
                receivers = self._resend.pop(index)
                self.stats.retransmits += 1
                self.span.add_event("retransmit", {"kvbus.chunk": index})
                await self._send_chunk(index, receivers)
                continue
            low = min(self._acked.get(rx, 0) for rx in active)
            if self._next < n and self._next < low + window:
                index = self._next
                self._next += 1  # before the send: a fall back during it rewinds from here
                await self._send_chunk(index)
                continue
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), self.config.ack_timeout)
            except TimeoutError:
                await self._stalled()

    async def _wait_while_paused(self) -> None:
        """Wait for `resume`, or until no receiver is pending (a verdict or a cancel came), but
        not for ever: a scheduler that forgot the pause (it restarted, or its leader failed over)
        never sends the resume. Past `max_pause_s` the transfer goes on by itself, while its
        receiver still keeps the partial (`partial_timeout`)."""
        while not self._running.is_set() and self._active():
            left = self._paused_at + self.max_pause_s - time.monotonic()
            if left <= 0:
                logger.warning(
                    "transfer %s: paused for %.1f s without a resume; going on", self.transfer_id, self.max_pause_s
                )
                self.span.add_event("pause.expired", {"kvbus.fraction_sent": self.fraction_sent})
                self.stats.expired_pauses += 1
                self.resume()
                return
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), left)

    async def _stalled(self) -> None:
        """No ack for a while: ask each lagging receiver where it stands (this also tells if it is alive)."""
        waited = time.monotonic() - self._last_progress
        for rx in self._active():
            link = self.links[rx]
            try:
                data = await link.ask(link.frame(), timeout=self.config.request_timeout)
            except NoResponders:
                link.outcome.error = ReceiverGone(self.transfer_id, rx, "it stopped answering mid-transfer")
                continue
            except Exception:  # noqa: BLE001 - timeouts count as no progress
                data = None
            # While the bytes go on a direct path, its verdict counts, not a status reply's.
            reply = link.apply(data, verdict=not self._direct_only) if data is not None else None
            if not link.outcome.pending:
                continue
            if waited > self.config.peer_timeout:
                link.outcome.error = TransferTimeout(self.transfer_id, f"streaming to {rx}", waited, rx)
            elif reply is not None:
                # Tail loss: resend what it has not got, up to a window's worth.
                start = max(reply.next, self._acked.get(rx, 0))
                self._acked[rx] = start
                for i in range(start, min(self._next, start + self.window)):
                    self._resend.setdefault(i, set()).add(rx)
                logger.info("transfer %s: %s stalled at chunk %d, resending", self.transfer_id, rx, start)
                self.span.add_event("stalled", {"kvbus.receiver": rx, "kvbus.chunk": start})
