"""The message handlers of the group scheduler: requests, done reports, leaves, registrations, probes.

`SchedulerHandlers` is a mixin of `kvbus.group_scheduler.scheduler.GroupScheduler`: its methods
answer the group's subjects (`GroupScheduler.endpoints`) and the probe and leave subscriptions
every replica keeps; the attributes it names are the scheduler's.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg

from kvbus import telemetry
from kvbus.errors import WireFormatError
from kvbus.group_scheduler.admission import Refusal, RequestAdmission, check_sender, parse_request, refusal_code
from kvbus.group_scheduler.config import SchedulerConfig
from kvbus.group_scheduler.directory import Directory
from kvbus.group_scheduler.intergroup import InterGroupLease
from kvbus.group_scheduler.loop import GrantLoop
from kvbus.group_scheduler.memory_hints import MemoryHints
from kvbus.group_scheduler.policy import SchedulingPolicy
from kvbus.group_scheduler.snapshot import snapshot
from kvbus.group_scheduler.state import GroupState, Pending
from kvbus.net.transport import Transport
from kvbus.protocol import (
    AgentLeave,
    AgentRecord,
    Grant,
    Probe,
    Reason,
    RequestAck,
    TransferDone,
    TransferRequest,
    agent_subject,
    check_name,
    packb,
)

logger = logging.getLogger(__name__)


class SchedulerHandlers:
    """What `GroupScheduler` does with each message it is sent (a mixin: the scheduler sets the attributes)."""

    transport: Transport
    group: str
    config: SchedulerConfig
    state: GroupState
    policy: SchedulingPolicy
    directory: Directory
    requests: RequestAdmission
    loop: GrantLoop
    memory: MemoryHints
    inter: InterGroupLease
    _admitting: dict[str, bool]
    _admit_tasks: set[asyncio.Task[None]]

    async def _on_request(self, msg: Msg) -> None:
        try:
            req = parse_request(msg, self.config.max_receivers)
        except (WireFormatError, ValueError) as exc:
            ack = RequestAck(transfer_id="", ok=False, reason=f"bad request: {exc}", code=refusal_code(exc))
            await self.transport.reply(msg, ack.encode())
            return
        self.state.heard_from(req.src)  # a request is proof of life, like a probe (its loop may be busy)
        tid = req.transfer_id
        known = self.state.find(tid)
        if known is not None:
            # Asked again (the reply or the grant went astray, or the sender checks after a
            # failover): one entry per transfer id, the grant again if it has one.
            answer = known.grant or RequestAck(tid, ok=True, reason="queued").encode()
            await self.transport.reply(msg, answer)
            return
        if tid in self._admitting:
            # Still waiting for its lookups: the answer follows on the sender's ctl subject.
            self._admitting[tid] = True
            await self.transport.reply(msg, RequestAck(tid, ok=True, reason="queued").encode())
            return
        pending = self.requests.admit_now(req)
        if pending is not None:
            await self._queue(msg, req, pending)
            return
        # Its receivers need a directory lookup: done aside (bounded in time), so that the
        # requests behind it are answered meanwhile; the handler takes requests one at a time.
        if len(self._admitting) >= self.config.max_admitting:
            busy = Refusal(Reason.UNAVAILABLE, "too many requests are waiting for directory lookups; ask again later")
            await self._queue(msg, req, busy)
            return
        self._admitting[tid] = False
        task = asyncio.create_task(self._admit_aside(msg, req), name=f"kvbus-admit-{tid}")
        self._admit_tasks.add(task)
        task.add_done_callback(self._admit_tasks.discard)

    async def _admit_aside(self, msg: Msg, req: TransferRequest) -> None:
        try:
            try:
                pending = await self.requests.admit(req)
            finally:
                asked_again = self._admitting.pop(req.transfer_id, False)
            await self._queue(msg, req, pending, asked_again=asked_again)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("group %s: admitting transfer %s failed", self.group, req.transfer_id)

    async def _queue(
        self, msg: Msg, req: TransferRequest, pending: Pending | Refusal, *, asked_again: bool = False
    ) -> None:
        """Answer an admitted request: its refusal, or queue it and decide at once.

        ``asked_again``: the sender asked again while it was being admitted (its first request may
        have timed out), so a refusal or a grant also goes to its ctl subject.
        """
        tid = req.transfer_id
        if isinstance(pending, Refusal):
            ack = RequestAck(tid, ok=False, reason=pending.reason, code=pending.code)
            await self.transport.reply(msg, ack.encode())
            if asked_again:
                refusal = Grant(tid, "", reason=pending.reason, code=pending.code)
                await self.transport.publish(agent_subject(req.src, "ctl"), refusal.encode())
            return
        self.state.queue.append(pending)
        self.policy.queued(self.state, pending)
        if self.state.remote and self.state.inter_group(pending):
            await self.inter.ensure(req.traceparent)  # granted within the lease, not before one is in force
        # Decide now: a transfer that can start at once gets its grant as the reply (one round
        # trip instead of two); otherwise the reply says "queued" and the grant follows on ctl.
        replies = {} if asked_again else {tid: msg}
        await self.loop.schedule_once(replies)
        if asked_again or tid in replies:
            await self.transport.reply(msg, RequestAck(tid, ok=True, reason="queued").encode())
        self.loop.wake.set()  # the loop's next deadline may have moved (a slice's reallocation, aging)

    async def _on_done(self, msg: Msg) -> None:
        try:
            done = TransferDone.decode(msg.data)
            check_sender(msg, done.src)
        except (WireFormatError, ValueError) as exc:
            logger.warning("done message dropped: %s", exc)
            return
        self.state.heard_from(done.src)
        self.loop.finished(done)

    async def _on_leave(self, msg: Msg) -> None:
        """An agent closed and said so: drop it at once, refuse transfers to it from now on."""
        try:
            leave = AgentLeave.decode(msg.data)
            check_sender(msg, leave.agent)
        except (WireFormatError, ValueError) as exc:
            logger.info("group %s: leave message dropped: %s", self.group, exc)
            return
        if leave.group != self.group:
            return
        self.state.depart(leave.agent, leave.ts)
        refused = self.loop.departed(leave.agent)
        logger.info(
            "group %s: agent %s left (%s)%s",
            self.group,
            leave.agent,
            leave.reason[:200] or "closed",
            f"; {refused} queued transfer(s) to it refused" if refused else "",
        )

    async def _on_register(self, msg: Msg) -> None:
        """An agent's record, sent to us because it has no JetStream rights (secure mode): we write it."""
        try:
            record = AgentRecord.decode(msg.data)
            check_name("agent", record.name)
            check_sender(msg, record.name)
            if record.group != self.group:
                raise WireFormatError("agent record", f"group {record.group!r} is not {self.group!r}")
        except (WireFormatError, ValueError) as exc:
            logger.info("group %s: registration refused: %s", self.group, exc)
            return
        self.state.returned(record.name)  # registering again after it left: a new incarnation
        try:
            await self.directory.write(record)
            await self.transport.reply(msg, b"ok")
        except Exception:
            logger.exception("group %s: could not write %s to the directory", self.group, record.name)

    async def _on_probe(self, msg: Msg) -> None:
        try:
            probe = Probe.decode(msg.data)
            check_sender(msg, probe.agent)
        except (WireFormatError, ValueError):
            return
        if probe.group != self.group:
            return
        now = time.monotonic()
        agent = self.state.on_probe(probe, now)
        self.policy.probed(self.state, agent)
        telemetry.instruments().memory_peak.record(probe.cache_bytes, {"group": self.group, "agent": probe.agent})
        hint = self.memory.on_probe(agent, now)
        if hint is None:
            return
        try:
            await self.transport.publish(agent_subject(agent.name, "ctl"), hint.encode())
        except Exception:
            logger.debug("shed hint to %s failed", agent.name, exc_info=True)

    async def _on_state(self, msg: Msg) -> None:
        try:
            await self.transport.reply(msg, packb(snapshot(self)))
        except Exception:
            logger.debug("state snapshot failed", exc_info=True)
