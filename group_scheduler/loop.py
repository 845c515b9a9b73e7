"""The time-slice loop of a group scheduler: decisions -> grants and controls.

It runs the policy on every event and once per time slice while work waits, and sleeps when
nothing can change (an idle scheduler uses no CPU). Each pass expires what went silent (a
transfer that reported nothing for ``transfer_timeout``, agents whose probes stopped: their
queued transfers are refused), asks the policy (`decide`, then `adjust` with the new grants
active), and sends the grants and the controls (pause / resume / rate) to the senders. A done
report ends a grant: the slot is released and the link estimate, the cost model and the
reservation statistics learn from it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import Any

from nats.aio.msg import Msg
from opentelemetry.trace import Span

from kvbus import telemetry
from kvbus.codecs.errors import SpecError
from kvbus.codecs.spec import medium_spec
from kvbus.errors import WireFormatError
from kvbus.group_scheduler.admission import down_refusal
from kvbus.group_scheduler.config import SchedulerConfig
from kvbus.group_scheduler.learning import LOWER_BOUND_SHARE, SMALL_PAYLOAD_BYTES, measures_link
from kvbus.group_scheduler.policy import Adjustment, Decision, SchedulingPolicy
from kvbus.group_scheduler.reservations import ReservationTable
from kvbus.group_scheduler.state import GroupState, Pending
from kvbus.net.rpc import RpcClient
from kvbus.net.transport import NoResponders, Transport
from kvbus.protocol import (
    PATH_NAMES,
    Control,
    ControlAction,
    ControlReply,
    Grant,
    PathName,
    Reason,
    TransferDone,
    agent_subject,
)

logger = logging.getLogger(__name__)

#: Transfers smaller than this say more about round trips than bandwidth: not used for estimates
#: (they teach the path's fixed cost instead).
MIN_ESTIMATE_BYTES = SMALL_PAYLOAD_BYTES
#: How long a pause request waits for the sender's answer.
PAUSE_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True, slots=True)
class PlannedGrant:
    """One decision of a pass, planned: what `GrantLoop._apply` changes and `_send_grants` sends."""

    decision: Decision
    rate_bps: float
    """The granted rate: the policy's, paced to the declared link capacity (emulation)."""
    data: bytes
    """The encoded `Grant` (a refusal's too)."""
    queued: bool
    """It leaves the queue when applied (a decision of this pass, not a refusal of a transfer already out)."""
    budget: bool
    """The grant carries a rate budget (its transfer keeps the slot until the budget ends)."""


class GrantLoop:
    """Grants the queued transfers of one group, one policy pass per state change or time slice.

    Args:
        transport: the NATS seam (grants and controls go to the senders' ``ctl`` subjects).
        state: the group's S(t).
        policy: the scheduling strategy.
        config: the time slice, the probe TTL and the transfer timeout.
    """

    def __init__(
        self, transport: Transport, state: GroupState, policy: SchedulingPolicy, config: SchedulerConfig
    ) -> None:
        self.transport = transport
        self.state = state
        self.group = state.group
        self.policy = policy
        self.config = config
        self.rpc = RpcClient(transport, timeout=PAUSE_TIMEOUT_S)
        self.slices = 0
        """Scheduling passes run (an idle scheduler runs none)."""
        self.reservation_stats: dict[str, list[float]] = {}
        """Per reservation: seconds from each instance's request to its done report."""
        self.wake = asyncio.Event()
        """Set to make the loop look again now (an event changed what it waits for)."""
        self.side_tasks: set[asyncio.Task[Any]] = set()
        """Pauses waiting for their senders' answers."""
        self._refusals: list[Decision] = []
        """Refusals decided outside a pass (an agent left), sent by the next one."""

    @property
    def reservations(self) -> ReservationTable | None:
        """The policy's reservation table (None for a policy without reservations)."""
        return getattr(self.policy, "reservations", None)

    def next_timeout(self) -> float | None:
        """Seconds until the next pass is due without an event, or None to sleep until one."""
        now = time.monotonic()
        times = []
        wanted = self.policy.next_wakeup(self.state, now)
        if wanted is not None:
            times.append(wanted)
        if self.state.queue or self.state.active:
            expiry = self.state.next_expiry(self.config.probe_ttl_s)
            if expiry is not None:
                times.append(expiry + 0.001)
        if self.state.active:
            times.append(min(p.granted_at for p in self.state.active.values()) + self.config.transfer_timeout)
            budgets = [p.budget_until for p in self.state.active.values() if p.done]
            if budgets:
                times.append(min(budgets) + 0.001)
        return max(0.0, min(times) - now) if times else None

    async def run(self) -> None:
        """Pass whenever woken or due, until cancelled; a failing pass is logged and the loop goes on."""
        while True:
            try:
                timeout = self.next_timeout()
                if timeout is None:
                    await self.wake.wait()
                elif timeout > 0:
                    try:
                        await asyncio.wait_for(self.wake.wait(), timeout)
                    except TimeoutError:
                        pass
                self.wake.clear()
                await self.schedule_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("scheduler loop of %s failed; continuing", self.group)
                await asyncio.sleep(self.config.tick_s)

    def _expire(self, now: float) -> list[Decision]:
        """Mark silent agents down, release their running transfers, refuse their queued ones
        (they leave the queue here; the refusals are returned to be sent)."""
        state, policy = self.state, self.policy
        for tid, p in list(state.active.items()):
            if p.done and now >= p.budget_until:
                del state.active[tid]  # the rate budget ran out: the pair's slot is free
                policy.released(p)
            elif now - p.granted_at > self.config.transfer_timeout:
                logger.warning("transfer %s reported nothing for %.0f s; releasing its slot", tid, now - p.granted_at)
                del state.active[tid]
                policy.released(p)
        gone = state.expire(now, self.config.probe_ttl_s)
        for name in gone:
            logger.warning(
                "group %s: agent %s sent no probe for %.1f s; marked down",
                self.group,
                name,
                now - state.agents[name].last_seen,
            )
        refusals = []
        if state.n_down:
            for p in list(state.queue):
                down = next((a for a in (p.src, *p.dst) if state.is_down(a)), None)
                if down is not None:
                    state.drop(p)
                    policy.withdrawn(state, p)
                    refusal = down_refusal(state, self.config.probe_ttl_s, down, p.src, now)
                    refusals.append(Decision.refusal(p, refusal.reason, refusal.code))
            for tid, p in list(state.active.items()):
                if any(state.is_down(a) for a in (p.src, *p.dst)):
                    del state.active[tid]
                    policy.released(p)
        return refusals

    def departed(self, name: str) -> int:
        """``name`` left the group: its running transfers are released, its own queued ones
        withdrawn, and the queued ones to it refused with `Reason.RECEIVER_GONE` (sent by the next
        pass, which this wakes). Returns how many were refused."""
        state, policy = self.state, self.policy
        refused = 0
        for p in list(state.queue):
            if name != p.src and name not in p.dst:
                continue
            state.drop(p)
            policy.withdrawn(state, p)
            if name != p.src:
                why = f"receiver {name!r} left the group (it closed)"
                self._refusals.append(Decision.refusal(p, why, Reason.RECEIVER_GONE))
                refused += 1
        for tid, p in list(state.active.items()):
            if name == p.src or name in p.dst:
                del state.active[tid]
                policy.released(p)
        self.wake.set()
        return refused

    async def schedule_once(self, replies: dict[str, Msg] | None = None) -> int:
        """One scheduling pass: expire, ask the policy (`decide`, then `adjust` with the new grants
        active), send grants and controls; returns how many were granted.

        ``replies`` maps transfer ids to requests still waiting for their reply: a grant for one of
        them goes out as that reply (and the entry is removed) instead of on the sender's ctl subject.

        In three stages: plan the grants (`_plan`: decisions to encoded grants, state untouched),
        apply them and the policy's adjustments to the state, then send. All state changes come
        before the first await, so a pass that runs while this one sends sees a consistent state.
        """
        now, wall = time.monotonic(), time.time()
        self.slices += 1
        # Refusals of transfers already out of the queue (expired, departed), then the policy's decisions.
        unqueued = self._expire(now) + self._take_refusals()
        decided = self.policy.decide(self.state, now)
        planned = [self._plan(d, now, wall, queued=False) for d in unqueued]
        planned += [self._plan(d, now, wall, queued=True) for d in decided]
        granted = self._apply(planned, now)
        adjustments = self.policy.adjust(self.state, now)  # sees the new grants active
        # Still waiting after this pass: the slots rate budgets hold are freed for the next one.
        withdrawn = self._withdraw_budgets() if self.state.queue else []
        if withdrawn:
            self.wake.set()
        await self._send_grants(planned, replies)
        for adj in adjustments:
            await self._control(adj)
        await self._send_withdrawals(withdrawn)
        return granted

    def _take_refusals(self) -> list[Decision]:
        """The refusals decided outside a pass since the last one (they are sent by this one)."""
        refusals, self._refusals = self._refusals, []
        return refusals

    def _plan(self, decision: Decision, now: float, wall: float, *, queued: bool) -> PlannedGrant:
        """The grant of one decision, encoded: its rate paced to the declared link, its start in
        wall-clock time, its rate budget. Changes no state (its trace span is recorded)."""
        pending = decision.pending
        req = pending.request
        rate = decision.rate_bps
        emulated = min((self.state.declared_bandwidth(req.src, rx) for rx in req.dst), default=0.0)
        if emulated > 0:
            rate = min(rate, emulated) if rate > 0 else emulated
        grant = Grant(
            transfer_id=pending.transfer_id,
            medium=decision.medium,
            rate_bps=rate,
            start_at=wall + max(0.0, decision.start_at - now) if decision.start_at else wall,
            reason=decision.reason,
            decision=pending.decision,
            latency_s=max((self.state.declared_latency(req.src, rx) for rx in req.dst), default=0.0),
            sched_s=max(0.0, wall - req.ts),
            code=decision.code,
            traceparent=_record_decision(pending, decision, rate, wall, now),
        )
        budget = not decision.refused and self._budget(pending)
        if budget:
            grant = dataclasses.replace(grant, budget_s=self.config.budget_s, budget_bytes=self.config.budget_max_bytes)
        return PlannedGrant(decision, rate, grant.encode(), queued=queued, budget=budget)

    def _apply(self, planned: list[PlannedGrant], now: float) -> int:
        """Move the planned transfers out of the queue and the granted ones into the active set
        (telling the policy); returns how many were granted."""
        state = self.state
        granted = 0
        for plan in planned:
            pending = plan.decision.pending
            if plan.queued:
                state.queue.remove(pending)
            if plan.budget:
                pending.budget_until = now + self.config.budget_s
            if plan.decision.refused:
                state.refused += 1
                continue
            pending.granted_at = now
            pending.medium = plan.decision.medium
            pending.rate_bps = plan.rate_bps
            pending.grant = plan.data
            state.active[pending.transfer_id] = pending
            self.policy.started(state, pending)
            state.granted += 1
            granted += 1
        return granted

    async def _send_grants(self, planned: list[PlannedGrant], replies: dict[str, Msg] | None) -> None:
        """Each grant as the reply its request waits for, else on its sender's ctl subject."""
        for plan in planned:
            pending = plan.decision.pending
            request_msg = replies.pop(pending.transfer_id, None) if replies else None
            if request_msg is not None:
                await self.transport.reply(request_msg, plan.data)
            else:
                await self.transport.publish(agent_subject(pending.request.src, "ctl"), plan.data)

    async def _send_withdrawals(self, withdrawn: list[Pending]) -> None:
        """Tell the senders whose rate budgets were withdrawn (a ``cancel`` of the budget)."""
        for p in withdrawn:
            ctl = Control(
                transfer_id=p.transfer_id, action=ControlAction.CANCEL, reason="rate budget withdrawn: transfers wait"
            )
            try:
                await self.transport.publish(agent_subject(p.src, "ctl"), ctl.encode())
            except Exception:
                logger.warning("could not withdraw the rate budget of %s", p.src, exc_info=True)

    def _withdraw_budgets(self) -> list[Pending]:
        """Free the slots of rate budgets whose transfer is done: a budget never makes anyone wait."""
        withdrawn = []
        for tid, p in list(self.state.active.items()):
            if p.done:
                del self.state.active[tid]
                self.policy.released(p)
                withdrawn.append(p)
        return withdrawn

    async def _control(self, adj: Adjustment) -> None:
        p = adj.pending
        ctl = Control(
            transfer_id=p.transfer_id,
            action=adj.action,
            reason=adj.reason,
            rate_bps=adj.rate_bps,
            max_fraction=adj.max_fraction,
        )
        if adj.action == ControlAction.PAUSE:
            # Conditional: the sender answers whether it paused (it declines past the threshold).
            self.state.preemptions += 1
            telemetry.instruments().preemptions.add(1, {"group": self.group})
            task = asyncio.create_task(self._pause(p, ctl), name=f"kvbus-pause-{p.transfer_id}")
            self.side_tasks.add(task)
            task.add_done_callback(self.side_tasks.discard)
            return
        try:
            await self.transport.publish(agent_subject(p.src, "ctl"), ctl.encode())
        except Exception:
            logger.warning("could not send %s to %s", adj.action, p.src, exc_info=True)

    async def _pause(self, p: Pending, ctl: Control) -> None:
        try:
            data = await self.rpc.request(agent_subject(p.src, "ctl"), ctl.encode(), key=p.transfer_id)
            reply = ControlReply.decode(data)
            ok, why = reply.ok, reply.reason
        except (NoResponders, TimeoutError, WireFormatError) as exc:
            ok, why = False, f"no answer ({type(exc).__name__})"
        if ok:
            logger.debug("transfer %s paused at %.0f%%", p.transfer_id, 100 * reply.fraction)
            return
        if self.state.active.get(p.transfer_id) is not p:
            return
        logger.info("transfer %s not paused: %s", p.transfer_id, why)
        p.paused = False
        p.paused_by.clear()
        p.unpreemptible = True
        self.state.declined_pauses += 1
        self.policy.changed()
        self.wake.set()

    def _budget(self, pending: Pending) -> bool:
        """Whether its grant comes with a rate budget: a small transfer that asked, with no deadline or reservation."""
        req = pending.request
        return (
            req.budget
            and self.config.budget_s > 0
            and req.nbytes <= self.config.budget_max_bytes
            and req.deadline is None
            and not pending.reservation
        )

    def finished(self, done: TransferDone) -> None:
        """A sender reported a transfer done (or failed): release its slot and learn from it.

        A transfer that ran under a granted transfer's rate budget only teaches (the slot is the
        budget's); a granted transfer whose budget still runs keeps its slot until the budget
        ends, or until its sender ends it (a done naming it as its own budget).
        """
        state = self.state
        if done.budget and done.budget != done.transfer_id:
            holder = state.active.get(done.budget)
            if holder is not None and holder.src == done.src and done.ok:
                state.completed += 1
                self._learn(done, holder, budgeted=True)
                self.policy.leased(holder, done.nbytes, time.monotonic())
            return
        pending = state.active.get(done.transfer_id)
        if pending is None or pending.src != done.src:
            return  # not running, or another agent's (its id leaked): never released by a third party
        first = not pending.done
        pending.done = True
        if done.ok and not done.budget and time.monotonic() < pending.budget_until:
            state.completed += 1
            self._learn(done, pending)
            self.policy.budget_only(pending)
            self.policy.leased(pending, done.nbytes, time.monotonic())
            self.wake.set()  # the loop's next wake-up: the budget's end
            return  # its budget goes on
        del state.active[done.transfer_id]
        self.policy.released(pending)
        if not first:
            self.wake.set()  # a budget its sender ended: the pair's next transfer may start
            return
        if done.ok:
            state.completed += 1
            self._learn(done, pending)
        else:
            state.failed += 1
            logger.info("transfer %s failed: %s", done.transfer_id, done.error)
        self.wake.set()

    def _learn(self, done: TransferDone, pending: Pending, *, budgeted: bool = False) -> None:
        """The link estimates, the cost model and the reservation stats from a transfer that went well."""
        state = self.state
        path = done.path or PathName.NATS
        model = getattr(self.policy.selector, "model", None)
        fixed = 0.0
        if model is not None and path in PATH_NAMES and done.dst:
            est = state.link(done.src, done.dst[0], path)
            declared = state.declared_bandwidth(done.src, done.dst[0])
            bw = est.bandwidth_bps if est.known else declared if declared > 0 else None
            req = pending.request
            fixed = model.learned.observe_transfer(
                done,
                pending.decision,
                kv_bytes=req.nbytes,
                new_tokens=max(0, req.n_tokens - req.base_tokens) if _is_delta(done.medium) else req.n_tokens,
                bandwidth_bps=bw,
                teach_codec=not budgeted,
                reference_tps=model.default_model_costs.reference_tps,
            )
        if done.nbytes >= MIN_ESTIMATE_BYTES and done.wire_s > 0 and path in PATH_NAMES:
            wire_s = done.wire_s - fixed  # the bytes' own time: a transfer's round trips are not the link
            # A split's rate is only a lower bound of its link's (`measures_link`).
            floor = 0.0 if measures_link(done.medium) else LOWER_BOUND_SHARE
            probe = bool(pending.decision.get("explored_link"))
            # A probe of the pair's link that rode on another path than the one it probed (padded
            # ids go inline through NATS, the KV it stands for goes direct) tells that path too:
            # both cross the receiver's link, and the next KV transfer measures the path itself.
            probed = pending.decision.get("path")
            also = probed if probe and probed != path and probed in PATH_NAMES else None
            for rx in done.dst:
                link = state.link(done.src, rx, path)
                if floor and done.nbytes / wire_s < floor * link.bandwidth_bps:
                    continue
                link.observe(done.nbytes, wire_s, probe=probe)
                if also is not None:
                    state.link(done.src, rx, also).observe(done.nbytes, wire_s, probe=True)
                telemetry.instruments().link_bandwidth.record(
                    done.nbytes / wire_s, {"group": self.group, "link": f"{done.src}->{rx}", "path": path}
                )
        compute_s = done.seconds - done.wire_s  # encode, decode, recompute: what the link estimate does not say
        if model is not None and pending.predicted_split is not None and not budgeted:
            # A split's prefill runs during its stream and slows it down: its time beyond the
            # rest of its cost, not its time off the wire, says what the prefill took.
            prefill_s, stream_s, base_s = pending.predicted_split
            model.observe_split(
                pending.medium, prefill_s=prefill_s, stream_s=stream_s, base_s=base_s, observed_s=done.seconds
            )
        elif model is not None and pending.predicted_comp_s > 0 and done.wire_s > 0 and compute_s > 0 and not budgeted:
            model.observe(pending.medium, pending.predicted_comp_s, compute_s)
        if pending.reservation and not budgeted:
            took = time.monotonic() - pending.arrived
            self.reservation_stats.setdefault(pending.reservation, []).append(took)
            table = self.reservations
            r = table.get(pending.reservation) if table is not None else None
            if r is not None and took > r.deadline_s:
                telemetry.instruments().reservation_misses.add(1, {"group": self.group})


def _is_delta(medium: str) -> bool:
    """Whether a `TransferDone`'s medium (wire text) is a delta; a report of a transfer that
    never got a medium, or names a malformed one, is not."""
    try:
        return medium_spec(medium).delta
    except SpecError:
        return False


def _record_decision(pending: Pending, decision: Decision, rate: float, wall: float, now: float) -> str | None:
    """The ``kvbus.schedule`` span of one decided transfer, from the request's arrival to the decision.

    A child of the sender's grant wait (the request's ``traceparent``), made `later` (after the
    grant is out); when the sender does not trace, a root span of its own, started now: its
    ``traceparent`` is returned for the grant to carry, so that the receiver's span can link to it.
    """
    if not telemetry.tracing():
        return None
    parent = pending.request.traceparent
    arrived_ns = int((wall - max(0.0, now - pending.arrived)) * 1e9)
    if parent:
        telemetry.later(_decision_span, pending, decision, rate, now, None, parent, arrived_ns, time.time_ns())
        return None
    span = telemetry.start("kvbus.schedule", parent=telemetry.ROOT, start_time=arrived_ns)
    telemetry.later(_decision_span, pending, decision, rate, now, span, None, arrived_ns, time.time_ns())
    return telemetry.traceparent(span)


def _decision_span(
    pending: Pending,
    decision: Decision,
    rate: float,
    now: float,
    span: Span | None,
    parent: str | None,
    start_ns: int,
    end_ns: int,
) -> None:
    """Record the decision on its span (``span``: started already; else made now, a child of ``parent``)."""
    if span is None:
        span = telemetry.start("kvbus.schedule", parent=parent, start_time=start_ns)
    if span.is_recording():
        choice = pending.decision or {}
        chosen: dict[str, Any] = next(
            (c for c in choice.get("candidates", ()) if c.get("medium") == choice.get("medium")), {}
        )
        terms = {f"kvbus.predicted.{k}": float(chosen[k]) for k in ("comm_s", "comp_s", "loss_s") if k in chosen}
        span.set_attributes(
            {
                **terms,
                "kvbus.explored": bool(choice.get("explored")),
                "kvbus.transfer_id": pending.transfer_id,
                "kvbus.medium": decision.medium,
                "kvbus.rate_bps": rate,
                "kvbus.group": pending.request.group,
                "kvbus.src": pending.src,
                "kvbus.dst": ",".join(pending.dst),
                "kvbus.reason": decision.reason,
                "kvbus.granted": not decision.refused,
                "kvbus.queue_wait_s": max(0.0, now - pending.arrived),
                "kvbus.predicted_s": float(choice.get("predicted_s") or 0.0),
                "kvbus.candidates": json.dumps(choice.get("candidates", []), separators=(",", ":"), default=str),
            }
        )
    span.end(end_time=end_ns)
