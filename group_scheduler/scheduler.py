"""The group scheduler process: request -> grant -> (stream) -> done for one group."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Any

from nats.aio.msg import Msg
from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from kvbus.bus.transport import NatsTransport, Transport
from kvbus.errors import WireFormatError
from kvbus.group_scheduler.config import SchedulerConfig
from kvbus.group_scheduler.cost_model import CostConfig, CostModel
from kvbus.group_scheduler.policy import FifoPolicy, MediumSelector, SchedulingPolicy, StaticSelector
from kvbus.group_scheduler.selection import AdaptiveSelector
from kvbus.group_scheduler.state import GroupState, Pending
from kvbus.protocol import (
    AGENTS_BUCKET,
    COORD_REGISTER,
    AgentRecord,
    Grant,
    GroupHeartbeat,
    Probe,
    RequestAck,
    TransferDone,
    TransferRequest,
    agent_subject,
    check_name,
    sched_subject,
)
from kvbus.signature import ModelSignature

logger = logging.getLogger(__name__)

#: Transfers smaller than this say more about round trips than bandwidth: not used for estimates.
MIN_ESTIMATE_BYTES = 64 * 1024


def default_selector(config: SchedulerConfig) -> MediumSelector:
    """The adaptive selector over the calibration profile (fallback figures if none loads), or static."""
    if config.selector == "static":
        return StaticSelector()
    try:
        from kvbus.codecs.calibration import load_profile

        model = CostModel.from_profile(load_profile(), config=CostConfig(hysteresis=config.hysteresis))
    except Exception as exc:  # noqa: BLE001 - no profile: decisions say they used fallback figures
        logger.warning("no calibration profile (%s); the cost model uses fallback figures", exc)
        model = CostModel(config=CostConfig(hysteresis=config.hysteresis))
    return AdaptiveSelector(model, default_bandwidth_bps=config.default_bandwidth_bps)


class GroupScheduler:
    """Grants the transfers of one group's agents, one decision per state change or tick."""

    def __init__(self, transport: Transport, group: str, *, policy: SchedulingPolicy | None = None,
                 config: SchedulerConfig | None = None) -> None:
        self.transport = transport
        self.group = check_name("group", group)
        self.config = config or SchedulerConfig.from_env()
        self.policy = policy or FifoPolicy(default_selector(self.config), max_active=self.config.max_active)
        self.state = GroupState(group, bandwidth_bps=self.config.bandwidth_bps)
        self.name = f"{group}@{socket.gethostname()}:{os.getpid()}"
        self._subs: list[Any] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._directory: Any = None
        self._dir_cache: dict[str, tuple[float, AgentRecord | None]] = {}
        self.closed = False

    @classmethod
    async def connect(cls, url: str, group: str, **kwargs: Any) -> GroupScheduler:
        sched = cls(await NatsTransport.connect(url, name=f"kvbus-scheduler-{group}"), group, **kwargs)
        await sched.start()
        return sched

    async def start(self) -> None:
        t = self.transport
        # A queue group lets standby replicas share the subjects; exactly one answers each request.
        q = f"kvbus-sched-{self.group}"
        self._subs = [
            await t.subscribe(sched_subject(self.group, "request"), self._on_request, queue=q),
            await t.subscribe(sched_subject(self.group, "done"), self._on_done, queue=q),
            await t.subscribe(sched_subject(self.group, "probe"), self._on_probe),
        ]
        await t.flush()
        self._tasks = [asyncio.create_task(self._loop(), name=f"kvbus-sched-{self.group}"),
                       asyncio.create_task(self._heartbeat(), name=f"kvbus-sched-hb-{self.group}")]
        logger.info("group scheduler %s started", self.name)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001
                logger.debug("unsubscribe failed", exc_info=True)
        close = getattr(self.transport, "close", None)
        if close is not None:
            await close()

    async def __aenter__(self) -> GroupScheduler:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- directory ------------------------------------------------------------------------------

    async def lookup(self, agent: str) -> AgentRecord | None:
        """An agent's record from the JetStream directory (cached for ``directory_ttl``)."""
        now = time.monotonic()
        hit = self._dir_cache.get(agent)
        if hit is not None and now - hit[0] < self.config.directory_ttl and hit[1] is not None:
            return hit[1]
        nc = getattr(self.transport, "nc", None)
        if nc is None:
            return None
        if self._directory is None:
            js = nc.jetstream()
            try:
                self._directory = await js.key_value(AGENTS_BUCKET)
            except BucketNotFoundError:
                self._directory = await js.create_key_value(bucket=AGENTS_BUCKET, history=1)
        try:
            entry = await self._directory.get(agent)
            record = AgentRecord.decode(entry.value) if entry.value else None
        except KeyNotFoundError:
            record = None
        except WireFormatError:
            logger.warning("directory entry of %s is malformed", agent)
            record = None
        self._dir_cache[agent] = (now, record)
        if record is not None and agent not in self.state.agents:
            # Agents of this group declare their links in probes; others only in the directory.
            self.state.declare(agent, record.link_bps, record.latency_s)
        return record

    # -- handlers ----------------------------------------------------------------------------------

    async def _on_request(self, msg: Msg) -> None:
        try:
            req = TransferRequest.decode(msg.data)
            ModelSignature.from_dict(req.signature)
            receivers = [check_name("agent", rx) for rx in req.dst]
            if not receivers:
                raise ValueError("no receivers")
        except (WireFormatError, ValueError) as exc:
            await self.transport.reply(msg, RequestAck(transfer_id="", ok=False, reason=f"bad request: {exc}").encode())
            return
        sigs: dict[str, ModelSignature | None] = {}
        unknown = []
        await self.lookup(req.src)
        for rx in receivers:
            record = await self.lookup(rx)
            if record is None:
                unknown.append(rx)
                continue
            try:
                sigs[rx] = ModelSignature.from_dict(record.signature) if record.signature else None
            except WireFormatError:
                sigs[rx] = None
        if unknown:
            reason = f"unknown agent(s): {', '.join(unknown)} (not registered on the bus)"
            await self.transport.reply(msg, RequestAck(req.transfer_id, ok=False, reason=reason).encode())
            return
        self.state.queue.append(Pending(req, sigs))
        # Decide now: a transfer that can start at once gets its grant as the reply (one round
        # trip instead of two); otherwise the reply says "queued" and the grant follows on ctl.
        replies = {req.transfer_id: msg}
        await self.schedule_once(replies)
        if req.transfer_id in replies:
            await self.transport.reply(msg, RequestAck(req.transfer_id, ok=True).encode())
            self._wake.set()

    async def _on_done(self, msg: Msg) -> None:
        try:
            done = TransferDone.decode(msg.data)
        except WireFormatError:
            logger.warning("malformed done message dropped")
            return
        pending = self.state.active.pop(done.transfer_id, None)
        if pending is None:
            return
        if done.ok:
            self.state.completed += 1
            if done.nbytes >= MIN_ESTIMATE_BYTES and done.wire_s > 0:
                for rx in done.dst:
                    self.state.link(done.src, rx).observe(done.nbytes, done.wire_s)
            model = getattr(self.policy.selector, "model", None)
            if model is not None and pending.predicted_s > 0 and done.seconds > 0:
                model.observe(pending.medium, pending.predicted_s, done.seconds)
        else:
            self.state.failed += 1
            logger.info("transfer %s failed: %s", done.transfer_id, done.error)
        self._wake.set()

    async def _on_probe(self, msg: Msg) -> None:
        try:
            probe = Probe.decode(msg.data)
        except WireFormatError:
            return
        if probe.group == self.group:
            self.state.on_probe(probe)

    # -- the loop --------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                await self._wake.wait()
                self._wake.clear()
                await self.schedule_once()
                if self.state.queue:
                    # Work is waiting for a slot: look again next slice (or earlier, on an event).
                    try:
                        await asyncio.wait_for(self._wake.wait(), self.config.tick_s)
                    except TimeoutError:
                        self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("scheduler loop of %s failed; continuing", self.group)
                await asyncio.sleep(self.config.tick_s)

    async def schedule_once(self, replies: dict[str, Msg] | None = None) -> int:
        """Expire stale active transfers, ask the policy, send the grants; returns how many were granted.

        ``replies`` maps transfer ids to requests still waiting for their reply: a grant for one of
        them goes out as that reply (and the entry is removed) instead of on the sender's ctl subject.
        """
        now = time.monotonic()
        for tid, p in list(self.state.active.items()):
            if now - p.granted_at > self.config.transfer_timeout:
                logger.warning("transfer %s reported nothing for %.0f s; releasing its slot", tid, now - p.granted_at)
                del self.state.active[tid]
        granted = 0
        for decision in self.policy.decide(self.state, now):
            pending = decision.pending
            self.state.queue.remove(pending)
            req = pending.request
            emulated = min((self.state.declared_bandwidth(req.src, rx) for rx in req.dst), default=0.0)
            rate = decision.rate_bps
            if emulated > 0:
                rate = min(rate, emulated) if rate > 0 else emulated
            latency = max((self.state.declared_latency(req.src, rx) for rx in req.dst), default=0.0)
            grant = Grant(transfer_id=pending.transfer_id, medium=decision.medium, rate_bps=rate,
                          start_at=time.time(), reason=decision.reason, decision=pending.decision,
                          latency_s=latency)
            if decision.medium:
                pending.granted_at = now
                pending.medium = decision.medium
                pending.rate_bps = decision.rate_bps
                self.state.active[pending.transfer_id] = pending
                self.state.granted += 1
                granted += 1
            request_msg = replies.pop(pending.transfer_id, None) if replies else None
            if request_msg is not None:
                await self.transport.reply(request_msg, grant.encode())
            else:
                await self.transport.publish(agent_subject(pending.request.src, "ctl"), grant.encode())
        return granted

    async def _heartbeat(self) -> None:
        while True:
            try:
                hb = GroupHeartbeat(group=self.group, scheduler=self.name, agents=len(self.state.agents))
                await self.transport.publish(COORD_REGISTER, hb.encode())
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                logger.debug("heartbeat failed", exc_info=True)
            await asyncio.sleep(self.config.heartbeat_s)

    async def run_forever(self) -> None:
        """Run until cancelled (Ctrl-C in the CLI)."""
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()
