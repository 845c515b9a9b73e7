"""The bus client every agent uses: connect, register, `send`, `broadcast`, `gather`, inbox."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Iterable
from enum import Enum
from typing import Any

import torch
from nats.aio.msg import Msg

from opentelemetry.trace import SpanKind, use_span

from kvbus import telemetry
from kvbus.bus.config import HEADER_ROOM, BusConfig
from kvbus.bus.control import TransferControls
from kvbus.bus.pacing import EmulatedLink
from kvbus.bus.errors import (
    BusClosed,
    PayloadTooLarge,
    ReceiveTimeout,
    SchedulerUnavailable,
    TransferError,
    TransferRejected,
    TransferTimeout,
)
from kvbus.bus.stream import IncomingTransfer, OutgoingTransfer, Reassembly, split_inline
from kvbus.net.buckets import key_value
from kvbus.net.transport import NatsTransport, NoResponders, Transport
from kvbus.bus.types import Delivery, TransferReport
from kvbus.codecs import Encoded, ModelRunner, get_codec
from kvbus.codecs.errors import CodecError
from kvbus.errors import KVBusError, ReservationRefused, WireFormatError
from kvbus.kvcache import KVCache
from kvbus.protocol import (
    AGENTS_BUCKET,
    MAX_META_BYTES,
    AgentRecord,
    Control,
    FlowReservation,
    Grant,
    Open,
    OpenReply,
    Probe,
    RequestAck,
    ReservationReply,
    TransferDone,
    TransferRequest,
    agent_subject,
    check_data_subject,
    inbox_subject,
    check_name,
    decode_message,
    packb,
    sched_subject,
    subject_sender,
)
from kvbus.signature import ModelSignature

logger = logging.getLogger(__name__)

#: Payloads above this are encoded and decoded in a worker thread, off the event loop.
OFFLOAD_BYTES = 1 << 20
#: Completed transfer ids remembered for de-duplication.
COMPLETED_MEMORY = 4096


class Status(Enum):
    CONNECTED = "connected"
    CLOSED = "closed"


class Bus:
    """A connection to the kvbus NATS, shared by the agents of one process.

    Create with ``await Bus.connect(url)``; use as ``async with``.
    """

    def __init__(self, transport: Transport, *, config: BusConfig | None = None, secure: bool = False) -> None:
        self.transport = transport
        self.config = config or BusConfig.from_env()
        self.secure = secure
        """Agents have no JetStream access (per-agent permissions): they register through their
        group scheduler instead of writing the directory themselves."""
        self.status = Status.CONNECTED
        self._agents: dict[str, Agent] = {}
        self._directory: Any = None

    @classmethod
    async def connect(cls, url: str = "nats://127.0.0.1:4222", *, config: BusConfig | None = None,
                      secure: bool = False, **nats_options: Any) -> Bus:
        """Connect to NATS at ``url`` (extra keyword arguments go to `nats.connect`).

        Args:
            secure: the server enforces per-agent permissions (`kvbus up --secure`,
                `kvbus.security`): pass the agent's ``user``/``password`` (or ``token``,
                ``nkeys_seed``, ``user_credentials``, ``tls``) and ``inbox_prefix=f"_INBOX.{agent}"``
                in ``nats_options`` (`kvbus.security.agent_connect_options` builds them), and use
                one bus per agent.
        """
        return cls(await NatsTransport.connect(url, **nats_options), config=config, secure=secure)

    @property
    def chunk_size(self) -> int:
        """The configured chunk size, capped so that payload + headers fit the server's max_payload."""
        return max(1024, min(self.config.chunk_size, self.transport.max_payload - HEADER_ROOM))

    async def directory(self) -> Any:
        """The JetStream KV bucket of agent records (created on first use)."""
        if self._directory is None:
            nc = getattr(self.transport, "nc", None)
            if nc is None or self.secure:
                return None
            self._directory = await key_value(nc.jetstream(), AGENTS_BUCKET)
        return self._directory

    async def agent(self, name: str, *, group: str | None = "default", role: str = "agent", priority: float = 1.0,
                    signature: ModelSignature | None = None, runner: ModelRunner | None = None,
                    cache: Any = None, link: EmulatedLink | None = None) -> Agent:
        """Register an agent on this bus and start its inbox.

        Args:
            name: unique agent name (letters, digits, ``-``, ``_``).
            group: the group whose scheduler grants its transfers; None asks the coordinator to
                place it (raises `CoordinatorUnavailable` when none answers or no group is live).
            role: free-form role (``coordinator``, ``executor``, ``verifier`` ...).
            priority: role priority used in scheduling weights.
            signature: the model signature KV sent to this agent must match; taken from
                ``runner`` when not given; None accepts only token-only contexts as-is.
            runner: the agent's model, used to recompute KV for media that carry none.
            cache: the agent's cache tier (`kvbus.cachetier`), if it has one: its memory use
                is reported in probes and `Agent.prefetch` goes to it.
            link: an emulated link (bandwidth, latency) for tests and benchmarks: declared to the
                schedulers, which pace this agent's transfers to it. Real deployments leave it
                None and the schedulers measure the real links.
        """
        if self.status is Status.CLOSED:
            raise BusClosed()
        check_name("agent", name)
        if group is None:
            group = await self._place(name)
        check_name("group", group)
        if name in self._agents:
            raise ValueError(f"agent {name!r} is already registered on this bus")
        if signature is None and runner is not None:
            signature = runner.signature
        agent = Agent(self, name, group=group, role=role, priority=priority, signature=signature, runner=runner,
                      cache=cache, link=link)
        await agent._start()
        self._agents[name] = agent
        return agent

    async def _place(self, name: str) -> str:
        from kvbus.errors import CoordinatorUnavailable
        from kvbus.net.coordinator_client import CoordinatorClient

        reply = await CoordinatorClient(self.transport).place(name)
        if not reply.group:
            raise CoordinatorUnavailable(f"placement of {name}: {reply.reason}")
        return reply.group

    async def close(self) -> None:
        if self.status is Status.CLOSED:
            return
        self.status = Status.CLOSED
        for agent in list(self._agents.values()):
            await agent.close()
        close = getattr(self.transport, "close", None)
        if close is not None:
            await close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __del__(self) -> None:
        if getattr(self, "status", Status.CLOSED) is not Status.CLOSED:
            warnings.warn("kvbus Bus was not closed", ResourceWarning, stacklevel=1)


class Agent:
    """One agent on the bus: sends contexts, receives them in its inbox, reports its state."""

    def __init__(self, bus: Bus, name: str, *, group: str, role: str, priority: float,
                 signature: ModelSignature | None, runner: ModelRunner | None, cache: Any = None,
                 link: EmulatedLink | None = None) -> None:
        self.bus = bus
        self.link = link
        self.name = name
        self.group = group
        self.role = role
        self.priority = priority
        self.signature = signature
        self.runner = runner
        self.cache = cache
        """The agent's cache tier, or None."""
        if cache is not None and type(getattr(cache, "listener", None)).__name__ == "TierListener":
            # The tier's default (silent) listener: count its hits and misses as metrics instead.
            cache.listener = self._cache_metrics = telemetry.CacheMetrics(name)
        self._cache_bytes = 0
        self.closed = False
        self._transport = bus.transport
        self._config = bus.config
        self._subs: list[Any] = []
        self._grants: dict[str, asyncio.Future[Grant]] = {}
        self._controls = TransferControls()
        self._outgoing: dict[str, OutgoingTransfer] = self._controls.outgoing
        self._scheduler_seen = False
        """Whether the group scheduler has answered this agent (a silent one is then waited for)."""
        self._shed_tasks: set[asyncio.Task[Any]] = set()
        self._incoming: dict[str, IncomingTransfer] = {}
        self._completed: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._deliveries: asyncio.Queue[Delivery] = asyncio.Queue()
        self._stash: collections.deque[Delivery] = collections.deque()
        self._tasks: list[asyncio.Task[None]] = []
        self._cpu = (time.process_time(), time.monotonic())
        self._sent_tokens: dict[str, torch.Tensor] = {}
        """Per receiver: the token ids of the last context it got from this agent (delta bases)."""
        self._bases: dict[str, KVCache] = {}
        """Per sender: the last context received from it (the base delta media decode against)."""

    # -- lifecycle --------------------------------------------------------------------------

    async def _start(self) -> None:
        t = self._transport
        self._subs = [
            await t.subscribe(inbox_subject(self.name, "*"), self._on_open),
            await t.subscribe(agent_subject(self.name, "ack"), self._on_ack),
            await t.subscribe(agent_subject(self.name, "ctl"), self._on_ctl),
        ]
        await t.flush()
        await self._register()
        self._tasks.append(asyncio.create_task(self._probe_loop(), name=f"kvbus-probe-{self.name}"))
        self._tasks.append(asyncio.create_task(self._janitor(), name=f"kvbus-janitor-{self.name}"))

    async def _register(self) -> None:
        link = self.link or EmulatedLink()
        record = AgentRecord(name=self.name, group=self.group, role=self.role, priority=self.priority,
                             signature=self.signature.to_dict() if self.signature else None,
                             link_bps=link.bandwidth_bps, latency_s=link.latency_s, recompute=self.runner is not None)
        if self.bus.secure:
            # No JetStream rights: the group scheduler writes the record to the directory.
            try:
                await self._transport.request(sched_subject(self.group, "register", self.name), record.encode(),
                                              timeout=self._config.request_timeout)
            except (NoResponders, TimeoutError):
                logger.warning("agent %s: no scheduler of group %s confirmed its registration", self.name, self.group)
            return
        directory = await self.bus.directory()
        if directory is not None:
            await directory.put(self.name, record.encode())

    async def set_link(self, link: EmulatedLink | None) -> None:
        """Change the emulated link (e.g. to replay a bandwidth trace); schedulers see it within a second or two."""
        self.link = link
        await self._register()
        await self._transport.publish(sched_subject(self.group, "probe", self.name), self.probe().encode())

    async def close(self) -> None:
        """Leave the bus: stop the inbox and the probes, fail pending sends."""
        if self.closed:
            return
        self.closed = True
        for task in self._tasks:
            task.cancel()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection may be closed already
                logger.debug("unsubscribe failed", exc_info=True)
        for incoming in list(self._incoming.values()):
            await incoming.stop()
        self._incoming.clear()
        for fut in self._grants.values():
            if not fut.done():
                fut.set_exception(BusClosed("agent"))
        try:
            directory = await self.bus.directory()
            if directory is not None:
                await directory.delete(self.name)
        except Exception:  # noqa: BLE001 - best effort on the way out
            logger.debug("could not remove %s from the directory", self.name, exc_info=True)
        self.bus._agents.pop(self.name, None)

    async def __aenter__(self) -> Agent:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- sending ------------------------------------------------------------------------------

    async def send(self, to: str, kv: KVCache, *, medium: str | None = None, deadline: float | None = None,
                   critical: bool = False) -> TransferReport:
        """Send a context to agent ``to`` and wait until it arrived whole and verified.

        Args:
            to: the receiving agent.
            kv: the context.
            medium: insist on a medium (e.g. ``"int8"``); None lets the scheduler choose.
            deadline: seconds from now by which the transfer should be done (raises urgency;
                also bounds the wait for a grant).
            critical: mark as critical traffic.

        Raises:
            UnknownCodec: ``medium`` is not a registered codec (a `ValueError`).
            SignatureMismatch: ``kv`` does not fit its own model signature.
            TransferError: the transfer failed; the subclass says why.
        """
        return await self._send_with_fallback([to], kv, medium=medium, deadline=deadline, critical=critical)

    async def broadcast(self, to: Iterable[str], kv: KVCache, *, medium: str | None = None,
                        deadline: float | None = None, critical: bool = False) -> TransferReport:
        """Send one context to several agents; its bytes leave this agent once and NATS fans them out.

        Raises:
            TransferError: at least one receiver did not get it; ``failed`` maps those to their errors.
        """
        receivers = list(dict.fromkeys(to))
        if not receivers:
            raise ValueError("broadcast needs at least one receiver")
        return await self._send_with_fallback(receivers, kv, medium=medium, deadline=deadline, critical=critical)

    async def _send_with_fallback(self, receivers: list[str], kv: KVCache, *, medium: str | None,
                                  deadline: float | None, critical: bool) -> TransferReport:
        """`_transfer`, sent again without delta when a receiver no longer holds the base it was
        encoded against (it restarted, or got a context from us it could not keep)."""
        try:
            return await self._transfer(receivers, kv, medium=medium, deadline=deadline, critical=critical)
        except TransferRejected as exc:
            if "DeltaBaseMismatch" not in exc.reason and "delta base" not in exc.reason:
                raise
            for rx in receivers:
                self._sent_tokens.pop(rx, None)
            logger.info("transfer %s: a receiver lost its delta base; sending the whole context", exc.transfer_id)
            retry = medium.split("+", 1)[1] if medium and medium.startswith("delta+") else medium
            return await self._transfer(receivers, kv, medium=retry, deadline=deadline, critical=critical)

    async def _transfer(self, receivers: list[str], kv: KVCache, *, medium: str | None, deadline: float | None,
                        critical: bool) -> TransferReport:
        if self.closed:
            raise BusClosed("agent")
        for rx in receivers:
            check_name("agent", rx)
        if medium is not None:
            get_codec(medium)
        kv.validate()
        t0 = time.perf_counter()
        transfer_id = uuid.uuid4().hex
        with telemetry.span("kvbus.send", kind=SpanKind.PRODUCER, attributes={
                telemetry.MESSAGING_SYSTEM: "nats", telemetry.MESSAGING_OPERATION: "send",
                telemetry.MESSAGING_DESTINATION: ",".join(receivers), telemetry.MESSAGE_ID: transfer_id,
                "kvbus.transfer_id": transfer_id, "kvbus.src": self.name,
                "kvbus.context_bytes": kv.nbytes}) as send_span:
            grant = await self._request_grant(transfer_id, receivers, kv, medium, deadline, critical)
            t_grant = time.perf_counter()
            send_span.set_attribute("kvbus.medium", grant.medium)
            try:
                codec = get_codec(grant.medium)
                # What the receivers already hold from this agent (delta media send only the rest).
                base = self._delta_base(receivers, kv)
                with telemetry.span("kvbus.encode", attributes={"kvbus.medium": grant.medium}):
                    if kv.nbytes > OFFLOAD_BYTES or not codec.needs_kv:
                        encoded = await asyncio.to_thread(codec.encode, kv, base=base, runner=self.runner)
                    else:
                        encoded = codec.encode(kv, base=base, runner=self.runner)
                t_enc = time.perf_counter()
                meta = packb(encoded.meta)
                if len(meta) > MAX_META_BYTES:
                    raise PayloadTooLarge("codec metadata", len(meta), MAX_META_BYTES)
                chunk_size = min(grant.chunk_size or self.bus.chunk_size, self.bus.chunk_size)
                out = OutgoingTransfer(
                    self._transport, transfer_id=transfer_id, src=self.name, codec=encoded.codec, meta=encoded.meta,
                    buffers=encoded.buffers, receivers=receivers, config=self._config,
                    chunk_size=chunk_size, inline_limit=self._config.inline_limit,
                    window=grant.window or self._config.window, rate_bps=grant.rate_bps,
                    traceparent=telemetry.traceparent(),
                )
                self._outgoing[transfer_id] = out
                try:
                    with telemetry.span("kvbus.stream", attributes={"kvbus.rate_bps": grant.rate_bps}) as stream_span:
                        out.span = stream_span
                        outcomes = await out.run()
                        stream_span.set_attributes({"kvbus.chunks": out.stats.chunks_sent,
                                                    "kvbus.retransmits": out.stats.retransmits,
                                                    "kvbus.pauses": out.stats.pauses})
                finally:
                    self._outgoing.pop(transfer_id, None)
                t_done = time.perf_counter()
            except BaseException as exc:
                telemetry.instruments().transfers.add(1, {"medium": grant.medium, "outcome": type(exc).__name__})
                await self._report_done(transfer_id, grant.medium, receivers, 0, 0.0, exc)
                raise
            failed = {rx: o.error for rx, o in outcomes.items() if o.error is not None}
            error = next(iter(failed.values())) if failed else None
            slowest_decode = max((o.decode_s for o in outcomes.values()), default=0.0)
            await self._report_done(transfer_id, grant.medium, receivers, out.stats.bytes_sent or encoded.nbytes,
                                    t_done - t_grant, error, wire_s=max(0.0, t_done - t_enc - slowest_decode))
            for rx, o in outcomes.items():
                if o.ok:
                    self._sent_tokens[rx] = kv.tokens
            _record_send(send_span, self.name, grant, out, encoded.nbytes, t0, t_grant, t_done, error)
            if error is not None:
                error.failed = failed  # type: ignore[union-attr]
                raise error
            return TransferReport(
                transfer_id=transfer_id, src=self.name, dst=tuple(receivers), medium=grant.medium,
                nbytes=encoded.nbytes, context_bytes=kv.nbytes if kv.has_kv else kv.nbytes, chunks=out.stats.chunks_sent,
                retransmits=out.stats.retransmits, queued_s=t_grant - t0, encode_s=t_enc - t_grant,
                transfer_s=t_done - t_enc, decode_s={rx: o.decode_s for rx, o in outcomes.items()},
                total_s=t_done - t0, rate_bps=grant.rate_bps,
                decision={**grant.decision, "reason": grant.reason, "observed_s": round(t_done - t_grant, 6)},
            )

    async def _request_grant(self, transfer_id: str, receivers: list[str], kv: KVCache, medium: str | None,
                             deadline: float | None, critical: bool) -> Grant:
        """Ask the group scheduler for a grant and wait for it.

        A queued request is asked again every ``regrant_interval`` (the same transfer id, so the
        scheduler keeps one entry): a scheduler that restarted, or a standby that took over,
        learns of it that way. While no scheduler answers, a sender that has seen one keeps
        trying until its wait is over; one that never saw a scheduler fails at once.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Grant] = loop.create_future()
        self._grants[transfer_id] = fut
        wait_span = telemetry.start("kvbus.grant.wait")
        try:
            request = TransferRequest(
                transfer_id=transfer_id, src=self.name, dst=receivers, group=self.group, n_tokens=kv.n_tokens,
                nbytes=kv.nbytes, signature=kv.signature.to_dict(), medium=medium,
                deadline=time.time() + deadline if deadline is not None else None, critical=critical,
                fidelity=float(kv.fidelity), base_tokens=self._base_tokens(receivers, kv),
                traceparent=telemetry.traceparent(wait_span),
            )
            wait = deadline if deadline is not None else self._config.grant_timeout
            with use_span(wait_span, end_on_exit=False, record_exception=True, set_status_on_exception=True):
                grant = await self._ask_scheduler(transfer_id, request.encode(), fut, wait)
        except BaseException:
            wait_span.end()
            raise
        finally:
            self._grants.pop(transfer_id, None)
        try:
            if not grant.medium:
                raise TransferRejected(transfer_id, f"scheduler of {self.group}", grant.reason)
            self._controls.granted(transfer_id)
            delay = grant.start_at - time.time()
            if grant.latency_s > 0:
                # Link emulation: the transfer's round trips (request, open, verdict) on a path with
                # this one-way latency; real links need no such sleep.
                delay = max(delay, 0.0) + 6 * grant.latency_s
            if delay > 0:
                with use_span(wait_span, end_on_exit=False):
                    await asyncio.sleep(min(delay, self._config.grant_timeout))
        finally:
            if wait_span.is_recording():
                wait_span.set_attributes({"kvbus.medium": grant.medium, "kvbus.reason": grant.reason})
            wait_span.end()
        return grant

    async def _ask_scheduler(self, transfer_id: str, payload: bytes, fut: asyncio.Future[Grant], wait: float) -> Grant:
        subject = sched_subject(self.group, "request", self.name)
        give_up = time.monotonic() + max(wait, self._config.request_timeout)
        backoff = 0.05
        while True:
            left = give_up - time.monotonic()
            if fut.done():
                return fut.result()
            if left <= 0:
                stage = "waiting for a grant" if self._scheduler_seen else f"asking the scheduler of group {self.group!r}"
                raise TransferTimeout(transfer_id, stage, wait)
            try:
                data = await self._transport.request(subject, payload, timeout=min(self._config.request_timeout, left))
            except NoResponders:
                if not self._scheduler_seen:
                    raise SchedulerUnavailable(transfer_id, self.group) from None
                # Its scheduler is gone (restarting, failing over): ask again shortly.
                await asyncio.wait({fut}, timeout=min(backoff, left))
                backoff = min(2 * backoff, self._config.regrant_interval)
                continue
            except TimeoutError:
                continue
            self._scheduler_seen = True
            backoff = 0.05
            answer = decode_message(data, RequestAck, Grant)
            if isinstance(answer, Grant):
                return answer
            if not answer.ok:
                raise TransferRejected(transfer_id, f"scheduler of {self.group}", answer.reason)
            # Queued: the grant comes on the ctl subject. Ask again if it takes long.
            await asyncio.wait({fut}, timeout=min(self._config.regrant_interval, max(0.0, give_up - time.monotonic())))

    async def reserve(self, to: str | Iterable[str], *, period: float, size: int, deadline: float) -> str:
        """Reserve bandwidth for a periodic critical flow from this agent: ``size`` bytes every
        ``period`` seconds, each due ``deadline`` seconds after its period starts.

        Critical sends (``critical=True``) to exactly ``to`` then use the bandwidth set aside.

        Returns:
            The reservation id (for `unreserve`).

        Raises:
            ReservationRefused: admission control said no; ``reason`` says why.
            SchedulerUnavailable: no scheduler answers for this agent's group.
        """
        receivers = [to] if isinstance(to, str) else list(dict.fromkeys(to))
        for rx in receivers:
            check_name("agent", rx)
        rid = uuid.uuid4().hex[:16]
        msg = FlowReservation(reservation_id=rid, src=self.name, dst=receivers, group=self.group,
                              period_s=float(period), size_bytes=int(size), deadline_s=float(deadline))
        reply = await self._reservation_request(msg)
        if not reply.ok:
            raise ReservationRefused(rid, reply.reason)
        return rid

    async def unreserve(self, reservation_id: str) -> None:
        """Release a reservation made with `reserve`."""
        msg = FlowReservation(reservation_id=reservation_id, src=self.name, dst=[], group=self.group, period_s=0.0,
                              size_bytes=0, deadline_s=0.0, cancel=True)
        await self._reservation_request(msg)

    async def _reservation_request(self, msg: FlowReservation) -> ReservationReply:
        try:
            data = await self._transport.request(sched_subject(self.group, "reserve", self.name), msg.encode(),
                                                 timeout=self._config.request_timeout)
        except NoResponders:
            raise SchedulerUnavailable(msg.reservation_id, self.group) from None
        except TimeoutError:
            raise TransferTimeout(msg.reservation_id, f"asking the scheduler of group {self.group!r} for a "
                                  f"reservation", self._config.request_timeout) from None
        return ReservationReply.decode(data)

    def _delta_base(self, receivers: list[str], kv: KVCache) -> KVCache | None:
        """A token-only context of what every receiver last got from this agent (None if they differ)."""
        sent = [self._sent_tokens.get(rx) for rx in receivers]
        if any(t is None for t in sent) or any(not torch.equal(t, sent[0]) for t in sent[1:]):
            return None
        return KVCache(tokens=sent[0], signature=kv.signature)

    def _base_tokens(self, receivers: list[str], kv: KVCache) -> int:
        """Tokens at the start of ``kv`` that every receiver already got from this agent."""
        if kv.batch != 1:
            return 0
        common = kv.n_tokens
        for rx in receivers:
            sent = self._sent_tokens.get(rx)
            if sent is None or sent.shape[0] != 1:
                return 0
            n = min(sent.shape[-1], kv.n_tokens)
            same = (sent[0, :n] == kv.tokens[0, :n]).to(torch.int8)
            prefix = n if bool(same.all()) else int(same.argmin())
            common = min(common, prefix)
        return common

    async def _report_done(self, transfer_id: str, medium: str, receivers: list[str], nbytes: int, seconds: float,
                           error: BaseException | None, wire_s: float = 0.0) -> None:
        done = TransferDone(transfer_id=transfer_id, src=self.name, ok=error is None, medium=medium,
                            nbytes=nbytes, seconds=seconds, error=str(error) if error else "", dst=receivers,
                            wire_s=wire_s)
        try:
            await self._transport.publish(sched_subject(self.group, "done", self.name), done.encode())
        except Exception:  # noqa: BLE001 - the scheduler also expires silent transfers
            logger.warning("could not report transfer %s done", transfer_id, exc_info=True)

    # -- control and acks -------------------------------------------------------------------------

    async def _on_ctl(self, msg: Msg) -> None:
        try:
            cmd = decode_message(msg.data, Grant, Control)
        except WireFormatError:
            logger.warning("agent %s: malformed control message dropped", self.name, exc_info=True)
            return
        if isinstance(cmd, Grant):
            fut = self._grants.get(cmd.transfer_id)
            if fut is not None and not fut.done():
                fut.set_result(cmd)
            return
        if cmd.action == "shed":
            self._shed(cmd)
            return
        reply = self._controls.apply(cmd)
        if not reply.ok:
            logger.debug("agent %s: %s of %s declined: %s", self.name, cmd.action, cmd.transfer_id, reply.reason)
        if msg.reply:
            await self._transport.reply(msg, reply.encode())

    def _shed(self, cmd: Control) -> None:
        """Memory hint from the scheduler: the cache passed its watermark. Without a cache tier, ignored."""
        shed = getattr(self.cache, "shed", None)
        if shed is None:
            return
        logger.info("agent %s: shedding cache (%s)", self.name, cmd.reason)

        async def run() -> None:
            try:
                await shed(cmd.nbytes or None)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("agent %s: shedding the cache failed", self.name)

        task = asyncio.create_task(run(), name=f"kvbus-shed-{self.name}")
        self._shed_tasks.add(task)
        task.add_done_callback(self._shed_tasks.discard)

    async def _on_ack(self, msg: Msg) -> None:
        from kvbus.protocol import Ack

        try:
            ack = Ack.decode(msg.data)
        except WireFormatError:
            logger.warning("agent %s: malformed ack dropped", self.name, exc_info=True)
            return
        out = self._outgoing.get(ack.transfer_id)
        if out is not None:
            out.on_ack(ack)

    # -- receiving ------------------------------------------------------------------------------

    async def _on_open(self, msg: Msg) -> None:
        try:
            reply = await self._handle_open(msg)
        except Exception as exc:  # noqa: BLE001 - a bad request must not kill the inbox
            logger.exception("agent %s: error handling an open request", self.name)
            reply = OpenReply(transfer_id="", ok=False, reason=f"internal error: {exc}")
        await self._transport.reply(msg, reply.encode())

    async def _handle_open(self, msg: Msg) -> OpenReply:
        try:
            open_msg, inline = Open.unframe(msg.data)
        except WireFormatError as exc:
            return OpenReply(transfer_id="", ok=False, reason=str(exc))
        tid = open_msg.transfer_id
        sender = subject_sender(msg.subject)
        if open_msg.src != sender:
            return OpenReply(transfer_id=tid, ok=False,
                             reason=f"an Open from {open_msg.src!r} came on the inbox of {sender!r}")
        if tid in self._completed:
            return OpenReply(transfer_id=tid, ok=True, done=True)
        active = self._incoming.get(tid)
        if active is not None:
            return OpenReply(transfer_id=tid, ok=True, next=active.next)
        if open_msg.total > self._config.max_transfer_bytes:
            return OpenReply(transfer_id=tid, ok=False,
                             reason=str(PayloadTooLarge("payload", open_msg.total, self._config.max_transfer_bytes)))
        try:
            codec = get_codec(open_msg.codec)
        except CodecError as exc:
            return OpenReply(transfer_id=tid, ok=False, reason=str(exc))
        problem = self._check_signature(codec, open_msg.meta)
        if problem:
            return OpenReply(transfer_id=tid, ok=False, reason=problem)
        if open_msg.chunk_size > self.bus.transport.max_payload:
            return OpenReply(transfer_id=tid, ok=False, reason=f"chunk size {open_msg.chunk_size} is over the "
                                                                f"server's max_payload {self.bus.transport.max_payload}")
        plan = Reassembly(open_msg.sizes, open_msg.chunk_size)
        if plan.plan.n_chunks != open_msg.n_chunks:
            return OpenReply(transfer_id=tid, ok=False,
                             reason=f"n_chunks {open_msg.n_chunks} does not match the chunk plan ({plan.plan.n_chunks})")
        if open_msg.inline:
            if len(inline) != open_msg.total:
                return OpenReply(transfer_id=tid, ok=False, reason="inline payload has the wrong size")
            buffers, digest = split_inline(open_msg, inline)
            if digest != open_msg.digest:
                return OpenReply(transfer_id=tid, ok=False, reason="inline payload failed its checksum")
            t0 = time.perf_counter()
            with use_span(_receive_span(self.name, open_msg), end_on_exit=True) as receive_span:
                try:
                    delivery = await self._decode(open_msg, buffers, 0.0)
                except KVBusError as exc:
                    telemetry.fail(receive_span, exc)
                    return OpenReply(transfer_id=tid, ok=False, reason=f"cannot decode ({type(exc).__name__}): {exc}")
            self._deliver(delivery)
            return OpenReply(transfer_id=tid, ok=True, done=True, decode_s=time.perf_counter() - t0)
        # A streamed transfer makes this agent subscribe and publish: only on the subjects the
        # protocol names for it, never where a hostile Open points.
        try:
            check_name("agent", open_msg.src)
            check_name("transfer", tid)
            check_data_subject(open_msg.data_subject, open_msg.src, self.name, tid)
            if open_msg.ack_subject != agent_subject(open_msg.src, "ack"):
                raise WireFormatError("open message", f"ack subject must be {agent_subject(open_msg.src, 'ack')!r}")
        except (ValueError, WireFormatError) as exc:
            return OpenReply(transfer_id=tid, ok=False, reason=str(exc))
        incoming = IncomingTransfer(self._transport, open_msg, self.name, self._config, self._finish, plan)
        receive_span = _receive_span(self.name, open_msg)
        incoming.spans = (receive_span, telemetry.start("kvbus.reassemble", parent=receive_span))
        self._incoming[tid] = incoming
        await incoming.start()
        return OpenReply(transfer_id=tid, ok=True)

    def _check_signature(self, codec: Any, meta: dict) -> str:
        """Why a KV medium cannot be used by this agent, or '' when it can."""
        if not codec.needs_kv:
            return ""
        if self.signature is None:
            return f"agent {self.name} has no model signature and accepts only token media, not {codec.name!r}"
        try:
            sender = ModelSignature.from_dict(meta.get("signature"))
        except WireFormatError as exc:
            return str(exc)
        if not sender.compatible_with(self.signature):
            return (f"KV from model {sender.model} ({sender.digest()}) cannot be used by {self.name}'s model "
                    f"{self.signature.model} ({self.signature.digest()}); send tokens or a summary")
        return ""

    async def _finish(self, incoming: IncomingTransfer) -> None:
        tid = incoming.open.transfer_id
        self._incoming.pop(tid, None)
        transfer_s = time.perf_counter() - incoming.started
        receive_span, reassemble_span = incoming.spans
        with use_span(receive_span, end_on_exit=True):
            with use_span(reassemble_span, end_on_exit=True):
                reassemble_span.set_attributes({"kvbus.chunks": incoming.count, "kvbus.corrupt": incoming.corrupt,
                                                "kvbus.duplicates": incoming.duplicates})
                verified = incoming.verify()
            if not verified:
                logger.error("transfer %s: payload digest mismatch after reassembly", tid)
                telemetry.fail(receive_span, TransferError(tid, "payload digest mismatch after reassembly"))
                await incoming._ack(done=True, ok=False, reason="payload digest mismatch after reassembly")
                return
            t0 = time.perf_counter()
            try:
                delivery = await self._decode(incoming.open, incoming.assembly.result(), transfer_s)
            except KVBusError as exc:
                telemetry.fail(receive_span, exc)
                await incoming._ack(done=True, ok=False, reason=f"cannot decode ({type(exc).__name__}): {exc}")
                return
            decode_s = time.perf_counter() - t0
            self._deliver(delivery)
            await incoming._ack(done=True, ok=True, decode_s=decode_s)

    async def _decode(self, open_msg: Open, buffers: list[memoryview], transfer_s: float) -> Delivery:
        codec = get_codec(open_msg.codec)
        encoded = Encoded(codec=open_msg.codec, meta=open_msg.meta, buffers=buffers)
        t0 = time.perf_counter()
        heavy = not codec.cheap_decode and (open_msg.total > OFFLOAD_BYTES or not codec.needs_kv)
        base = self._bases.get(open_msg.src)
        with telemetry.span("kvbus.decode", attributes={"kvbus.medium": open_msg.codec, "kvbus.bytes": open_msg.total}), \
                (contextlib.nullcontext() if codec.needs_kv else telemetry.span("kvbus.recompute")):
            # A medium without KV is decoded by prefilling its tokens: that is the recompute.
            if heavy:
                kv = await asyncio.to_thread(codec.decode, encoded, base=base, runner=self.runner)
            else:
                kv = codec.decode(encoded, base=base, runner=self.runner)
        if self._config.keep_bases:
            self._bases[open_msg.src] = kv
        if kv.has_kv and self.signature is not None:
            kv.validate(self.signature)
        return Delivery(transfer_id=open_msg.transfer_id, sender=open_msg.src, kv=kv, medium=open_msg.codec,
                        nbytes=open_msg.total, transfer_s=transfer_s, decode_s=time.perf_counter() - t0)

    def _deliver(self, delivery: Delivery) -> None:
        self._completed[delivery.transfer_id] = time.monotonic()
        while len(self._completed) > COMPLETED_MEMORY:
            self._completed.popitem(last=False)
        self._deliveries.put_nowait(delivery)

    async def receive(self, timeout: float | None = None) -> Delivery:
        """The next delivery in the inbox.

        Raises:
            ReceiveTimeout: nothing arrived within ``timeout`` seconds.
        """
        if self._stash:
            return self._stash.popleft()
        try:
            return await asyncio.wait_for(self._deliveries.get(), timeout)
        except TimeoutError:
            raise ReceiveTimeout(timeout or 0.0) from None

    async def inbox(self) -> AsyncIterator[Delivery]:
        """Deliveries as they arrive, until the agent closes."""
        while not self.closed:
            yield await self.receive()

    async def gather(self, from_: Iterable[str], *, timeout: float | None = None) -> dict[str, Delivery]:
        """Wait for one delivery from each of ``from_``; others stay in the inbox for `receive`.

        Raises:
            ReceiveTimeout: not all arrived within ``timeout`` seconds.
        """
        wanted = set(from_)
        got: dict[str, Delivery] = {}
        for d in list(self._stash):
            if d.sender in wanted and d.sender not in got:
                got[d.sender] = d
                self._stash.remove(d)
        deadline = None if timeout is None else time.monotonic() + timeout
        others: list[Delivery] = []
        try:
            while len(got) < len(wanted):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    d = await asyncio.wait_for(self._deliveries.get(), left)
                except TimeoutError:
                    missing = sorted(wanted - set(got))
                    raise ReceiveTimeout(timeout or 0.0, f"delivery from {', '.join(missing)}") from None
                if d.sender in wanted and d.sender not in got:
                    got[d.sender] = d
                else:
                    others.append(d)
        finally:
            self._stash.extend(others)
        return got

    # -- memory -------------------------------------------------------------------------------------

    @property
    def cache_bytes(self) -> int:
        """KV bytes this agent holds: its cache tier's resident bytes, or what the owner set."""
        if self.cache is not None:
            return int(getattr(self.cache, "memory_bytes", 0))
        return self._cache_bytes

    @cache_bytes.setter
    def cache_bytes(self, value: int) -> None:
        self._cache_bytes = int(value)

    def prefetch(self, context: Any) -> Any:
        """Workflow hint: ``context`` (token ids or a `KVCache`) will be needed soon.

        With a cache tier, its remote blocks start loading in the background; returns the tier's
        handle (an awaitable task) or None without a tier.
        """
        if self.cache is None:
            return None
        return self.cache.prefetch(context)

    # -- probes and housekeeping ------------------------------------------------------------------

    def compute_load(self) -> float:
        """This process's CPU use since the last probe, as a fraction of the machine's cores."""
        cpu, wall = time.process_time(), time.monotonic()
        last_cpu, last_wall = self._cpu
        self._cpu = (cpu, wall)
        if wall <= last_wall:
            return 0.0
        return min(1.0, (cpu - last_cpu) / (wall - last_wall) / (os.cpu_count() or 1))

    def probe(self) -> Probe:
        link = self.link or EmulatedLink()
        cache_metrics = getattr(self, "_cache_metrics", None)
        if cache_metrics is not None:
            cache_metrics.observe(self.cache.stats)
        return Probe(agent=self.name, group=self.group, queue_size=len(self._grants) + len(self._outgoing),
                     cache_bytes=self.cache_bytes, compute_load=self.compute_load(),
                     role_priority=self.priority, role=self.role, link_bps=link.bandwidth_bps,
                     latency_s=link.latency_s)

    async def _probe_loop(self) -> None:
        subject = sched_subject(self.group, "probe", self.name)
        while True:
            try:
                await self._transport.publish(subject, self.probe().encode())
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep probing through reconnects
                logger.debug("probe publish failed", exc_info=True)
            await asyncio.sleep(self._config.probe_interval)

    async def _janitor(self) -> None:
        """Free partial transfers whose sender went silent."""
        period = min(1.0, self._config.partial_timeout / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for tid, incoming in list(self._incoming.items()):
                if now - incoming.last_activity > self._config.partial_timeout:
                    logger.warning("transfer %s from %s: sender silent for %.1f s, dropping %d of %d chunks",
                                   tid, incoming.open.src, now - incoming.last_activity, incoming.count,
                                   incoming.open.n_chunks)
                    self._incoming.pop(tid, None)
                    for s in reversed(incoming.spans):
                        telemetry.fail(s, TransferError(tid, "sender went silent"))
                        s.end()
                    await incoming.stop()

    @property
    def partial_transfers(self) -> int:
        """Incoming transfers still being reassembled."""
        return len(self._incoming)


def _receive_span(rx: str, open_msg: Open) -> Any:
    """The receiver's ``kvbus.receive`` span, a child of the sender's via the Open's traceparent."""
    return telemetry.start("kvbus.receive", parent=open_msg.traceparent, kind=SpanKind.CONSUMER, attributes={
        telemetry.MESSAGING_SYSTEM: "nats", telemetry.MESSAGING_OPERATION: "receive",
        telemetry.MESSAGING_DESTINATION: rx, telemetry.MESSAGE_ID: open_msg.transfer_id,
        telemetry.MESSAGE_BODY_SIZE: open_msg.total, "kvbus.transfer_id": open_msg.transfer_id,
        "kvbus.src": open_msg.src, "kvbus.medium": open_msg.codec, "kvbus.chunks": open_msg.n_chunks,
        "kvbus.inline": open_msg.inline})


def _record_send(span: Any, agent: str, grant: Grant, out: OutgoingTransfer, nbytes: int, t0: float, t_grant: float,
                 t_done: float, error: BaseException | None) -> None:
    """Metrics of one finished send, and its span's result attributes (predicted vs observed time)."""
    m = telemetry.instruments()
    by_medium = {"medium": grant.medium}
    m.transfers.add(1, {**by_medium, "outcome": "ok" if error is None else type(error).__name__})
    if error is None:
        m.transfer_latency.record(t_done - t0, by_medium)
        m.transfer_bytes.add(nbytes, by_medium)
    m.queue_delay.record(t_grant - t0, {"agent": agent})
    if out.stats.retransmits:
        m.retransmits.add(out.stats.retransmits, {"agent": agent})
    if span.is_recording():
        predicted = grant.decision.get("predicted_s")
        span.set_attributes({
            telemetry.MESSAGE_BODY_SIZE: nbytes, "kvbus.bytes": nbytes, "kvbus.medium": grant.medium,
            "kvbus.chunks": out.stats.chunks_sent, "kvbus.retransmits": out.stats.retransmits,
            "kvbus.pauses": out.stats.pauses, "kvbus.rate_bps": grant.rate_bps, "kvbus.reason": grant.reason,
            "kvbus.queued_s": t_grant - t0, "kvbus.observed_s": t_done - t_grant, "kvbus.total_s": t_done - t0,
            **({"kvbus.predicted_s": float(predicted)} if isinstance(predicted, (int, float)) else {}),
        })


__all__ = ["Agent", "Bus", "Delivery", "TransferError", "TransferReport"]
