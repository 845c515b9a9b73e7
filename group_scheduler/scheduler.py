"""The group scheduler process: request -> grant -> (stream) -> done for one group.

`GroupScheduler` wires the parts and serves the group's subjects while it leads (a
`kvbus.net.service.ReplicatedService`; standbys keep S(t) warm from the probes):

- `kvbus.group_scheduler.directory`: the agent directory cache a JetStream watch keeps current;
- `kvbus.group_scheduler.handlers`: what it does with each message (requests, done, leave, probes);
- `kvbus.group_scheduler.admission`: checking a request before it is queued (reason codes);
- `kvbus.group_scheduler.loop`: the time-slice loop, grants, controls, done reports;
- `kvbus.group_scheduler.reservation_store`: the admitted reservations in JetStream KV;
- `kvbus.group_scheduler.memory_hints`: shed hints to agents over their cache watermark;
- `kvbus.group_scheduler.intergroup`: the inter-group bandwidth lease from the coordinator.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from nats.aio.msg import Msg

from kvbus.errors import WireFormatError
from kvbus.group_scheduler.admission import RequestAdmission, check_sender, refusal_code
from kvbus.group_scheduler.config import SchedulerConfig
from kvbus.group_scheduler.cost_model import CostModel
from kvbus.group_scheduler.directory import Directory
from kvbus.group_scheduler.handlers import SchedulerHandlers
from kvbus.group_scheduler.intergroup import InterGroupLease
from kvbus.group_scheduler.learning import LearnedStore
from kvbus.group_scheduler.loop import GrantLoop
from kvbus.group_scheduler.memory_hints import MemoryHints
from kvbus.group_scheduler.policies import make_policy
from kvbus.group_scheduler.policy import SchedulingPolicy
from kvbus.group_scheduler.reservation_store import ReservationStore
from kvbus.group_scheduler.reservations import (
    Admission,
    AdmissionControl,
    CoordinatorAdmission,
    LocalAdmission,
    Reservation,
    ReservationTable,
)
from kvbus.group_scheduler.selection import default_selector
from kvbus.group_scheduler.state import GroupState
from kvbus.net.buckets import transport_bucket
from kvbus.net.service import Endpoint, ReplicatedService, bounded, replica_name
from kvbus.net.transport import NatsTransport, Transport
from kvbus.protocol import (
    COORD_BUCKET,
    COORD_REGISTER,
    AgentRecord,
    FlowReservation,
    GroupHeartbeat,
    Reason,
    ReservationReply,
    check_name,
    group_subject,
    sched_subject,
)

__all__ = ["GroupScheduler"]

logger = logging.getLogger(__name__)


class GroupScheduler(SchedulerHandlers, ReplicatedService):
    """Grants the transfers of one group's agents, one decision per state change or time slice.

    Args:
        transport: the NATS seam.
        group: the group's name.
        policy: the scheduling strategy (default: the one ``config.policy`` names, ``wrr``).
        config: settings (default: `SchedulerConfig.from_env`).
        admission: admission control for reservations (default: ``config.admission``: the group's
            own budget, or that and the coordinator's table).
    """

    def __init__(
        self,
        transport: Transport,
        group: str,
        *,
        policy: SchedulingPolicy | None = None,
        config: SchedulerConfig | None = None,
        admission: AdmissionControl | None = None,
    ) -> None:
        group = check_name("group", group)
        # Unique per replica: the leader lease tells holders apart by name.
        super().__init__(transport, replica_name(group))
        self.group = group
        self.config = config or SchedulerConfig.from_env()
        self.policy = policy or make_policy(self.config, default_selector(self.config))
        self.state = GroupState(group, bandwidth_bps=self.config.bandwidth_bps)
        local = LocalAdmission(self.config.reservable_fraction, self.config.reservation_headroom)
        if admission is None and self.config.admission == "coordinator":
            admission = CoordinatorAdmission(transport, self.group, local)
        self.admission = admission or local
        self.directory = Directory(transport, self.state, self.config)
        """The agent directory cache."""
        self.requests = RequestAdmission(self.directory, self.state, self.config)
        """Checks requests before they are queued."""
        self.loop = GrantLoop(transport, self.state, self.policy, self.config)
        """The time-slice loop: decisions -> grants and controls."""
        self.store = ReservationStore(transport, group)
        """The admitted reservations in JetStream KV."""
        self.learned_store = LearnedStore(transport, group)
        """What the cost model learned, in JetStream KV (loaded when this replica starts serving)."""
        self.memory = MemoryHints(self.config)
        """Cache watermarks and shed hints."""
        self.inter = InterGroupLease(
            transport,
            self.state,
            self.name,
            default_bps=self.config.default_bandwidth_bps,
            priority=self.config.lease_priority,
            timeout=self.config.coordinator_timeout_s,
            on_change=self._lease_changed,
        )
        """The group's inter-group bandwidth lease from the coordinator."""
        self._tasks: list[asyncio.Task[None]] = []
        self._probe_sub: Any = None
        self._leave_sub: Any = None
        self._admitting: dict[str, bool] = {}
        """Requests waiting for their directory lookups: transfer id -> asked again meanwhile."""
        self._admit_tasks: set[asyncio.Task[None]] = set()

    def _lease_changed(self) -> None:
        self.policy.changed()
        self.loop.wake.set()

    @classmethod
    async def connect(
        cls, url: str | Sequence[str], group: str, *, nats_options: dict[str, Any] | None = None, **kwargs: Any
    ) -> GroupScheduler:
        """Connect to NATS (``nats_options`` go to `nats.connect`: credentials, TLS, inbox prefix) and start."""
        opts = {"name": f"kvbus-scheduler-{group}", **(nats_options or {})}
        sched = cls(await NatsTransport.connect(url, **opts), group, **kwargs)
        await sched.start()
        return sched

    # -- what other code reads -------------------------------------------------------------------

    @property
    def reservations(self) -> ReservationTable | None:
        """The policy's reservation table (None for a policy without reservations)."""
        return self.loop.reservations

    @property
    def slices(self) -> int:
        """Scheduling passes run (an idle scheduler runs none)."""
        return self.loop.slices

    @property
    def sheds(self) -> int:
        """Shed hints sent."""
        return self.memory.sheds

    @property
    def reservation_stats(self) -> dict[str, list[float]]:
        """Per reservation: seconds from each instance's request to its done report."""
        return self.loop.reservation_stats

    async def lookup(self, agent: str) -> AgentRecord | None:
        """An agent's record from the JetStream directory (`Directory.lookup`)."""
        return await self.directory.lookup(agent)

    async def schedule_once(self, replies: dict[str, Msg] | None = None) -> int:
        """One scheduling pass (`GrantLoop.schedule_once`); returns how many were granted."""
        return await self.loop.schedule_once(replies)

    def set_watermark(self, agent: str, nbytes: int) -> None:
        """Set (or, with 0, clear) an agent's cache watermark for memory hints."""
        self.memory.set_watermark(agent, nbytes)

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Restore reservations, then serve the group, or (with replicas) campaign and serve once elected."""
        if self.reservations is not None:
            await self.store.restore(self.reservations, self.config.reservation_headroom)
        # Probes reach every replica, so a standby's S(t) is warm when it takes over.
        self._probe_sub = await self.transport.subscribe(sched_subject(self.group, "probe", "*"), self._on_probe)
        # So do leaves: a standby must not keep a departed agent either.
        self._leave_sub = await self.transport.subscribe(sched_subject(self.group, "leave", "*"), self._on_leave)
        self._tasks = [
            asyncio.create_task(self.loop.run(), name=f"kvbus-sched-{self.group}"),
            asyncio.create_task(self._heartbeat(), name=f"kvbus-sched-hb-{self.group}"),
            asyncio.create_task(self.inter.run(), name=f"kvbus-sched-lease-{self.group}"),
            asyncio.create_task(self.directory.watch(), name=f"kvbus-sched-dir-{self.group}"),
            asyncio.create_task(self._save_learned(), name=f"kvbus-sched-learned-{self.group}"),
        ]
        bucket = await transport_bucket(self.transport, COORD_BUCKET) if self.config.leader_ttl_s > 0 else None
        await self.campaign(bucket, f"sched.{self.group}", ttl=self.config.leader_ttl_s)

    def endpoints(self) -> list[Endpoint]:
        """The group's subjects. Without an election a queue group lets replicas share them; with
        one, only the leader subscribes and the queue group is moot."""
        q = f"kvbus-sched-{self.group}"
        return [
            Endpoint(sched_subject(self.group, "request", "*"), self._on_request, q),
            Endpoint(sched_subject(self.group, "done", "*"), self._on_done, q),
            Endpoint(sched_subject(self.group, "reserve", "*"), self._on_reserve, q),
            Endpoint(sched_subject(self.group, "state"), self._on_state, q),
            Endpoint(sched_subject(self.group, "register", "*"), self._on_register, q),
        ]

    @property
    def cost_model(self) -> CostModel | None:
        """The adaptive selector's cost model (None for a static selector)."""
        model = getattr(self.policy.selector, "model", None)
        return model if isinstance(model, CostModel) else None

    async def now_serving(self) -> None:
        """Take up what the group learned (a restart or a standby taking over starts from it, not
        from the prior alone), then look at the queue at once (a standby may hold re-sent requests)."""
        model = self.cost_model
        if model is not None and self.config.learned_save_s > 0:
            stored = await self.learned_store.load()
            if stored is not None:
                model.learned = stored
                logger.info(
                    "group %s: learned costs restored (%d codec, %d fixed-cost, %d prefill entries)",
                    self.group,
                    len(stored.codec),
                    len(stored.fixed_s),
                    len(stored.prefill_tps),
                )
        self.loop.wake.set()
        logger.info("group scheduler %s serving (%s policy)", self.name, type(self.policy).__name__)

    async def closing(self) -> None:
        """Stop renewing the inter-group lease and, as the serving replica, keep what it learned
        and leave the coordinator."""
        self.inter.stop()
        self.directory.stopped = True
        if self.serving:
            model = self.cost_model
            if model is not None and model.learned.changes and self.config.learned_save_s > 0:
                await bounded(self.learned_store.save(model.learned), "save the learned costs")
            await bounded(self.inter.leave(), "leave")

    async def _save_learned(self) -> None:
        """Every ``learned_save_s``, write what the cost model learned since (the serving replica only)."""
        if self.config.learned_save_s <= 0:
            return
        while True:
            await asyncio.sleep(self.config.learned_save_s)
            model = self.cost_model
            if self.serving and model is not None and model.learned.changes:
                await self.learned_store.save(model.learned)

    async def closed_down(self) -> None:
        """Stop the background tasks and the probe subscription."""
        tasks = [*self._tasks, *self.loop.side_tasks, *self._admit_tasks]
        for task in tasks:
            task.cancel()
        for task in tasks:
            await bounded(task, "stop a background task")
        for sub in (self._probe_sub, self._leave_sub):
            if sub is not None:
                await bounded(sub.unsubscribe(), "unsubscribe")

    async def _heartbeat(self) -> None:
        while True:
            try:
                if self.serving:  # a standby is not the group's scheduler (yet)
                    hb = GroupHeartbeat(group=self.group, scheduler=self.name, agents=len(self.state.agents))
                    await self.transport.publish(group_subject(COORD_REGISTER, self.group), hb.encode())
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.debug("heartbeat failed", exc_info=True)
            await asyncio.sleep(self.config.heartbeat_s)

    # -- reservations ------------------------------------------------------------------------------

    async def reserve(
        self,
        src: str,
        dst: list[str],
        *,
        period_s: float,
        size_bytes: int,
        deadline_s: float,
        reservation_id: str | None = None,
    ) -> Admission:
        """Admit (or refuse) a periodic critical flow; the same as an agent's `Agent.reserve`."""
        msg = FlowReservation(
            reservation_id=reservation_id or uuid.uuid4().hex[:16],
            src=src,
            dst=list(dst),
            group=self.group,
            period_s=float(period_s),
            size_bytes=int(size_bytes),
            deadline_s=float(deadline_s),
        )
        return await self._admit(msg)

    async def unreserve(self, reservation_id: str) -> bool:
        """Cancel a reservation; False when there is none by that id."""
        table = self.reservations
        r = table.remove(reservation_id) if table is not None else None
        if r is None:
            return False
        await self.admission.release(r)
        await self.store.delete(reservation_id)
        self.policy.changed()
        self.loop.wake.set()
        return True

    async def _admit(self, msg: FlowReservation) -> Admission:
        table = self.reservations
        if table is None:
            return Admission(
                False, f"the {type(self.policy).__name__} policy does not support reservations", code=Reason.REFUSED
            )
        try:
            for name in [msg.src, *msg.dst]:
                check_name("agent", name)
            if not msg.dst:
                raise ValueError("a reservation needs at least one receiver")
        except ValueError as exc:
            return Admission(False, str(exc), code=Reason.MALFORMED)
        r = Reservation.from_message(msg, time.monotonic())
        verdict = await self.admission.admit(r, table, self.state)
        if not verdict.ok:
            logger.info(
                "reservation %s (%s -> %s) refused: %s", r.reservation_id, r.src, ",".join(r.dst), verdict.reason
            )
            return verdict
        r.rate_bps = verdict.rate_bps
        table.add(r)
        await self.store.put(r)
        self.policy.changed()
        self.loop.wake.set()
        return verdict

    async def _on_reserve(self, msg: Msg) -> None:
        try:
            req = FlowReservation.decode(msg.data)
            check_sender(msg, req.src)
        except (WireFormatError, ValueError) as exc:
            await self.transport.reply(msg, ReservationReply("", False, str(exc), code=refusal_code(exc)).encode())
            return
        if req.cancel:
            found = await self.unreserve(req.reservation_id)
            reply = ReservationReply(
                req.reservation_id,
                found,
                "cancelled" if found else "no such reservation",
                code=Reason.NONE if found else Reason.NOT_FOUND,
            )
        else:
            verdict = await self._admit(req)
            reply = ReservationReply(
                req.reservation_id, verdict.ok, verdict.reason, verdict.rate_bps, code=verdict.code
            )
        await self.transport.reply(msg, reply.encode())
