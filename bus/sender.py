"""The sending side of an agent: grant, encode, stream, verdicts, and the delta bases per receiver.

One send asks the group scheduler for a grant (`SchedulerLink`), encodes the context with
the granted medium (against what the receivers already hold from this agent, for delta
media), streams it (`OutgoingTransfer`), reports the outcome to the scheduler and returns a
`TransferReport`. A receiver that lost its delta base refuses with
`Reason.DELTA_BASE_MISMATCH`; the context is then sent again whole.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import torch
from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind

from kvbus import telemetry
from kvbus.bus.config import OFFLOAD_BYTES
from kvbus.bus.endpoint import Endpoint
from kvbus.bus.errors import BusClosed, PayloadTooLarge, TransferRejected
from kvbus.bus.outgoing import OutgoingTransfer, StreamStats
from kvbus.bus.scheduling import SchedulerLink
from kvbus.bus.types import TransferReport
from kvbus.codecs import get_codec
from kvbus.errors import WireFormatError
from kvbus.kvcache import KVCache
from kvbus.protocol import MAX_META_BYTES, Ack, Grant, Reason, check_name, packb

logger = logging.getLogger(__name__)


class Sender:
    """Sends contexts from one agent and remembers what each receiver last got from it."""

    def __init__(self, endpoint: Endpoint, scheduler: SchedulerLink) -> None:
        self._ep = endpoint
        self._scheduler = scheduler
        self.outgoing = scheduler.controls.outgoing
        """Running outgoing transfers by id (registering one applies the controls that came early)."""
        self.sent_tokens: dict[str, torch.Tensor] = {}
        """Per receiver: the token ids of the last context it got from this agent (delta bases)."""

    async def send(
        self, receivers: list[str], kv: KVCache, *, medium: str | None, deadline: float | None, critical: bool
    ) -> TransferReport:
        """Send ``kv`` to ``receivers``; sent again without delta when a receiver no longer holds
        the base it was encoded against (it restarted, or got a context from us it could not keep).

        Raises:
            TransferError: the transfer failed; the subclass says why (see `Agent.send`).
        """
        try:
            return await self._transfer(receivers, kv, medium=medium, deadline=deadline, critical=critical)
        except TransferRejected as exc:
            if exc.code is not Reason.DELTA_BASE_MISMATCH:
                raise
            for rx in receivers:
                self.sent_tokens.pop(rx, None)
            logger.info("transfer %s: a receiver lost its delta base; sending the whole context", exc.transfer_id)
            retry = medium.split("+", 1)[1] if medium and medium.startswith("delta+") else medium
            return await self._transfer(receivers, kv, medium=retry, deadline=deadline, critical=critical)

    async def _transfer(
        self, receivers: list[str], kv: KVCache, *, medium: str | None, deadline: float | None, critical: bool
    ) -> TransferReport:
        ep = self._ep
        if ep.closed:
            raise BusClosed("agent")
        for rx in receivers:
            check_name("agent", rx)
        if medium is not None:
            get_codec(medium)
        kv.validate()
        t0 = time.perf_counter()
        transfer_id = uuid.uuid4().hex
        tracing = telemetry.tracing()  # span attributes are built only then
        with telemetry.span(
            "kvbus.send",
            kind=SpanKind.PRODUCER,
            attributes=_send_attributes(transfer_id, ep.name, receivers, kv) if tracing else None,
        ) as send_span:
            grant = await self._scheduler.request_grant(
                transfer_id, receivers, kv, medium, deadline, critical, base_tokens=self.base_tokens(receivers, kv)
            )
            t_grant = time.perf_counter()
            try:
                codec = get_codec(grant.medium)
                # What the receivers already hold from this agent (delta media send only the rest).
                base = self.delta_base(receivers, kv)
                with telemetry.span(
                    "kvbus.encode",
                    attributes={"kvbus.medium": grant.medium} if tracing else None,
                    current=False,
                    lazy=True,
                ):
                    if kv.nbytes > OFFLOAD_BYTES or not codec.needs_kv:
                        encoded = await asyncio.to_thread(codec.encode, kv, base=base, runner=ep.runner)
                    else:
                        encoded = codec.encode(kv, base=base, runner=ep.runner)
                t_enc = time.perf_counter()
                meta = packb(encoded.meta)
                if len(meta) > MAX_META_BYTES:
                    raise PayloadTooLarge("codec metadata", len(meta), MAX_META_BYTES)
                chunk_size = min(grant.chunk_size or ep.bus.chunk_size, ep.bus.chunk_size)
                out = OutgoingTransfer(
                    ep.transport,
                    transfer_id=transfer_id,
                    src=ep.name,
                    codec=encoded.codec,
                    meta=encoded.meta,
                    buffers=encoded.buffers,
                    receivers=receivers,
                    config=ep.config,
                    chunk_size=chunk_size,
                    inline_limit=ep.config.inline_limit,
                    window=grant.window or ep.config.window,
                    rate_bps=grant.rate_bps,
                    traceparent=telemetry.traceparent(),
                    trace_link=grant.traceparent,  # the scheduler's root span, for a sender that does not trace
                )
                self.outgoing[transfer_id] = out
                try:
                    # (Its counts are on kvbus.send; pause, resume and retransmit are its events.)
                    with telemetry.span(
                        "kvbus.stream",
                        attributes={"kvbus.rate_bps": grant.rate_bps} if tracing else None,
                        current=False,
                        lazy=True,
                    ) as stream_span:
                        out.span = stream_span
                        outcomes = await out.run()
                finally:
                    self.outgoing.pop(transfer_id, None)
                t_done = time.perf_counter()
            except BaseException as exc:
                if tracing:
                    send_span.set_attribute("kvbus.medium", grant.medium)
                telemetry.instruments().transfers.add(1, {"medium": grant.medium, "outcome": type(exc).__name__})
                await self._scheduler.report_done(transfer_id, grant.medium, receivers, 0, 0.0, exc)
                raise
            failed = {rx: o.error for rx, o in outcomes.items() if o.error is not None}
            error = next(iter(failed.values())) if failed else None
            slowest_decode = max((o.decode_s for o in outcomes.values()), default=0.0)
            await self._scheduler.report_done(
                transfer_id,
                grant.medium,
                receivers,
                out.stats.bytes_sent or encoded.nbytes,
                t_done - t_grant,
                error,
                wire_s=max(0.0, t_done - t_enc - slowest_decode),
            )
            for rx, o in outcomes.items():
                if o.ok:
                    self.sent_tokens[rx] = kv.tokens
            # Metrics and the span's results once the report is returned (off the transfer's path).
            telemetry.later(
                _record_send, send_span, ep.name, grant, out.stats, encoded.nbytes, t0, t_grant, t_done, error
            )
            if error is not None:
                error.failed = failed  # type: ignore[union-attr]
                raise error
            return TransferReport(
                transfer_id=transfer_id,
                src=ep.name,
                dst=tuple(receivers),
                medium=grant.medium,
                nbytes=encoded.nbytes,
                context_bytes=kv.nbytes,
                chunks=out.stats.chunks_sent,
                retransmits=out.stats.retransmits,
                queued_s=t_grant - t0,
                encode_s=t_enc - t_grant,
                transfer_s=t_done - t_enc,
                decode_s={rx: o.decode_s for rx, o in outcomes.items()},
                total_s=t_done - t0,
                rate_bps=grant.rate_bps,
                decision={**grant.decision, "reason": grant.reason, "observed_s": round(t_done - t_grant, 6)},
            )

    async def on_ack(self, msg: Msg) -> None:
        """The agent's ``ack`` subject: credit, repair requests and verdicts for its outgoing transfers."""
        try:
            ack = Ack.decode(msg.data)
        except WireFormatError:
            logger.warning("agent %s: malformed ack dropped", self._ep.name, exc_info=True)
            return
        out = self.outgoing.get(ack.transfer_id)
        if out is not None:
            out.on_ack(ack)

    # -- delta bases ------------------------------------------------------------------------------

    def delta_base(self, receivers: list[str], kv: KVCache) -> KVCache | None:
        """A token-only context of what every receiver last got from this agent (None if they differ)."""
        sent = [self.sent_tokens.get(rx) for rx in receivers]
        if any(t is None for t in sent) or any(not torch.equal(t, sent[0]) for t in sent[1:]):
            return None
        return KVCache(tokens=sent[0], signature=kv.signature)

    def base_tokens(self, receivers: list[str], kv: KVCache) -> int:
        """Tokens at the start of ``kv`` that every receiver already got from this agent."""
        if kv.batch != 1:
            return 0
        common = kv.n_tokens
        for rx in receivers:
            sent = self.sent_tokens.get(rx)
            if sent is None or sent.shape[0] != 1:
                return 0
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
