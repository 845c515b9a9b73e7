"""The receiving side of an agent: `Open` requests, reassembly, verification, decode, delivery.

An `Open` on the agent's inbox is checked (sender, size, codec, model signature, chunk plan,
subjects) and refused with a `Reason` code when it does not pass. An inline payload is
verified and decoded at once; a streamed one gets an `IncomingTransfer` whose last chunk
calls `Receiver.finish`. Decoded contexts go to the agent's `Inbox`; completed transfer ids
are remembered so that an `Open` asked again is answered, not delivered twice. The last
context from each sender is kept as the base delta media decode against.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from typing import Any

from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind, use_span

from kvbus import telemetry
from kvbus.bus.chunking import Reassembly, split_inline
from kvbus.bus.config import OFFLOAD_BYTES
from kvbus.bus.endpoint import Endpoint
from kvbus.bus.errors import PayloadTooLarge, TransferError
from kvbus.bus.inbox import Inbox
from kvbus.bus.incoming import IncomingTransfer
from kvbus.bus.types import Delivery
from kvbus.codecs import Encoded, get_codec
from kvbus.codecs.errors import CodecError, DeltaBaseMismatch, RecomputeUnavailable
from kvbus.errors import KVBusError, SignatureMismatch, WireFormatError
from kvbus.kvcache import KVCache
from kvbus.protocol import Open, OpenReply, Reason, agent_subject, check_data_subject, check_name, subject_sender
from kvbus.signature import ModelSignature

logger = logging.getLogger(__name__)

#: Completed transfer ids remembered for de-duplication.
COMPLETED_MEMORY = 4096


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


class Receiver:
    """Receives contexts for one agent and puts them in its inbox."""

    def __init__(
        self, endpoint: Endpoint, inbox: Inbox, completed: collections.OrderedDict[str, float] | None = None
    ) -> None:
        self._ep = endpoint
        self.inbox = inbox
        self.incoming: dict[str, IncomingTransfer] = {}
        """Streamed transfers being reassembled, by id."""
        self.completed: collections.OrderedDict[str, float] = (
            collections.OrderedDict() if completed is None else completed
        )
        """Ids of delivered transfers (the last `COMPLETED_MEMORY`), for de-duplication. The bus
        passes the memory of the agent's name, so an agent that closes and registers again on the
        same bus still answers a repeated `Open` of a transfer it delivered with "done"."""
        self.bases: dict[str, KVCache] = {}
        """Per sender: the last context received from it (the base delta media decode against)."""

    @property
    def partial_transfers(self) -> int:
        """Incoming transfers still being reassembled."""
        return len(self.incoming)

    async def stop(self) -> None:
        """Drop every partial transfer (the agent is closing)."""
        for incoming in list(self.incoming.values()):
            await incoming.stop()
        self.incoming.clear()

    # -- Open -----------------------------------------------------------------------------------

    async def on_open(self, msg: Msg) -> None:
        """The agent's inbox subject: answer an `Open` (or a sender asking where it stands)."""
        try:
            reply = await self._handle_open(msg)
        except Exception as exc:
            logger.exception("agent %s: error handling an open request", self._ep.name)
            reply = _refuse("", Reason.INTERNAL, f"internal error: {exc}")
        await self._ep.transport.reply(msg, reply.encode())

    async def _handle_open(self, msg: Msg) -> OpenReply:
        ep = self._ep
        try:
            open_msg, inline = Open.unframe(msg.data)
        except WireFormatError as exc:
            return _refuse("", Reason.MALFORMED, str(exc))
        tid = open_msg.transfer_id
        sender = subject_sender(msg.subject)
        if open_msg.src != sender:
            return _refuse(tid, Reason.WRONG_SENDER, f"an Open from {open_msg.src!r} came on the inbox of {sender!r}")
        if tid in self.completed:
            return OpenReply(transfer_id=tid, ok=True, done=True)
        active = self.incoming.get(tid)
        if active is not None:
            return OpenReply(transfer_id=tid, ok=True, next=active.next)
        if open_msg.total > ep.config.max_transfer_bytes:
            return _refuse(
                tid, Reason.TOO_LARGE, str(PayloadTooLarge("payload", open_msg.total, ep.config.max_transfer_bytes))
            )
        try:
            codec = get_codec(open_msg.codec)
        except CodecError as exc:
            return _refuse(tid, Reason.UNKNOWN_CODEC, str(exc))
        code, problem = self._check_signature(codec, open_msg.meta)
        if problem:
            return _refuse(tid, code, problem)
        max_payload = ep.bus.transport.max_payload
        if open_msg.chunk_size > max_payload:
            return _refuse(
                tid,
                Reason.TOO_LARGE,
                f"chunk size {open_msg.chunk_size} is over the server's max_payload {max_payload}",
            )
        plan = Reassembly(open_msg.sizes, open_msg.chunk_size)
        if plan.plan.n_chunks != open_msg.n_chunks:
            return _refuse(
                tid,
                Reason.MALFORMED,
                f"n_chunks {open_msg.n_chunks} does not match the chunk plan ({plan.plan.n_chunks})",
            )
        if open_msg.inline:
            return await self._receive_inline(open_msg, inline)
        # A streamed transfer makes this agent subscribe and publish: only on the subjects the
        # protocol names for it, never where a hostile Open points.
        try:
            check_name("agent", open_msg.src)
            check_name("transfer", tid)
            check_data_subject(open_msg.data_subject, open_msg.src, ep.name, tid)
            if open_msg.ack_subject != agent_subject(open_msg.src, "ack"):
                raise WireFormatError("open message", f"ack subject must be {agent_subject(open_msg.src, 'ack')!r}")
        except (ValueError, WireFormatError) as exc:
            return _refuse(tid, Reason.MALFORMED, str(exc))
        incoming = IncomingTransfer(ep.transport, open_msg, ep.name, ep.config, self.finish, plan)
        receive_span = _receive_span(ep.name, open_msg)
        incoming.spans = (receive_span, telemetry.start("kvbus.reassemble", parent=receive_span))
        self.incoming[tid] = incoming
        await incoming.start()
        return OpenReply(transfer_id=tid, ok=True)

    async def _receive_inline(self, open_msg: Open, inline: memoryview) -> OpenReply:
        tid = open_msg.transfer_id
        if len(inline) != open_msg.total:
            return _refuse(tid, Reason.MALFORMED, "inline payload has the wrong size")
        buffers, digest = split_inline(open_msg, inline)
        if digest != open_msg.digest:
            return _refuse(tid, Reason.DIGEST_MISMATCH, "inline payload failed its checksum")
        t0 = time.perf_counter()
        with use_span(_receive_span(self._ep.name, open_msg), end_on_exit=True) as receive_span:
            try:
                delivery = await self._decode(open_msg, buffers, 0.0)
            except KVBusError as exc:
                telemetry.fail(receive_span, exc)
                return _refuse(tid, *decode_failure(exc))
        self._deliver(delivery)
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
        self.incoming.pop(tid, None)
        transfer_s = time.perf_counter() - incoming.started
        receive_span, reassemble_span = incoming.spans
        with use_span(receive_span, end_on_exit=True):
            with use_span(reassemble_span, end_on_exit=True):
                reassemble_span.set_attributes(
                    {
                        "kvbus.chunks": incoming.count,
                        "kvbus.corrupt": incoming.corrupt,
                        "kvbus.duplicates": incoming.duplicates,
                    }
                )
                verified = incoming.verify()
            if not verified:
                logger.error("transfer %s: payload digest mismatch after reassembly", tid)
                telemetry.fail(receive_span, TransferError(tid, "payload digest mismatch after reassembly"))
                await incoming.report(
                    ok=False, reason="payload digest mismatch after reassembly", code=Reason.DIGEST_MISMATCH
                )
                return
            t0 = time.perf_counter()
            try:
                delivery = await self._decode(incoming.open, incoming.assembly.result(), transfer_s)
            except KVBusError as exc:
                telemetry.fail(receive_span, exc)
                code, reason = decode_failure(exc)
                await incoming.report(ok=False, reason=reason, code=code)
                return
            decode_s = time.perf_counter() - t0
            self._deliver(delivery)
            await incoming.report(ok=True, decode_s=decode_s)

    async def janitor(self) -> None:
        """Free partial transfers whose sender went silent (runs until cancelled)."""
        config = self._ep.config
        period = min(1.0, config.partial_timeout / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for tid, incoming in list(self.incoming.items()):
                if now - incoming.last_activity > config.partial_timeout:
                    logger.warning(
                        "transfer %s from %s: sender silent for %.1f s, dropping %d of %d chunks",
                        tid,
                        incoming.open.src,
                        now - incoming.last_activity,
                        incoming.count,
                        incoming.open.n_chunks,
                    )
                    self.incoming.pop(tid, None)
                    for s in reversed(incoming.spans):
                        telemetry.fail(s, TransferError(tid, "sender went silent"))
                        s.end()
                    await incoming.stop()

    # -- decode and deliver ---------------------------------------------------------------------

    async def _decode(self, open_msg: Open, buffers: list[memoryview], transfer_s: float) -> Delivery:
        ep = self._ep
        codec = get_codec(open_msg.codec)
        encoded = Encoded(codec=open_msg.codec, meta=open_msg.meta, buffers=buffers)
        t0 = time.perf_counter()
        heavy = not codec.cheap_decode and (open_msg.total > OFFLOAD_BYTES or not codec.needs_kv)
        base = self.bases.get(open_msg.src)
        attributes = {"kvbus.medium": open_msg.codec, "kvbus.bytes": open_msg.total}
        with (
            telemetry.span("kvbus.decode", attributes=attributes),
            contextlib.nullcontext() if codec.needs_kv else telemetry.span("kvbus.recompute"),
        ):
            # A medium without KV is decoded by prefilling its tokens: that is the recompute.
            if heavy:
                kv = await asyncio.to_thread(codec.decode, encoded, base=base, runner=ep.runner)
            else:
                kv = codec.decode(encoded, base=base, runner=ep.runner)
        if ep.config.keep_bases:
            self.bases[open_msg.src] = kv
        if kv.has_kv and ep.signature is not None:
            kv.validate(ep.signature)
        return Delivery(
            transfer_id=open_msg.transfer_id,
            sender=open_msg.src,
            kv=kv,
            medium=open_msg.codec,
            nbytes=open_msg.total,
            transfer_s=transfer_s,
            decode_s=time.perf_counter() - t0,
        )

    def _deliver(self, delivery: Delivery) -> None:
        self.completed[delivery.transfer_id] = time.monotonic()
        while len(self.completed) > COMPLETED_MEMORY:
            self.completed.popitem(last=False)
        self.inbox.put(delivery)


def _receive_span(rx: str, open_msg: Open) -> Any:
    """The receiver's ``kvbus.receive`` span, a child of the sender's via the Open's traceparent."""
    return telemetry.start(
        "kvbus.receive",
        parent=open_msg.traceparent,
        kind=SpanKind.CONSUMER,
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
