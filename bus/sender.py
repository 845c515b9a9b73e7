"""The sending side of an agent: grant, encode, stream, verdicts, and the delta bases per receiver.

One send asks the group scheduler for a grant (`SchedulerLink`), encodes the context with
the granted medium (against what the receivers already hold from this agent, for delta
media), streams it (`OutgoingTransfer`), reports the outcome to the scheduler and returns a
`TransferReport`. A receiver that lost its delta base refuses with
`Reason.DELTA_BASE_MISMATCH`; the context is then sent again whole.

Fidelity follows the base: a delta is built only on a base the receiver holds as this agent
had it (a lossless hop), unless the caller asked for a lossy delta medium; a lossless delta the
caller insists on, with no such base, is sent whole as its inner medium. A KV holding NaN or
inf that the scheduler gave a lossy medium is sent with ``full`` instead.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind

from kvbus import telemetry
from kvbus.bus.chunking import fit_chunk_size
from kvbus.bus.config import DEFAULT_CHUNK_SIZE, HEADER_ROOM, OFFLOAD_BYTES
from kvbus.bus.endpoint import Endpoint
from kvbus.bus.errors import BusClosed, PayloadTooLarge, TransferRejected
from kvbus.bus.handshake import ReceiverOutcome
from kvbus.bus.outgoing import OutgoingTransfer, StreamPacing, StreamPaths, StreamPayload, StreamStats
from kvbus.bus.scheduling import SchedulerLink
from kvbus.bus.stages import SendRequest, SendSettings, TransferPlan, chunk_cap
from kvbus.bus.types import TransferReport
from kvbus.codecs import Codec, Encoded, NonFiniteValues, get_codec
from kvbus.codecs.spec import medium_spec
from kvbus.errors import WireFormatError
from kvbus.kvcache import KVCache
from kvbus.protocol import (
    DIGEST_BYTES,
    MAX_CHUNKS,
    MAX_META_BYTES,
    MIN_CHUNK_SIZE,
    Ack,
    Grant,
    PathName,
    Reason,
    check_name,
    packb,
    subject_sender,
)

logger = logging.getLogger(__name__)

#: Receiver incarnations remembered (one per receiver this agent sent to).
INCARNATION_MEMORY = 4096


@dataclass(frozen=True, slots=True)
class SentBase:
    """What one receiver last got from this agent: the base of the next delta to it."""

    tokens: torch.Tensor
    """The context's token ids."""
    lossless: bool
    """Whether the receiver's copy is this agent's context as it was (a lossless medium, over a
    lossless base for a delta)."""
    fidelity: float
    """The lineage of the receiver's copy."""


@dataclass(frozen=True, slots=True)
class KVCacheSize:
    """Just the size of a payload, where `Sender.expected_path` needs no more."""

    nbytes: int


def _is_delta(codec: Codec) -> bool:
    return codec.stage == "delta"


class Sender:
    """Sends contexts from one agent and remembers what each receiver last got from it."""

    def __init__(self, endpoint: Endpoint, scheduler: SchedulerLink, settings: SendSettings) -> None:
        self._ep = endpoint
        self._scheduler = scheduler
        self._settings = settings
        self.outgoing = scheduler.controls.outgoing
        """Running outgoing transfers by id (registering one applies the controls that came early)."""
        self.bases: dict[str, SentBase] = {}
        """Per receiver: what it last got from this agent (delta bases)."""
        self.incarnations: collections.OrderedDict[str, str] = collections.OrderedDict()
        """Per receiver: the incarnation the last transfer to it met (retried Opens name it)."""
        self.paths: collections.OrderedDict[str, str] = collections.OrderedDict()
        """Per receiver: the data path the last transfer to it took (the next one likely takes it too)."""

    async def send(
        self,
        receivers: list[str],
        kv: KVCache,
        *,
        medium: str | None,
        deadline: float | None,
        critical: bool,
        idempotency_key: str = "",
        label: str = "",
    ) -> TransferReport:
        """Send ``kv`` to ``receivers``; sent again without delta when a receiver no longer holds
        the base it was encoded against (it restarted, or got a context from us it could not keep).

        Raises:
            TransferError: the transfer failed; the subclass says why (see `Agent.send`).
            NonFiniteValues: ``medium`` is lossy and ``kv`` holds NaN or inf.
        """
        try:
            return await self._transfer(
                receivers, kv, medium=medium, deadline=deadline, critical=critical, key=idempotency_key, label=label
            )
        except TransferRejected as exc:
            if exc.code is not Reason.DELTA_BASE_MISMATCH:
                raise
            for rx in receivers:
                self.bases.pop(rx, None)
            logger.info("transfer %s: a receiver lost its delta base; sending the whole context", exc.transfer_id)
            retry = medium_spec(medium).inner if medium is not None and medium_spec(medium).delta else medium
            return await self._transfer(
                receivers, kv, medium=retry, deadline=deadline, critical=critical, key=idempotency_key, label=label
            )

    async def _transfer(
        self,
        receivers: list[str],
        kv: KVCache,
        *,
        medium: str | None,
        deadline: float | None,
        critical: bool,
        key: str = "",
        label: str = "",
    ) -> TransferReport:
        """One send, stage by stage: admit, grant, encode, route, stream, report."""
        request = self._admit(receivers, kv, medium=medium, deadline=deadline, critical=critical, key=key, label=label)
        tracing = telemetry.tracing()  # span attributes are built only then
        with telemetry.span(
            "kvbus.send",
            kind=SpanKind.PRODUCER,
            attributes=_send_attributes(request.transfer_id, self._ep.name, receivers, kv) if tracing else None,
        ) as send_span:
            grant = await self._grant(request)
            t_grant = time.perf_counter()
            if tracing:
                send_span.set_attribute("kvbus.medium", grant.medium)
            sent_medium = grant.medium
            try:
                plan = await self._encode_stage(request, grant, t_grant, tracing=tracing)
                sent_medium = plan.encoded.codec
                out = self._route(plan)
                outcomes = await self._stream(out, plan, tracing=tracing)
                t_done = time.perf_counter()
            except BaseException as exc:
                telemetry.instruments().transfers.add(1, {"medium": sent_medium, "outcome": type(exc).__name__})
                await self._scheduler.report_done(request.transfer_id, sent_medium, receivers, 0, 0.0, exc)
                raise
            return await self._report(plan, out, outcomes, t_done, send_span)

    # -- stages ------------------------------------------------------------------------------------

    def _admit(
        self,
        receivers: list[str],
        kv: KVCache,
        *,
        medium: str | None,
        deadline: float | None,
        critical: bool,
        key: str,
        label: str = "",
    ) -> SendRequest:
        """Check the send and choose what a delta builds on.

        Raises:
            BusClosed: the agent is closed.
            ValueError: a receiver's name is not a valid agent name.
            KeyError: ``medium`` names no codec.
        """
        if self._ep.closed:
            raise BusClosed("agent")
        for rx in receivers:
            check_name("agent", rx)
        asked = get_codec(medium) if medium is not None else None
        kv.validate(dtype=True)
        t0 = time.perf_counter()
        transfer_id = uuid.uuid4().hex
        base_tokens = self.base_tokens(receivers, kv, lossy_ok=asked is not None and not asked.is_lossless)
        if asked is not None and _is_delta(asked) and not base_tokens:
            # No base the receivers hold as we had it: the delta would carry everything anyway, or
            # build on a lossy copy while its medium says lossless. Send the inner medium whole.
            inner = asked.inner.name  # type: ignore[union-attr]
            logger.info("transfer %s: no lossless base at %s for %s; sending %s", transfer_id, receivers, medium, inner)
            medium = inner
        return SendRequest(
            transfer_id=transfer_id,
            receivers=receivers,
            kv=kv,
            medium=medium,
            deadline=deadline,
            critical=critical,
            key=key,
            label=label,
            base_tokens=base_tokens,
            t0=t0,
        )

    async def _grant(self, request: SendRequest) -> Grant:
        """The group scheduler's grant: the medium, rate, window and chunk size of the transfer."""
        return await self._scheduler.request_grant(
            request.transfer_id,
            request.receivers,
            request.kv,
            request.medium,
            request.deadline,
            request.critical,
            base_tokens=request.base_tokens,
            path=self.expected_path(request.receivers, request.kv),
        )

    async def _encode_stage(self, request: SendRequest, grant: Grant, t_grant: float, *, tracing: bool) -> TransferPlan:
        """Encode with the granted medium; a KV holding NaN or inf that the scheduler (not the
        caller) gave a lossy medium is encoded with ``full`` instead.

        Raises:
            NonFiniteValues: the caller asked for a lossy medium and the KV holds NaN or inf.
            PayloadTooLarge: the codec's metadata exceeds `MAX_META_BYTES`.
        """
        receivers, kv = request.receivers, request.kv
        codec = get_codec(grant.medium)
        # What the receivers already hold from this agent: only a delta medium encodes
        # against it (another would only lose its view-only encode on the event loop).
        base = self.delta_base(receivers, kv) if request.base_tokens and _is_delta(codec) else None
        with telemetry.span(
            "kvbus.encode",
            attributes={"kvbus.medium": grant.medium} if tracing else None,
            current=False,
            lazy=True,
        ):
            try:
                encoded = await self._encode(codec, kv, base)
            except NonFiniteValues:
                if request.medium is not None:
                    raise  # the caller asked for this lossy medium: say why it cannot be
                logger.info("transfer %s: the KV holds NaN or inf; sending it with full", request.transfer_id)
                codec, base = get_codec("full"), None
                encoded = await self._encode(codec, kv, base)
        return TransferPlan(
            request=request, grant=grant, t_grant=t_grant, codec=codec, encoded=encoded, t_enc=time.perf_counter()
        )

    async def _stream(self, out: OutgoingTransfer, plan: TransferPlan, *, tracing: bool) -> dict[str, ReceiverOutcome]:
        """Run the transfer's stream to its verdicts (it takes the scheduler's controls meanwhile)."""
        transfer_id = plan.request.transfer_id
        self.outgoing[transfer_id] = out
        try:
            # (Its counts are on kvbus.send; pause, resume and retransmit are its events.)
            with telemetry.span(
                "kvbus.stream",
                attributes={"kvbus.rate_bps": plan.grant.rate_bps} if tracing else None,
                current=False,
                lazy=True,
            ) as stream_span:
                out.span = stream_span
                return await out.run()
        finally:
            self.outgoing.pop(transfer_id, None)
            self._learn(out)

    async def _report(
        self,
        plan: TransferPlan,
        out: OutgoingTransfer,
        outcomes: dict[str, ReceiverOutcome],
        t_done: float,
        send_span: Any,
    ) -> TransferReport:
        """Tell the scheduler how the transfer went, remember its path and the receivers' new
        bases, and return its report.

        Raises:
            TransferError: a receiver failed (the first one's error, with ``failed`` set to all).
        """
        request, grant, encoded = plan.request, plan.grant, plan.encoded
        receivers, kv, t_grant, t_enc = request.receivers, request.kv, plan.t_grant, plan.t_enc
        path = out.path
        send_span.set_attribute("kvbus.path", path)
        self._remember_path(receivers, out)
        failed = {rx: o.error for rx, o in outcomes.items() if o.error is not None}
        error = next(iter(failed.values())) if failed else None
        slowest_decode = max((o.decode_s for o in outcomes.values()), default=0.0)
        await self._scheduler.report_done(
            request.transfer_id,
            encoded.codec,
            receivers,
            out.stats.bytes_sent or encoded.nbytes,
            t_done - t_grant,
            error,
            wire_s=max(0.0, t_done - t_enc - slowest_decode),
            path=out.route.summary if out.route is not None else PathName.NATS.value,
            encode_s=t_enc - t_grant,
            decode_s=slowest_decode,
        )
        fidelity, lossless = self._delivered(receivers, kv, plan.codec, encoded)
        # A copy of the ids (8 bytes a token): ``kv.tokens`` may be a view of a much larger
        # storage (an `Agent.kv_buffer`'s segment, which it would keep alive), and the caller may
        # change it in place afterwards.
        tokens = kv.tokens.clone()
        for rx, o in outcomes.items():
            if o.ok:
                self.bases[rx] = SentBase(tokens, lossless, fidelity)
            elif isinstance(o.error, TransferRejected) and o.error.code is Reason.RECEIVER_RESTARTED:
                self.bases.pop(rx, None)
        # Metrics and the span's results once the report is returned (off the transfer's path).
        telemetry.later(
            _record_send, send_span, self._ep.name, grant, out.stats, encoded.nbytes, request.t0, t_grant, t_done, error
        )
        if error is not None:
            error.failed = failed
            raise error
        return TransferReport(
            transfer_id=request.transfer_id,
            src=self._ep.name,
            dst=tuple(receivers),
            medium=encoded.codec,
            nbytes=encoded.nbytes,
            context_bytes=kv.nbytes,
            chunks=out.stats.chunks_sent,
            retransmits=out.stats.retransmits,
            queued_s=t_grant - request.t0,
            encode_s=t_enc - t_grant,
            transfer_s=t_done - t_enc,
            decode_s={rx: o.decode_s for rx, o in outcomes.items()},
            total_s=t_done - request.t0,
            rate_bps=grant.rate_bps,
            decision={
                **grant.decision,
                "reason": grant.reason,
                "observed_s": round(t_done - t_grant, 6),
                "measured": {
                    "encode_s": round(t_enc - t_grant, 6),
                    "wire_s": round(max(0.0, t_done - t_enc - slowest_decode), 6),
                    "decode_s": round(slowest_decode, 6),
                    "total_s": round(t_done - t_grant, 6),
                },
            },
            fidelity=fidelity,
            path=path,
            paths=tuple(out.paths_used),
        )

    def _remember_path(self, receivers: list[str], out: OutgoingTransfer) -> None:
        """Path memory: the next transfer to this receiver likely takes the path this one took."""
        if out.route is not None and out.route.used:
            self.paths[receivers[0]] = out.route.used[0]
            self.paths.move_to_end(receivers[0])
            while len(self.paths) > INCARNATION_MEMORY:
                self.paths.popitem(last=False)

    async def _encode(self, codec: Codec, kv: KVCache, base: KVCache | None) -> Encoded:
        ep = self._ep
        views_only = codec.cheap_encode and base is None and kv.contiguous
        if not views_only and (kv.nbytes > OFFLOAD_BYTES or not codec.needs_kv):
            encoded = await asyncio.to_thread(codec.encode, kv, base=base, runner=ep.runner)
        else:
            encoded = codec.encode(kv, base=base, runner=ep.runner)
        meta = packb(encoded.meta)
        if len(meta) > MAX_META_BYTES:
            raise PayloadTooLarge("codec metadata", len(meta), MAX_META_BYTES)
        return encoded

    def _route(self, plan: TransferPlan) -> OutgoingTransfer:
        """The transfer's stream, its chunk size fitted to the protocol's chunk count and to the
        path it will likely take.

        Raises:
            PayloadTooLarge: it needs more than `MAX_CHUNKS` chunks, or its `Open` would not fit
                the server's max_payload.
        """
        ep, settings = self._ep, self._settings
        request, grant, encoded = plan.request, plan.grant, plan.encoded
        receivers, transfer_id = request.receivers, request.transfer_id
        largest = chunk_cap(ep.config, ep.transport.max_payload)
        chunk_size = max(MIN_CHUNK_SIZE, min(grant.chunk_size or largest, largest))
        direct = settings.direct_chunk_size
        if (
            direct
            and not grant.chunk_size
            and ep.config.chunk_size == DEFAULT_CHUNK_SIZE
            and self.expected_path(receivers, KVCacheSize(encoded.nbytes)) in (PathName.SHM, PathName.TCP)
        ):
            # Fewer, larger chunks on a direct path (each costs a wake-up on both sides), still
            # small enough for NATS to carry should the transfer fall back.
            largest = max(largest, min(direct, ep.transport.max_payload - HEADER_ROOM))
            chunk_size = largest
        chunk_size = fit_chunk_size(encoded.sizes, chunk_size, max(largest, MIN_CHUNK_SIZE))
        out = OutgoingTransfer(
            ep.transport,
            ep.config,
            StreamPayload(
                transfer_id,
                ep.name,
                receivers,
                encoded,
                idempotency_key=request.key,
                label=request.label,
                traceparent=telemetry.traceparent(),
                trace_link=grant.traceparent,  # the scheduler's root span, for a sender that does not trace
                incarnations=self.incarnations,
                streamed=plan.codec.recomputes,
            ),
            StreamPacing(
                chunk_size,
                window=grant.window or ep.config.window,
                rate_bps=grant.rate_bps,
                bucket=self._scheduler.bucket(transfer_id),
            ),
            StreamPaths(
                settings.plane,
                per_receiver_streams=settings.secure,
                stage_shm=len(receivers) == 1 and self.paths.get(receivers[0]) == PathName.SHM,
                home=request.kv.segment,
            ),
        )
        if out.plan.n_chunks > MAX_CHUNKS:
            raise PayloadTooLarge(f"payload in chunks of {chunk_size} bytes", out.plan.n_chunks, MAX_CHUNKS)
        if not out.open.inline:  # (an inline Open was sized to fit when it was made)
            open_bytes = len(out.open.encode()) + out.plan.n_chunks * DIGEST_BYTES + 1024
            if open_bytes > ep.transport.max_payload:
                raise PayloadTooLarge("open message", open_bytes, ep.transport.max_payload)
        return out

    def expected_path(self, receivers: list[str], kv: KVCache | KVCacheSize) -> str:
        """The data path a transfer of ``kv`` to ``receivers`` will likely take, for the cost model:
        the one the last transfer to the receiver took, else the fastest this process allows.
        Broadcasts and payloads small enough to ride in the `Open` go through NATS."""
        plane = self._settings.plane
        if plane is None or len(receivers) != 1 or kv.nbytes <= self._ep.config.inline_limit:
            return PathName.NATS.value
        known = self.paths.get(receivers[0])
        if known:
            return known
        return plane.paths[0].kind.value if plane.paths else PathName.NATS.value

    def _learn(self, out: OutgoingTransfer) -> None:
        """Remember the receivers' incarnations; one that restarted lost the bases we sent it."""
        for rx in out.restarted:
            self.bases.pop(rx, None)
        for rx, link in out.links.items():
            if link.learned:
                self.incarnations[rx] = link.learned
                self.incarnations.move_to_end(rx)
        while len(self.incarnations) > INCARNATION_MEMORY:
            self.incarnations.popitem(last=False)

    def _delivered(self, receivers: list[str], kv: KVCache, codec: Codec, encoded: Encoded) -> tuple[float, bool]:
        """The lineage of what the receivers now hold, and whether it is this agent's context as it is."""
        fidelity = kv.fidelity * (1.0 if codec.is_lossless else codec.fidelity)
        lossless = codec.is_lossless
        own = encoded.meta.get("delta") if isinstance(encoded.meta, dict) else None
        if isinstance(own, dict) and isinstance(own.get("prefix"), int) and own["prefix"] > 0:
            bases = [self.bases[rx] for rx in receivers if rx in self.bases]
            fidelity = min([fidelity, *(b.fidelity for b in bases)])
            lossless = lossless and all(b.lossless for b in bases)
        return fidelity, lossless

    async def on_ack(self, msg: Msg) -> None:
        """The agent's ack subjects: credit, repair requests and verdicts for its outgoing transfers.

        The receiver is the subject's last token (in secure mode only it may publish there); an
        ack naming another receiver is dropped.
        """
        rx = subject_sender(msg.subject)
        try:
            ack = Ack.decode(msg.data)
        except WireFormatError:
            logger.warning("agent %s: malformed ack dropped", self._ep.name, exc_info=True)
            return
        if ack.rx != rx:
            logger.warning("agent %s: an ack naming %r came on the subject of %r; dropped", self._ep.name, ack.rx, rx)
            return
        out = self.outgoing.get(ack.transfer_id)
        if out is not None:
            out.on_ack(rx, ack)

    # -- delta bases ------------------------------------------------------------------------------

    def delta_base(self, receivers: list[str], kv: KVCache) -> KVCache | None:
        """A token-only context of what every receiver last got from this agent (None if they differ)."""
        sent = [self.bases[rx].tokens if rx in self.bases else None for rx in receivers]
        first = sent[0]
        if first is None or any(t is None or not torch.equal(t, first) for t in sent[1:]):
            return None
        return KVCache(tokens=first, signature=kv.signature)

    def base_tokens(self, receivers: list[str], kv: KVCache, *, lossy_ok: bool = False) -> int:
        """Tokens at the start of ``kv`` that every receiver already holds from this agent, in a
        copy a delta may build on: one as this agent had it (or any, with ``lossy_ok``)."""
        if kv.batch != 1:
            return 0
        common = kv.n_tokens
        for rx in receivers:
            base = self.bases.get(rx)
            if base is None or base.tokens.shape[0] != 1:
                return 0
            if not lossy_ok and not (base.lossless and base.fidelity >= kv.fidelity):
                return 0
            sent = base.tokens
            if sent.shape == kv.tokens.shape and torch.equal(sent, kv.tokens):
                continue  # the same context again (one comparison, not four tensor ops)
            n = min(sent.shape[-1], kv.n_tokens)
            same = (sent[0, :n] == kv.tokens[0, :n]).to(torch.int8)
            prefix = n if bool(same.all()) else int(same.argmin())
            common = min(common, prefix)
        return common


def _send_attributes(transfer_id: str, src: str, receivers: list[str], kv: KVCache) -> dict[str, Any]:
    return {
        telemetry.MESSAGING_SYSTEM: "nats",
        telemetry.MESSAGING_OPERATION: "send",
        telemetry.MESSAGING_DESTINATION: ",".join(receivers),
        telemetry.MESSAGE_ID: transfer_id,
        "kvbus.transfer_id": transfer_id,
        "kvbus.src": src,
        "kvbus.context_bytes": kv.nbytes,
    }


def _record_send(
    span: Any,
    agent: str,
    grant: Grant,
    stats: StreamStats,
    nbytes: int,
    t0: float,
    t_grant: float,
    t_done: float,
    error: BaseException | None,
) -> None:
    """Metrics of one finished send, and its span's result attributes (predicted vs observed time)."""
    m = telemetry.instruments()
    by_medium = {"medium": grant.medium}
    m.transfers.add(1, {**by_medium, "outcome": "ok" if error is None else type(error).__name__})
    if error is None:
        m.transfer_latency.record(t_done - t0, by_medium)
        m.transfer_bytes.add(nbytes, by_medium)
    m.queue_delay.record(t_grant - t0, {"agent": agent})
    if stats.retransmits:
        m.retransmits.add(stats.retransmits, {"agent": agent})
    if span.is_recording():
        predicted = grant.decision.get("predicted_s")
        span.set_attributes(
            {
                telemetry.MESSAGE_BODY_SIZE: nbytes,
                "kvbus.bytes": nbytes,
                "kvbus.medium": grant.medium,
                "kvbus.chunks": stats.chunks_sent,
                "kvbus.retransmits": stats.retransmits,
                "kvbus.pauses": stats.pauses,
                "kvbus.reason": grant.reason,
                # (The queue wait is kvbus.grant.wait's length, the rate is on kvbus.stream.)
                "kvbus.observed_s": t_done - t_grant,
                **({"kvbus.predicted_s": float(predicted)} if isinstance(predicted, (int, float)) else {}),
            }
        )
