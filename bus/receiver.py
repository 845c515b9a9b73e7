"""The receiving side of an agent: `Open` requests, reassembly, verification, decode, delivery.

An `Open` on the agent's inbox is checked (sender, sizes and counts before anything is
allocated, codec, model signature, chunk plan and digests, subjects) and refused with a
`Reason` code when it does not pass. An inline payload is verified and decoded at once; a
streamed one gets an `IncomingTransfer` (within the caps of `PartialTransfers`) whose last
chunk calls `Receiver.finish`. Decoded contexts go to the agent's `Inbox`; completed transfer
ids are remembered so that an `Open` asked again is answered, not delivered twice (so is one
that comes while its transfer's last chunk is being verified and decoded), and each
agent start is a new incarnation that refuses a retried `Open` an earlier one may have
delivered (`Reason.RECEIVER_RESTARTED`). A send's idempotency key is remembered with its
delivery too (before the verdict goes out): a new transfer from the same sender with the same
key (a retry after `TransferInDoubt`) is answered "done" without a second delivery, and one
that comes while the first is still under way is refused with `Reason.KEY_IN_PROGRESS`. A
private copy of the last context from each sender is kept as the base delta media decode
against (deliveries never alias it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg
from opentelemetry.trace import INVALID_SPAN, SpanKind

from kvbus import telemetry
from kvbus.bus.bases import base_copy, twin_base
from kvbus.bus.chunking import ChunkPlan, check_open_plan, split_inline
from kvbus.bus.config import COPY_INLINE_BYTES, OFFLOAD_BYTES
from kvbus.bus.endpoint import Endpoint
from kvbus.bus.errors import PayloadTooLarge
from kvbus.bus.inbox import Inbox
from kvbus.bus.incoming import IncomingTransfer
from kvbus.bus.partials import PartialTransfers
from kvbus.bus.paths import DataPlane, TransferSpec
from kvbus.bus.types import Delivery
from kvbus.codecs import Encoded, get_codec
from kvbus.codecs.errors import CodecError, DecodeError, DeltaBaseMismatch, RecomputeUnavailable
from kvbus.errors import KVBusError, SignatureMismatch, WireFormatError
from kvbus.kvcache import KVCache
from kvbus.net.transport import Transport
from kvbus.protocol import (
    Open,
    OpenOverLimit,
    OpenReply,
    Reason,
    ack_subject,
    check_data_subject,
    check_name,
    data_subject,
    subject_sender,
)
from kvbus.signature import ModelSignature

logger = logging.getLogger(__name__)

#: Bytes per chunk a direct-path offer holds besides the partial's own bookkeeping (the
#: `TransferSpec` ranges and the paths' chunk marks), counted against ``max_partial_overhead``.
DIRECT_OVERHEAD_PER_CHUNK = 128
#: Completed transfer ids remembered for de-duplication.
COMPLETED_MEMORY = 4096
#: A retried `Open` that names no incarnation is refused by an incarnation younger than the
#: retry's age plus this (seconds, at least): the retry may have spent that long in transit.
RETRY_MARGIN_S = 1.0


def key_entry(sender: str, key: str) -> str:
    """Where a delivered send's idempotency key is remembered, among the completed transfer ids
    (a newline is in no transfer id: the two never meet)."""
    return f"{sender}\n{key}"


def _refuse(transfer_id: str, code: Reason, reason: str) -> OpenReply:
    return OpenReply(transfer_id=transfer_id, ok=False, reason=reason, code=code)


def decode_failure(exc: KVBusError) -> tuple[Reason, str]:
    """The code and text a receiver refuses with when a payload does not decode into a usable context."""
    if isinstance(exc, DeltaBaseMismatch):
        code = Reason.DELTA_BASE_MISMATCH
    elif isinstance(exc, (SignatureMismatch, RecomputeUnavailable)):
        code = Reason.INCOMPATIBLE
    else:
        code = Reason.DECODE_FAILED
    return code, f"cannot decode ({type(exc).__name__}): {exc}"


@dataclass(frozen=True, slots=True)
class ReceiveSettings:
    """What the receiving side needs from the bus the agent is registered on (made by `Agent`)."""

    secure: bool
    """Per-agent permissions: no broadcast's shared data subject, each receiver has its own stream."""
    plane: DataPlane | None
    """The process's data plane (started before the first agent registers), or None: NATS only."""
    server: Transport
    """The bus's own NATS connection: its max_payload bounds an `Open`'s chunk size (whatever
    wrapper a test swaps in for the agent's transport)."""


class Receiver:
    """Receives contexts for one agent and puts them in its inbox."""

    def __init__(
        self,
        endpoint: Endpoint,
        inbox: Inbox,
        settings: ReceiveSettings,
        completed: collections.OrderedDict[str, float] | None = None,
    ) -> None:
        self._ep = endpoint
        self._settings = settings
        self.inbox = inbox
        self.incoming = PartialTransfers(endpoint.config)
        """Streamed transfers being reassembled, by id, within the partial caps."""
        self.completed: collections.OrderedDict[str, float] = (
            collections.OrderedDict() if completed is None else completed
        )
        """Ids of delivered transfers (the last `COMPLETED_MEMORY`), for de-duplication. The bus
        passes the memory of the agent's name, so an agent that closes and registers again on the
        same bus still answers a repeated `Open` of a transfer it delivered with "done"."""
        self.bases: dict[str, KVCache] = {}
        """Per sender: a private copy of the last context received from it (the base delta media
        decode against); deliveries never share its storage."""
        self._handover: asyncio.Task[None] | None = None
        """The last delivery waiting for its base copy before it goes into the inbox (they go in order)."""
        self._reading: collections.Counter[str] = collections.Counter()
        """Per sender: decodes running in a thread with its base."""
        self.finishing: dict[str, IncomingTransfer] = {}
        """Streamed transfers whose last chunk is in, while they are verified and decoded (no longer
        partial, not yet completed): an `Open` asked again meanwhile learns that every chunk is in
        and waits for the verdict, rather than starting the transfer over (a second delivery)."""
        self.keyed: collections.OrderedDict[str, str] = collections.OrderedDict()
        """Idempotency keys of streamed transfers under way (`key_entry` -> transfer id)."""
        self.incarnation = secrets.token_hex(8)
        """This agent start's id, in every `OpenReply`: a retried `Open` for another is refused."""
        self.started = time.monotonic()

    @property
    def partial_transfers(self) -> int:
        """Incoming transfers still being reassembled."""
        return len(self.incoming)

    async def stop(self) -> None:
        """Drop every partial transfer (the agent is closing)."""
        if self._handover is not None:
            self._handover.cancel()
        await self.incoming.stop()

    # -- Open -----------------------------------------------------------------------------------

    async def on_open(self, msg: Msg) -> None:
        """The agent's inbox subject: answer an `Open` (or a sender asking where it stands)."""
        try:
            reply = await self._handle_open(msg)
        except Exception as exc:
            logger.exception("agent %s: error handling an open request", self._ep.name)
            reply = _refuse("", Reason.INTERNAL, f"internal error: {exc}")
        reply = dataclasses.replace(reply, incarnation=self.incarnation)
        await self._ep.transport.reply(msg, reply.encode())

    async def _handle_open(self, msg: Msg) -> OpenReply:
        ep = self._ep
        try:
            open_msg, inline = Open.unframe(msg.data)
        except OpenOverLimit as exc:
            return _refuse("", Reason.TOO_LARGE, str(exc))
        except WireFormatError as exc:
            return _refuse("", Reason.MALFORMED, str(exc))
        # Every size and count is bounded from here on (Open.check): what follows allocates
        # at most O(MAX_CHUNKS + MAX_BUFFERS), and only after the receiver's own limits passed.
        tid = open_msg.transfer_id
        sender = subject_sender(msg.subject)
        if open_msg.src != sender:
            return _refuse(tid, Reason.WRONG_SENDER, f"an Open from {open_msg.src!r} came on the inbox of {sender!r}")
        if tid in self.completed:
            return OpenReply(transfer_id=tid, ok=True, done=True)
        active = self.incoming.get(tid) or self.finishing.get(tid)
        if active is not None:
            return self._status(active)
        key = open_msg.idempotency_key
        if key:
            entry = key_entry(sender, key)
            if entry in self.completed:
                logger.info("transfer %s from %s: its key was delivered already; answering done", tid, sender)
                return OpenReply(transfer_id=tid, ok=True, done=True)
            first = self.keyed.get(entry)
            if first is not None and (self.incoming.get(first) or self.finishing.get(first)):
                return _refuse(tid, Reason.KEY_IN_PROGRESS, f"transfer {first} with the same key is still under way")
        restarted = self._restarted(open_msg)
        if restarted:
            logger.warning("transfer %s from %s: %s", tid, open_msg.src, restarted)
            return _refuse(tid, Reason.RECEIVER_RESTARTED, restarted)
        limit = ep.config.max_transfer_bytes
        if open_msg.total > limit:
            return _refuse(tid, Reason.TOO_LARGE, str(PayloadTooLarge("payload", open_msg.total, limit)))
        if not open_msg.inline and self.incoming.too_large(open_msg.total):
            limit = ep.config.max_partial_bytes
            return _refuse(tid, Reason.TOO_LARGE, str(PayloadTooLarge("partial transfer", open_msg.total, limit)))
        max_payload = self._settings.server.max_payload
        if open_msg.chunk_size > max_payload:
            return _refuse(
                tid,
                Reason.TOO_LARGE,
                f"chunk size {open_msg.chunk_size} is over the server's max_payload {max_payload}",
            )
        try:
            codec = get_codec(open_msg.codec)
        except CodecError as exc:
            return _refuse(tid, Reason.UNKNOWN_CODEC, str(exc))
        code, problem = self._check_signature(codec, open_msg.meta)
        if problem:
            return _refuse(tid, code, problem)
        try:
            plan = check_open_plan(open_msg)
        except WireFormatError as exc:
            return _refuse(tid, Reason.MALFORMED, str(exc))
        if open_msg.inline:
            return await self._receive_inline(open_msg, inline, plan)
        # A streamed transfer makes this agent subscribe and publish: only on the subjects the
        # protocol names for it, never where a hostile Open points.
        try:
            check_name("agent", open_msg.src)
            check_name("transfer", tid)
            check_data_subject(open_msg.data_subject, open_msg.src, ep.name, tid, broadcast=not self._settings.secure)
            want = ack_subject(open_msg.src, ep.name)
            if open_msg.ack_subject != want:
                raise WireFormatError("open message", f"ack subject must be {want!r}")
        except (ValueError, WireFormatError) as exc:
            return _refuse(tid, Reason.MALFORMED, str(exc))
        try:
            work = codec.prepare(open_msg.meta, ep.runner)
        except CodecError as exc:
            return _refuse(tid, Reason.MALFORMED, str(exc))
        incoming = IncomingTransfer(ep.transport, open_msg, ep.name, ep.config, self.finish, plan)
        if self._settings.plane is not None and any(p != "nats" for p in open_msg.paths):
            # A direct offer keeps the chunk layout once more (the path's `TransferSpec`).
            incoming.overhead += DIRECT_OVERHEAD_PER_CHUNK * open_msg.n_chunks
        await self.incoming.make_room(incoming)
        receive_span = _receive_span(ep.name, open_msg)
        incoming.spans = (receive_span, telemetry.start("kvbus.reassemble", parent=receive_span, lazy=True))
        self.incoming.add(incoming)
        if key:
            self.keyed[key_entry(sender, key)] = tid
            while len(self.keyed) > COMPLETED_MEMORY:
                self.keyed.popitem(last=False)
        await incoming.start()
        if work is not None:
            incoming.prepared = asyncio.ensure_future(self._prepared(work))
        return self._offer(incoming, plan)

    async def _prepared(self, work: Callable[[], KVCache]) -> KVCache:
        """Run a codec's early work (`Codec.prepare`: ``split``'s prefill) in a worker thread while
        the chunks stream in; its prefill speed is this agent's, measured under that load."""
        t0 = time.perf_counter()
        kv = await asyncio.to_thread(work)
        self._ep.prefill.observe(kv.seq_len, time.perf_counter() - t0, 0)
        return kv

    def _offer(self, incoming: IncomingTransfer, plan: ChunkPlan) -> OpenReply:
        """The reply to a streamed transfer's first `Open`: the paths this receiver takes it on,
        and for the direct ones a one-time token (NATS only for a broadcast's shared subject)."""
        open_msg = incoming.open
        tid = open_msg.transfer_id
        plane = self._settings.plane
        if plane is None or open_msg.data_subject != data_subject(self._ep.name, open_msg.src, tid):
            return OpenReply(transfer_id=tid, ok=True, paths=["nats"])
        paths = plane.accepted_paths(open_msg.paths, open_msg.host)
        incoming.paths = paths or ["nats"]
        spec = TransferSpec.of(tid, open_msg.src, self._ep.name, plan.ranges, data_subject=open_msg.data_subject)
        offer = plane.offer_direct(spec, incoming, paths)
        if offer is None:
            return OpenReply(transfer_id=tid, ok=True, paths=incoming.paths)
        incoming.plane = plane
        return OpenReply(transfer_id=tid, ok=True, paths=incoming.paths, **offer.reply_fields())

    def _status(self, active: IncomingTransfer) -> OpenReply:
        """The reply to a retried `Open` of a transfer under way: where it stands, and a fresh token
        while no direct path is bound yet (the first reply may have been lost)."""
        tid = active.open.transfer_id
        offer = active.plane.reoffer(tid) if active.plane is not None and not active.via else None
        fields = offer.reply_fields() if offer is not None else {}
        return OpenReply(transfer_id=tid, ok=True, next=active.next, paths=active.paths, **fields)

    def _restarted(self, open_msg: Open) -> str:
        """Why this incarnation must refuse a retried `Open` of a transfer it does not know ('' when it may take it).

        A retry (or status request) naming another incarnation went to an agent that restarted
        since: the earlier one may have delivered the transfer. One that names none (its sender
        never got a reply) is taken only by an incarnation that was already running when the
        first attempt was sent, so that no earlier one can have had it.
        """
        if open_msg.attempt == 0:
            return ""
        if open_msg.incarnation:
            if open_msg.incarnation == self.incarnation:
                return ""
            return (
                f"retried Open for incarnation {open_msg.incarnation!r} reached incarnation "
                f"{self.incarnation!r}: the receiver restarted and may have delivered it before"
            )
        uptime = time.monotonic() - self.started
        margin = max(RETRY_MARGIN_S, self._ep.config.request_timeout)
        if uptime < open_msg.retry_age + margin:
            return (
                f"retried Open first sent {open_msg.retry_age:.1f} s ago reached an agent running for "
                f"{uptime:.1f} s: an earlier incarnation may have delivered it"
            )
        return ""

    async def _receive_inline(self, open_msg: Open, inline: memoryview, plan: ChunkPlan) -> OpenReply:
        tid = open_msg.transfer_id
        if len(inline) != open_msg.total:
            return _refuse(tid, Reason.MALFORMED, "inline payload has the wrong size")
        buffers, digest = split_inline(open_msg, inline, plan)
        if digest != open_msg.digest:
            return _refuse(tid, Reason.DIGEST_MISMATCH, "inline payload failed its checksum")
        t0 = time.perf_counter()
        with telemetry.using(_receive_span(self._ep.name, open_msg)) as receive_span:
            try:
                delivery = await self._decode(open_msg, buffers, 0.0, region=(inline, plan.starts))
            except KVBusError as exc:
                telemetry.fail(receive_span, exc)
                return _refuse(tid, *decode_failure(exc))
        self._deliver(delivery, key=open_msg.idempotency_key)
        return OpenReply(transfer_id=tid, ok=True, done=True, decode_s=time.perf_counter() - t0)

    def _check_signature(self, codec: Any, meta: dict) -> tuple[Reason, str]:
        """Why a KV medium cannot be used by this agent (code and text), or ``(NONE, '')`` when it can."""
        if not codec.needs_kv:
            return Reason.NONE, ""
        ep = self._ep
        if ep.signature is None:
            return Reason.INCOMPATIBLE, (
                f"agent {ep.name} has no model signature and accepts only token media, not {codec.name!r}"
            )
        try:
            sender = ModelSignature.from_dict(meta.get("signature"))
        except WireFormatError as exc:
            return Reason.MALFORMED, str(exc)
        if not sender.compatible_with(ep.signature):
            return Reason.INCOMPATIBLE, (
                f"KV from model {sender.model} ({sender.digest()}) cannot be used by "
                f"{ep.name}'s model {ep.signature.model} ({ep.signature.digest()}); "
                f"send tokens or a summary"
            )
        return Reason.NONE, ""

    # -- streamed transfers ---------------------------------------------------------------------

    async def finish(self, incoming: IncomingTransfer) -> None:
        """The last chunk of a streamed transfer is in: verify, decode, deliver, send the verdict."""
        tid = incoming.open.transfer_id
        if self.incoming.pop(tid) is None:
            return  # dropped (evicted or the agent closed) after its last chunk came in: its sender knows
        # From here until it is delivered (or refused) the transfer is neither partial nor
        # completed: `finishing` answers an Open asked again meanwhile (all chunks in, verdict to come).
        self.finishing[tid] = incoming
        try:
            await self._finish(incoming)
        finally:
            self.finishing.pop(tid, None)
            key = incoming.open.idempotency_key
            if key and self.keyed.get(key_entry(incoming.open.src, key)) == tid:
                del self.keyed[key_entry(incoming.open.src, key)]

    async def _finish(self, incoming: IncomingTransfer) -> None:
        tid = incoming.open.transfer_id
        transfer_s = time.perf_counter() - incoming.started
        receive_span, reassemble_span = incoming.spans
        with telemetry.using(receive_span):
            with telemetry.using(reassemble_span, current=False):
                if reassemble_span.is_recording():
                    reassemble_span.set_attributes(
                        {
                            "kvbus.chunks": incoming.count,
                            "kvbus.corrupt": incoming.corrupt,
                            "kvbus.duplicates": incoming.duplicates,
                            "kvbus.path": ",".join(sorted(incoming.via)) or "nats",
                        }
                    )
                verified = incoming.verify()
            if not verified:  # every chunk passed its digest on arrival: cannot happen
                logger.error("transfer %s: incomplete after reassembly", tid)
                await incoming.report(ok=False, reason="incomplete after reassembly", code=Reason.INTERNAL)
                return
            t0 = time.perf_counter()
            try:
                buffers = incoming.buffers()
                delivery = await self._decode(
                    incoming.opened(), buffers, transfer_s, region=incoming.region, prepared=incoming.prepared
                )
            except KVBusError as exc:
                telemetry.fail(receive_span, exc)
                code, reason = decode_failure(exc)
                await incoming.report(ok=False, reason=reason, code=code)
                return
            decode_s = time.perf_counter() - t0
            self._deliver(delivery, twins=incoming.twins, key=incoming.open.idempotency_key)
            await incoming.report(ok=True, decode_s=decode_s)

    async def janitor(self) -> None:
        """Drop partial transfers without valid progress for ``partial_timeout`` (runs until cancelled)."""
        config = self._ep.config
        period = min(1.0, config.partial_timeout / 4)
        while True:
            await asyncio.sleep(period)
            await self.incoming.expire()

    # -- decode and deliver ---------------------------------------------------------------------

    async def _decode(
        self,
        open_msg: Open,
        buffers: list[memoryview],
        transfer_s: float,
        *,
        region: tuple[memoryview, Sequence[int]] | None = None,
        prepared: asyncio.Future[KVCache] | None = None,
    ) -> Delivery:
        ep = self._ep
        codec = get_codec(open_msg.codec)
        encoded = Encoded(codec=open_msg.codec, meta=open_msg.meta, buffers=buffers)
        if region is not None:
            encoded.region, encoded.offsets = region  # the buffers are slices of it at these offsets
        t0 = time.perf_counter()
        heavy = not codec.cheap_decode and (open_msg.total > OFFLOAD_BYTES or not codec.needs_kv or codec.recomputes)
        if self._handover is not None:
            await asyncio.shield(self._handover)  # the base copy of the last delivery is made
        base = self.bases.get(open_msg.src)
        if prepared is not None:
            # What the codec started when the Open came (`split`: the prefix's KV) is its base.
            try:
                base = await prepared
            except Exception as exc:  # the model failed on ids the codec checked
                raise DecodeError(open_msg.codec, f"the prefill started on the Open failed: {exc}") from exc
        attributes = {"kvbus.medium": open_msg.codec, "kvbus.bytes": open_msg.total} if telemetry.tracing() else None
        with (
            telemetry.span("kvbus.decode", attributes=attributes, current=not codec.needs_kv, lazy=True),
            contextlib.nullcontext() if codec.needs_kv else telemetry.span("kvbus.recompute", current=False, lazy=True),
        ):
            # A medium without KV is decoded by prefilling its tokens: that is the recompute.
            if heavy:
                self._reading[open_msg.src] += 1  # the base must not be copied over meanwhile
                try:
                    kv = await asyncio.to_thread(codec.decode, encoded, base=base, runner=ep.runner)
                finally:
                    self._reading[open_msg.src] -= 1
            else:
                kv = codec.decode(encoded, base=base, runner=ep.runner)
        decode_s = time.perf_counter() - t0
        if not codec.needs_kv and kv.has_kv:
            # A medium without KV was decoded by prefilling: that is this agent's real prefill speed.
            held = base.seq_len if base is not None and base.has_kv else 0
            ep.prefill.observe(kv.seq_len - held, decode_s, held)
        kv = self._fit(kv, open_msg.codec)
        return Delivery(
            transfer_id=open_msg.transfer_id,
            sender=open_msg.src,
            kv=kv,
            medium=open_msg.codec,
            nbytes=open_msg.total,
            transfer_s=transfer_s,
            decode_s=decode_s,
            label=open_msg.label,
        )

    def _fit(self, kv: KVCache, medium: str) -> KVCache:
        """``kv`` checked against the sender's signature (dtype included) and this agent's (shapes),
        in this agent's model dtype (a KV in another float dtype is cast).

        Raises:
            DecodeError: the KV's dtype is not the one its own signature declares.
            SignatureMismatch: its layers do not fit this agent's model.
        """
        if not kv.has_kv:
            return kv
        if kv.dtype != kv.signature.torch_dtype:
            raise DecodeError(medium, f"KV in {kv.dtype}, but its model signature says {kv.signature.dtype}")
        sig = self._ep.signature
        if sig is None:
            return kv
        kv.validate(sig)
        if kv.dtype != sig.torch_dtype:
            kv = dataclasses.replace(
                kv.to(sig.torch_dtype), signature=dataclasses.replace(kv.signature, dtype=sig.dtype)
            )
        return kv

    def _deliver(
        self, delivery: Delivery, *, twins: Sequence[tuple[memoryview, memoryview]] = (), key: str = ""
    ) -> None:
        """Record ``delivery`` as done (and its send's idempotency ``key``) and hand it to the inbox,
        after a private copy of it is kept as the sender's delta base (the delivery is the
        application's to edit in place).

        A delivery whose tensors all lie in a segment the sender lent (``shm``) is kept without a
        copy: its base views the same bytes through a second copy-on-write mapping (`twin_base`).
        The copy runs after the verdict went out (a large one in a thread), so it is off the
        sender's path; deliveries still reach the inbox in the order they completed, and the next
        decode waits for the copy it may need.
        """
        self.completed[delivery.transfer_id] = time.monotonic()
        if key:
            self.completed[key_entry(delivery.sender, key)] = time.monotonic()
        while len(self.completed) > COMPLETED_MEMORY:
            self.completed.popitem(last=False)
        if not self._ep.config.keep_bases:
            self._put(delivery)
        elif twins and self._handover is None and (twin := twin_base(delivery.kv, twins)) is not None:
            # Its tensors lie in a lent shared segment: the base is a second copy-on-write mapping of it.
            self.bases[delivery.sender] = twin
            self.inbox.put(delivery)
        else:
            self._handover = asyncio.create_task(self._keep(delivery, self._handover), name="kvbus-keep-base")

    def _put(self, delivery: Delivery) -> None:
        if self._handover is None:
            self.inbox.put(delivery)
        else:
            self._handover = asyncio.create_task(self._keep(delivery, self._handover, copy=False))

    async def _keep(self, delivery: Delivery, before: asyncio.Task[None] | None, *, copy: bool = True) -> None:
        this = asyncio.current_task()
        try:
            if before is not None:
                await asyncio.shield(before)
            elif copy:
                # One turn of the loop first: an inline transfer's verdict (published right after
                # `_deliver`) is written by nats-py's flusher before the copy runs, so even a small
                # copy on the event loop is off the sender's path. (A streamed verdict that first
                # waits on a direct path's socket may still go out after the copy.)
                await asyncio.sleep(0)
            if copy:
                kv = delivery.kv
                # The old base's memory is reused unless a decode still reads it.
                old = None if self._reading[delivery.sender] else self.bases.get(delivery.sender)
                self.bases[delivery.sender] = (
                    await asyncio.to_thread(base_copy, kv, old) if kv.nbytes > COPY_INLINE_BYTES else base_copy(kv, old)
                )
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("agent %s: could not keep the delta base from %s", self._ep.name, delivery.sender)
            self.bases.pop(delivery.sender, None)
        finally:
            self.inbox.put(delivery)
            if self._handover is this:
                self._handover = None


def _receive_span(rx: str, open_msg: Open) -> Any:
    """The receiver's ``kvbus.receive`` span: a child of the sender's via the Open's traceparent;
    when the sender does not trace, a root span of its own, linked to the scheduler's decision."""
    if not telemetry.tracing():
        return INVALID_SPAN
    links = None if open_msg.traceparent else telemetry.link_to(open_msg.trace_link)
    return telemetry.start(
        "kvbus.receive",
        parent=open_msg.traceparent or telemetry.ROOT,
        kind=SpanKind.CONSUMER,
        links=links,
        lazy=True,  # nothing carries its context: made once the Open is answered
        attributes={
            telemetry.MESSAGING_SYSTEM: "nats",
            telemetry.MESSAGING_OPERATION: "receive",
            telemetry.MESSAGING_DESTINATION: rx,
            telemetry.MESSAGE_ID: open_msg.transfer_id,
            telemetry.MESSAGE_BODY_SIZE: open_msg.total,
            "kvbus.transfer_id": open_msg.transfer_id,
            "kvbus.src": open_msg.src,
            "kvbus.medium": open_msg.codec,
            "kvbus.chunks": open_msg.n_chunks,
            "kvbus.inline": open_msg.inline,
        },
    )
