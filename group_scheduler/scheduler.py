"""The group scheduler process: request -> grant -> (stream) -> done for one group.

It keeps the group's state S(t) (agents from probes, links from observed transfers, the queue
and the running transfers), runs the policy on every event and once per time slice while work
waits, and sleeps when nothing can change (an idle scheduler uses no CPU). It marks agents
whose probes stop as down and refuses their queued transfers, sends running transfers their
pause / resume / rate controls, tells agents over their cache watermark to shed, and admits
reservations (kept in JetStream KV, so a restarted scheduler still has them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from typing import Any

from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError, NoKeysError

from kvbus import telemetry
from kvbus.net.buckets import transport_bucket
from kvbus.net.transport import NatsTransport, NoResponders, Transport
from kvbus.errors import WireFormatError
from kvbus.group_scheduler.config import SchedulerConfig
from kvbus.net.leader import LeaderLease
from kvbus.group_scheduler.cost_model import CostConfig, CostModel
from kvbus.group_scheduler.intergroup import InterGroupLease
from kvbus.group_scheduler.policies import make_policy
from kvbus.group_scheduler.policy import Adjustment, Decision, MediumSelector, SchedulingPolicy, StaticSelector
from kvbus.group_scheduler.reservations import (
    Admission,
    AdmissionControl,
    CoordinatorAdmission,
    LocalAdmission,
    Reservation,
    ReservationTable,
)
from kvbus.group_scheduler.selection import AdaptiveSelector
from kvbus.group_scheduler.snapshot import snapshot
from kvbus.group_scheduler.state import GroupState, Pending
from kvbus.protocol import (
    AGENTS_BUCKET,
    COORD_BUCKET,
    COORD_REGISTER,
    AgentRecord,
    Control,
    ControlReply,
    FlowReservation,
    Grant,
    GroupHeartbeat,
    Probe,
    RequestAck,
    ReservationReply,
    TransferDone,
    TransferRequest,
    agent_subject,
    check_name,
    packb,
    sched_subject,
    subject_sender,
)
from kvbus.signature import ModelSignature
from kvbus.group_scheduler.signatures import signature_of

logger = logging.getLogger(__name__)

#: Transfers smaller than this say more about round trips than bandwidth: not used for estimates.
MIN_ESTIMATE_BYTES = 64 * 1024
#: JetStream KV bucket where group schedulers keep their admitted reservations (key ``<group>.<id>``).
RESERVATIONS_BUCKET = "kvbus_sched_reservations"
#: How long a pause request waits for the sender's answer.
PAUSE_TIMEOUT_S = 2.0
#: A re-sent request keeps its original queue time, but never more than this much of it.
MAX_CARRIED_WAIT_S = 600.0


async def _bounded(aw: Any, what: str, timeout: float = 5.0) -> None:
    """Await ``aw`` for at most ``timeout`` seconds while closing; log and go on otherwise."""
    try:
        await asyncio.wait_for(aw, timeout)
    except asyncio.CancelledError:
        pass
    except (Exception, TimeoutError):  # noqa: BLE001 - closing anyway
        logger.debug("closing: could not %s", what, exc_info=True)


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
    """Grants the transfers of one group's agents, one decision per state change or time slice.

    Args:
        transport: the NATS seam.
        group: the group's name.
        policy: the scheduling strategy (default: the one ``config.policy`` names, ``wrr``).
        config: settings (default: `SchedulerConfig.from_env`).
        admission: admission control for reservations (default: ``config.admission``: the group's
            own budget, or that and the coordinator's table).
    """

    def __init__(self, transport: Transport, group: str, *, policy: SchedulingPolicy | None = None,
                 config: SchedulerConfig | None = None, admission: AdmissionControl | None = None) -> None:
        self.transport = transport
        self.group = check_name("group", group)
        self.config = config or SchedulerConfig.from_env()
        self.policy = policy or make_policy(self.config, default_selector(self.config))
        self.state = GroupState(group, bandwidth_bps=self.config.bandwidth_bps)
        local = LocalAdmission(self.config.reservable_fraction, self.config.reservation_headroom)
        if admission is None and self.config.admission == "coordinator":
            admission = CoordinatorAdmission(transport, self.group, local)
        self.admission = admission or local
        # Unique per replica: the leader lease tells holders apart by name.
        self.name = f"{group}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.slices = 0
        """Scheduling passes run (an idle scheduler runs none)."""
        self.sheds = 0
        """Shed hints sent."""
        self.reservation_stats: dict[str, list[float]] = {}
        """Per reservation: seconds from each instance's request to its done report."""
        self._watermarks = self.config.watermarks()
        self._subs: list[Any] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._side_tasks: set[asyncio.Task[Any]] = set()
        self._directory: Any = None
        self._store: Any = None
        self._dir_cache: dict[str, tuple[float, AgentRecord | None]] = {}
        self._dir_live = False
        """The directory watch has delivered the bucket's current values and keeps the cache current."""
        self._probe_sub: Any = None
        self._leader: LeaderLease | None = None
        self.inter = InterGroupLease(transport, self.state, self.name,
                                     default_bps=self.config.default_bandwidth_bps,
                                     priority=self.config.lease_priority, timeout=self.config.coordinator_timeout_s,
                                     on_change=self._lease_changed)
        """The group's inter-group bandwidth lease from the coordinator."""
        self.closed = False

    def _lease_changed(self) -> None:
        self.policy.changed()
        self._wake.set()

    @classmethod
    async def connect(cls, url: str, group: str, *, nats_options: dict[str, Any] | None = None,
                      **kwargs: Any) -> GroupScheduler:
        """Connect to NATS (``nats_options`` go to `nats.connect`: credentials, TLS, inbox prefix) and start."""
        opts = {"name": f"kvbus-scheduler-{group}", **(nats_options or {})}
        sched = cls(await NatsTransport.connect(url, **opts), group, **kwargs)
        await sched.start()
        return sched

    @property
    def reservations(self) -> ReservationTable | None:
        """The policy's reservation table (None for a policy without reservations)."""
        return getattr(self.policy, "reservations", None)

    async def start(self) -> None:
        """Restore reservations, then serve the group, or (with replicas) campaign and serve once elected."""
        t = self.transport
        await self._restore_reservations()
        # Probes reach every replica, so a standby's S(t) is warm when it takes over.
        self._probe_sub = await t.subscribe(sched_subject(self.group, "probe", "*"), self._on_probe)
        self._tasks = [asyncio.create_task(self._loop(), name=f"kvbus-sched-{self.group}"),
                       asyncio.create_task(self._heartbeat(), name=f"kvbus-sched-hb-{self.group}"),
                       asyncio.create_task(self.inter.run(), name=f"kvbus-sched-lease-{self.group}"),
                       asyncio.create_task(self._watch_directory(), name=f"kvbus-sched-dir-{self.group}")]
        bucket = await self._bucket(COORD_BUCKET) if self.config.leader_ttl_s > 0 else None
        if bucket is None:
            await self._serve()
        else:
            self._leader = LeaderLease(bucket, f"sched.{self.group}", self.name, ttl=self.config.leader_ttl_s,
                                       on_elected=self._serve, on_lost=self._stop_serving)
            if await self._leader.try_acquire():
                self._leader.is_leader = True
                await self._serve()
            else:
                logger.info("group scheduler %s is a standby", self.name)
            self._leader.start()

    @property
    def serving(self) -> bool:
        """Whether this replica answers the group's requests (the leader, or the only one)."""
        return bool(self._subs)

    async def _serve(self) -> None:
        if self._subs or self.closed:
            return
        t = self.transport
        # Without an election a queue group lets replicas share the subjects; with one, only the
        # leader subscribes and the queue group is moot.
        q = f"kvbus-sched-{self.group}"
        self._subs = [
            await t.subscribe(sched_subject(self.group, "request", "*"), self._on_request, queue=q),
            await t.subscribe(sched_subject(self.group, "done", "*"), self._on_done, queue=q),
            await t.subscribe(sched_subject(self.group, "reserve", "*"), self._on_reserve, queue=q),
            await t.subscribe(sched_subject(self.group, "state"), self._on_state, queue=q),
            await t.subscribe(sched_subject(self.group, "register", "*"), self._on_register, queue=q),
        ]
        await t.flush()
        self._wake.set()
        logger.info("group scheduler %s serving (%s policy)", self.name, type(self.policy).__name__)

    async def _stop_serving(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001
                logger.debug("unsubscribe failed", exc_info=True)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # Every step is bounded: closing must never hang on a peer or the server.
        self.inter.stop()
        if self.serving:
            await _bounded(self.inter.leave(), "leave")
        if self._leader is not None:
            await _bounded(self._leader.release(), "release the leader lease")
        for task in [*self._tasks, *self._side_tasks]:
            task.cancel()
        for task in [*self._tasks, *self._side_tasks]:
            await _bounded(task, "stop a background task")
        for sub in [*self._subs, *([self._probe_sub] if self._probe_sub is not None else [])]:
            await _bounded(sub.unsubscribe(), "unsubscribe")
        self._subs = []
        close = getattr(self.transport, "close", None)
        if close is not None:
            await close()

    async def __aenter__(self) -> GroupScheduler:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- directory ------------------------------------------------------------------------------

    async def _bucket(self, name: str) -> Any:
        return await transport_bucket(self.transport, name)

    async def _watch_directory(self) -> None:
        """Keep the directory cache current from a JetStream watch of the bucket.

        A request is then answered without a directory round trip: the request handler runs one
        message at a time, so a lookup per request on the wire would cap a large group's
        throughput at one round trip per lookup.
        """
        while not self.closed:
            try:
                if self._directory is None:
                    self._directory = await self._bucket(AGENTS_BUCKET)
                    if self._directory is None:
                        return  # not on NATS (a test transport): lookups only
                watcher = await self._directory.watchall()
                async for entry in watcher:
                    if entry is None:  # the bucket's current values are in
                        self._dir_live = True
                        continue
                    try:
                        record = AgentRecord.decode(entry.value) if entry.value and not entry.operation else None
                    except WireFormatError:
                        logger.warning("directory entry of %s is malformed", entry.key)
                        record = None
                    self._remember(entry.key, record, time.monotonic())
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - lookups fall back to the TTL cache meanwhile
                logger.debug("group %s: directory watch stopped; restarting", self.group, exc_info=True)
            finally:
                self._dir_live = False
            await asyncio.sleep(1.0)

    async def lookup(self, agent: str) -> AgentRecord | None:
        """An agent's record from the JetStream directory: from the cache the directory watch keeps
        current, else a lookup cached for ``directory_ttl``."""
        now = time.monotonic()
        hit = self._dir_cache.get(agent)
        ttl = self.config.directory_watch_ttl if self._dir_live else self.config.directory_ttl
        if hit is not None and now - hit[0] < ttl and hit[1] is not None:
            return hit[1]
        if self._directory is None:
            self._directory = await self._bucket(AGENTS_BUCKET)
            if self._directory is None:
                return None
        try:
            entry = await self._directory.get(agent)
            record = AgentRecord.decode(entry.value) if entry.value else None
        except KeyNotFoundError:
            record = None
        except WireFormatError:
            logger.warning("directory entry of %s is malformed", agent)
            record = None
        return self._remember(agent, record, now)

    def _remember(self, agent: str, record: AgentRecord | None, now: float) -> AgentRecord | None:
        """Cache ``agent``'s record and what the group state learns from it."""
        self._dir_cache[agent] = (now, record)
        if record is not None and record.group != self.group:
            self.state.remote[agent] = record.group
        else:
            self.state.remote.pop(agent, None)
        if record is not None:
            self.state.priorities[agent] = record.priority
            if agent not in self.state.agents:
                # Agents of this group declare their links in probes; others only in the directory.
                self.state.declare(agent, record.link_bps, record.latency_s)
        return record

    # -- handlers ----------------------------------------------------------------------------------

    async def _on_request(self, msg: Msg) -> None:
        try:
            req = TransferRequest.decode(msg.data)
            _check_sender(msg, req.src)
            signature_of(req.signature)
            receivers = [check_name("agent", rx) for rx in req.dst]
            if not receivers:
                raise ValueError("no receivers")
        except (WireFormatError, ValueError) as exc:
            await self.transport.reply(msg, RequestAck(transfer_id="", ok=False, reason=f"bad request: {exc}").encode())
            return
        known = self.state.find(req.transfer_id)
        if known is not None:
            # Asked again (the reply or the grant went astray, or the sender checks after a
            # failover): one entry per transfer id, the grant again if it has one.
            answer = known.grant or RequestAck(req.transfer_id, ok=True, reason="queued").encode()
            await self.transport.reply(msg, answer)
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
                sigs[rx] = signature_of(record.signature) if record.signature else None
            except WireFormatError:
                sigs[rx] = None
        if unknown:
            reason = f"unknown agent(s): {', '.join(unknown)} (not registered on the bus)"
            await self.transport.reply(msg, RequestAck(req.transfer_id, ok=False, reason=reason).encode())
            return
        now = time.monotonic()
        down = [a for a in [req.src, *receivers] if self.state.is_down(a)]
        if down:
            await self.transport.reply(msg, RequestAck(req.transfer_id, ok=False,
                                                       reason=self._down_reason(down[0], req.src, now)).encode())
            return
        waited = min(max(0.0, time.time() - req.ts), MAX_CARRIED_WAIT_S)
        deadline_at = now + (req.deadline - time.time()) if req.deadline is not None else None
        pending = Pending(req, sigs, arrived=now - waited, deadline_at=deadline_at)
        self.state.queue.append(pending)
        self.policy.queued(self.state, pending)
        if self.state.remote and self.state.inter_group(pending):
            await self.inter.ensure(req.traceparent)  # granted within the lease, not before one is in force
        # Decide now: a transfer that can start at once gets its grant as the reply (one round
        # trip instead of two); otherwise the reply says "queued" and the grant follows on ctl.
        replies = {req.transfer_id: msg}
        await self.schedule_once(replies)
        if req.transfer_id in replies:
            await self.transport.reply(msg, RequestAck(req.transfer_id, ok=True, reason="queued").encode())
        self._wake.set()  # the loop's next deadline may have moved (a slice's reallocation, aging)

    async def _on_done(self, msg: Msg) -> None:
        try:
            done = TransferDone.decode(msg.data)
            _check_sender(msg, done.src)
        except (WireFormatError, ValueError) as exc:
            logger.warning("done message dropped: %s", exc)
            return
        pending = self.state.active.pop(done.transfer_id, None)
        if pending is None:
            return
        self.policy.released(pending)
        if done.ok:
            self.state.completed += 1
            if done.nbytes >= MIN_ESTIMATE_BYTES and done.wire_s > 0:
                for rx in done.dst:
                    self.state.link(done.src, rx).observe(done.nbytes, done.wire_s)
                    telemetry.instruments().link_bandwidth.record(done.nbytes / done.wire_s,
                                                                  {"group": self.group, "link": f"{done.src}->{rx}"})
            model = getattr(self.policy.selector, "model", None)
            if model is not None and pending.predicted_s > 0 and done.seconds > 0:
                model.observe(pending.medium, pending.predicted_s, done.seconds)
            if pending.reservation:
                took = time.monotonic() - pending.arrived
                self.reservation_stats.setdefault(pending.reservation, []).append(took)
                table = self.reservations
                r = table.get(pending.reservation) if table is not None else None
                if r is not None and took > r.deadline_s:
                    telemetry.instruments().reservation_misses.add(1, {"group": self.group})
        else:
            self.state.failed += 1
            logger.info("transfer %s failed: %s", done.transfer_id, done.error)
        self._wake.set()

    async def _on_register(self, msg: Msg) -> None:
        """An agent's record, sent to us because it has no JetStream rights (secure mode): we write it."""
        try:
            record = AgentRecord.decode(msg.data)
            check_name("agent", record.name)
            _check_sender(msg, record.name)
            if record.group != self.group:
                raise WireFormatError("agent record", f"group {record.group!r} is not {self.group!r}")
        except (WireFormatError, ValueError) as exc:
            logger.info("group %s: registration refused: %s", self.group, exc)
            return
        try:
            if self._directory is None:
                self._directory = await self._bucket(AGENTS_BUCKET)
            if self._directory is not None:
                await self._directory.put(record.name, record.encode())
            self._dir_cache.pop(record.name, None)
            await self.transport.reply(msg, b"ok")
        except Exception:  # noqa: BLE001 - the agent re-registers when its link changes; keep serving
            logger.exception("group %s: could not write %s to the directory", self.group, record.name)

    async def _on_probe(self, msg: Msg) -> None:
        try:
            probe = Probe.decode(msg.data)
            _check_sender(msg, probe.agent)
        except (WireFormatError, ValueError):
            return
        if probe.group != self.group:
            return
        now = time.monotonic()
        agent = self.state.on_probe(probe, now)
        self.policy.probed(self.state, agent)
        telemetry.instruments().memory_peak.record(probe.cache_bytes, {"group": self.group, "agent": probe.agent})
        watermark = self._watermarks.get(agent.name, self.config.memory_watermark_bytes)
        if watermark <= 0:
            return
        agent.memory_pressure = min(1.0, max(0.0, (agent.cache_bytes - watermark) / watermark))
        if agent.cache_bytes > watermark and now - agent.last_shed >= self.config.shed_interval_s:
            agent.last_shed = now
            target = int(watermark * self.config.shed_target)
            hint = Control(transfer_id="", action="shed", nbytes=target,
                           reason=f"cache {agent.cache_bytes} B is over its watermark {watermark} B")
            self.sheds += 1
            try:
                await self.transport.publish(agent_subject(agent.name, "ctl"), hint.encode())
            except Exception:  # noqa: BLE001 - the next probe tries again
                logger.debug("shed hint to %s failed", agent.name, exc_info=True)

    async def _on_state(self, msg: Msg) -> None:
        try:
            await self.transport.reply(msg, packb(snapshot(self)))
        except Exception:  # noqa: BLE001 - an operator view must not hurt scheduling
            logger.debug("state snapshot failed", exc_info=True)

    def set_watermark(self, agent: str, nbytes: int) -> None:
        """Set (or, with 0, clear) an agent's cache watermark for memory hints."""
        if nbytes > 0:
            self._watermarks[agent] = int(nbytes)
        else:
            self._watermarks.pop(agent, None)

    # -- reservations ------------------------------------------------------------------------------

    async def reserve(self, src: str, dst: list[str], *, period_s: float, size_bytes: int, deadline_s: float,
                      reservation_id: str | None = None) -> Admission:
        """Admit (or refuse) a periodic critical flow; the same as an agent's `Agent.reserve`."""
        import uuid

        msg = FlowReservation(reservation_id=reservation_id or uuid.uuid4().hex[:16], src=src, dst=list(dst),
                              group=self.group, period_s=float(period_s), size_bytes=int(size_bytes),
                              deadline_s=float(deadline_s))
        return await self._admit(msg)

    async def unreserve(self, reservation_id: str) -> bool:
        table = self.reservations
        r = table.remove(reservation_id) if table is not None else None
        if r is None:
            return False
        await self.admission.release(r)
        await self._forget(reservation_id)
        self.policy.changed()
        self._wake.set()
        return True

    async def _admit(self, msg: FlowReservation) -> Admission:
        table = self.reservations
        if table is None:
            return Admission(False, f"the {type(self.policy).__name__} policy does not support reservations")
        try:
            for name in [msg.src, *msg.dst]:
                check_name("agent", name)
            if not msg.dst:
                raise ValueError("a reservation needs at least one receiver")
        except ValueError as exc:
            return Admission(False, str(exc))
        r = Reservation.from_message(msg, time.monotonic())
        verdict = await self.admission.admit(r, table, self.state)
        if not verdict.ok:
            logger.info("reservation %s (%s -> %s) refused: %s", r.reservation_id, r.src, ",".join(r.dst),
                        verdict.reason)
            return verdict
        r.rate_bps = verdict.rate_bps
        table.add(r)
        await self._persist(r)
        self.policy.changed()
        self._wake.set()
        return verdict

    async def _on_reserve(self, msg: Msg) -> None:
        try:
            req = FlowReservation.decode(msg.data)
            _check_sender(msg, req.src)
        except (WireFormatError, ValueError) as exc:
            await self.transport.reply(msg, ReservationReply("", False, str(exc)).encode())
            return
        if req.cancel:
            found = await self.unreserve(req.reservation_id)
            reply = ReservationReply(req.reservation_id, found, "cancelled" if found else "no such reservation")
        else:
            verdict = await self._admit(req)
            reply = ReservationReply(req.reservation_id, verdict.ok, verdict.reason, verdict.rate_bps)
        await self.transport.reply(msg, reply.encode())

    async def _persist(self, r: Reservation) -> None:
        try:
            if self._store is None:
                self._store = await self._bucket(RESERVATIONS_BUCKET)
            if self._store is not None:
                await self._store.put(f"{self.group}.{r.reservation_id}", r.message(self.group).encode())
        except Exception:  # noqa: BLE001 - it still holds in memory
            logger.warning("could not persist reservation %s", r.reservation_id, exc_info=True)

    async def _forget(self, reservation_id: str) -> None:
        try:
            if self._store is not None:
                await self._store.delete(f"{self.group}.{reservation_id}")
        except Exception:  # noqa: BLE001
            logger.debug("could not delete reservation %s", reservation_id, exc_info=True)

    async def _restore_reservations(self) -> None:
        table = self.reservations
        if table is None:
            return
        try:
            self._store = await self._bucket(RESERVATIONS_BUCKET)
            if self._store is None:
                return
            try:
                keys = await self._store.keys()
            except NoKeysError:
                return
            now = time.monotonic()
            for key in keys:
                if not key.startswith(f"{self.group}."):
                    continue
                entry = await self._store.get(key)
                msg = FlowReservation.decode(entry.value)
                r = Reservation.from_message(msg, now)
                r.rate_bps = self.config.reservation_headroom * r.size_bytes / r.deadline_s
                table.add(r)
            if len(table):
                logger.info("group %s: %d reservations restored", self.group, len(table))
        except Exception:  # noqa: BLE001 - start without them rather than not at all
            logger.warning("could not restore the reservations of group %s", self.group, exc_info=True)

    # -- the loop --------------------------------------------------------------------------------

    def _next_timeout(self) -> float | None:
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
        return max(0.0, min(times) - now) if times else None

    async def _loop(self) -> None:
        while True:
            try:
                timeout = self._next_timeout()
                if timeout is None:
                    await self._wake.wait()
                elif timeout > 0:
                    try:
                        await asyncio.wait_for(self._wake.wait(), timeout)
                    except TimeoutError:
                        pass
                self._wake.clear()
                await self.schedule_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("scheduler loop of %s failed; continuing", self.group)
                await asyncio.sleep(self.config.tick_s)

    def _down_reason(self, agent: str, src: str, now: float) -> str:
        a = self.state.agents.get(agent)
        age = now - a.last_seen if a is not None else 0.0
        who = "sender" if agent == src else "receiver"
        return (f"{who} {agent!r} is down: no probe for {age:.1f} s (probe_ttl_s {self.config.probe_ttl_s:g} s); "
                f"transfers to or from it are refused until it probes again")

    def _expire(self, now: float) -> list[Decision]:
        """Mark silent agents down, release their running transfers, refuse their queued ones
        (they leave the queue here; the refusals are returned to be sent)."""
        for tid, p in list(self.state.active.items()):
            if now - p.granted_at > self.config.transfer_timeout:
                logger.warning("transfer %s reported nothing for %.0f s; releasing its slot", tid, now - p.granted_at)
                del self.state.active[tid]
                self.policy.released(p)
        gone = self.state.expire(now, self.config.probe_ttl_s)
        for name in gone:
            logger.warning("group %s: agent %s sent no probe for %.1f s; marked down", self.group, name,
                           now - self.state.agents[name].last_seen)
        refusals = []
        if self.state.n_down:
            for p in list(self.state.queue):
                down = next((a for a in (p.src, *p.dst) if self.state.is_down(a)), None)
                if down is not None:
                    self.state.drop(p)
                    self.policy.withdrawn(self.state, p)
                    refusals.append(Decision(p, "", 0.0, self._down_reason(down, p.src, now)))
            for tid, p in list(self.state.active.items()):
                if any(self.state.is_down(a) for a in (p.src, *p.dst)):
                    del self.state.active[tid]
                    self.policy.released(p)
        return refusals

    async def schedule_once(self, replies: dict[str, Msg] | None = None) -> int:
        """One scheduling pass: expire, ask the policy (`decide`, then `adjust` with the new grants
        active), send grants and controls; returns how many were granted.

        ``replies`` maps transfer ids to requests still waiting for their reply: a grant for one of
        them goes out as that reply (and the entry is removed) instead of on the sender's ctl subject.
        """
        now = time.monotonic()
        self.slices += 1
        decisions = self._expire(now)
        expired = len(decisions)
        decisions += self.policy.decide(self.state, now)
        # All state changes first, then the messages: a pass that runs while this one awaits
        # its sends sees a consistent state. New grants are active before `adjust` looks.
        out: list[tuple[Pending, bytes]] = []
        granted = 0
        wall = time.time()
        for i, decision in enumerate(decisions):
            pending = decision.pending
            if i >= expired:
                self.state.queue.remove(pending)
            req = pending.request
            rate = decision.rate_bps
            emulated = min((self.state.declared_bandwidth(req.src, rx) for rx in req.dst), default=0.0)
            if emulated > 0:
                rate = min(rate, emulated) if rate > 0 else emulated
            latency = max((self.state.declared_latency(req.src, rx) for rx in req.dst), default=0.0)
            start = wall + max(0.0, decision.start_at - now) if decision.start_at else wall
            grant = Grant(transfer_id=pending.transfer_id, medium=decision.medium, rate_bps=rate, start_at=start,
                          reason=decision.reason, decision=pending.decision, latency_s=latency,
                          sched_s=max(0.0, wall - req.ts))
            data = grant.encode()
            _record_decision(pending, decision, rate, wall, now)
            if decision.medium:
                pending.granted_at = now
                pending.medium = decision.medium
                pending.rate_bps = rate
                pending.grant = data
                self.state.active[pending.transfer_id] = pending
                self.policy.started(self.state, pending)
                self.state.granted += 1
                granted += 1
            else:
                self.state.refused += 1
            out.append((pending, data))
        adjustments = self.policy.adjust(self.state, now)
        for pending, data in out:
            request_msg = replies.pop(pending.transfer_id, None) if replies else None
            if request_msg is not None:
                await self.transport.reply(request_msg, data)
            else:
                await self.transport.publish(agent_subject(pending.request.src, "ctl"), data)
        for adj in adjustments:
            await self._control(adj)
        return granted

    async def _control(self, adj: Adjustment) -> None:
        p = adj.pending
        ctl = Control(transfer_id=p.transfer_id, action=adj.action, reason=adj.reason, rate_bps=adj.rate_bps,
                      max_fraction=adj.max_fraction)
        if adj.action == "pause":
            # Conditional: the sender answers whether it paused (it declines past the threshold).
            self.state.preemptions += 1
            telemetry.instruments().preemptions.add(1, {"group": self.group})
            task = asyncio.create_task(self._pause(p, ctl), name=f"kvbus-pause-{p.transfer_id}")
            self._side_tasks.add(task)
            task.add_done_callback(self._side_tasks.discard)
            return
        try:
            await self.transport.publish(agent_subject(p.src, "ctl"), ctl.encode())
        except Exception:  # noqa: BLE001 - the transfer goes on at its old rate
            logger.warning("could not send %s to %s", adj.action, p.src, exc_info=True)

    async def _pause(self, p: Pending, ctl: Control) -> None:
        try:
            data = await self.transport.request(agent_subject(p.src, "ctl"), ctl.encode(), timeout=PAUSE_TIMEOUT_S)
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
        self._wake.set()

    async def _heartbeat(self) -> None:
        while True:
            try:
                if self.serving:  # a standby is not the group's scheduler (yet)
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


def _check_sender(msg: Msg, claimed: str) -> None:
    """Raise ValueError unless ``claimed`` is the agent whose subject ``msg`` came on (the server
    lets each agent publish only on its own, so a message cannot speak for another agent)."""
    sender = subject_sender(msg.subject)
    if claimed != sender:
        raise ValueError(f"a message for agent {claimed!r} came on the subject of {sender!r}")


def _record_decision(pending: Pending, decision: Decision, rate: float, wall: float, now: float) -> None:
    """The ``kvbus.schedule`` span of one decided transfer: a child of the sender's grant wait
    (the request's ``traceparent``), from the request's arrival to the decision."""
    parent = pending.request.traceparent
    if not parent:
        return
    arrived_ns = int((wall - max(0.0, now - pending.arrived)) * 1e9)
    span = telemetry.start("kvbus.schedule", parent=parent, start_time=arrived_ns, attributes={
        "kvbus.transfer_id": pending.transfer_id, "kvbus.medium": decision.medium, "kvbus.rate_bps": rate})
    if span.is_recording():
        choice = pending.decision or {}
        span.set_attributes({
            "kvbus.group": pending.request.group, "kvbus.src": pending.src, "kvbus.dst": ",".join(pending.dst),
            "kvbus.reason": decision.reason, "kvbus.granted": bool(decision.medium),
            "kvbus.queue_wait_s": max(0.0, now - pending.arrived),
            "kvbus.predicted_s": float(choice.get("predicted_s") or 0.0),
            "kvbus.candidates": json.dumps(choice.get("candidates", []), separators=(",", ":"), default=str),
        })
    span.end()
