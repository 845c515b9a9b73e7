"""The coordinator: group membership, inter-group bandwidth leases, the reservation table,
agent placement. Its state lives in a JetStream KV bucket, so a restarted (or standby) coordinator
continues where the last one stopped; replicas elect a leader by a lease in the same bucket.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError, NoKeysError
from opentelemetry.trace import SpanKind

from kvbus import telemetry
from kvbus.coordinator.arbiter import weighted_max_min
from kvbus.coordinator.config import CoordinatorConfig
from kvbus.errors import WireFormatError
from kvbus.net.buckets import key_value
from kvbus.net.service import Endpoint, ReplicatedService, replica_name
from kvbus.net.transport import NatsTransport, Transport
from kvbus.protocol import (
    AGENTS_BUCKET,
    COORD_BUCKET,
    COORD_GROUPS,
    COORD_LEASE,
    COORD_LEAVE,
    COORD_PLACE,
    COORD_REGISTER,
    COORD_RESERVE,
    COORD_UNRESERVE,
    AgentRecord,
    GroupHeartbeat,
    GroupLeave,
    LeaseGrant,
    LeaseRequest,
    PlacementReply,
    PlacementRequest,
    Reason,
    ReservationCancel,
    ReservationReply,
    ReservationRequest,
    packb,
)

logger = logging.getLogger(__name__)


@dataclass
class Lease:
    """A group's inter-group bandwidth lease: what it asked for, its weight and its share."""

    group: str
    demand_bps: float
    priority: float
    share_bps: float
    renewed: float
    """Epoch seconds of the last renewal."""


class Coordinator(ReplicatedService):
    """One per deployment (plus standbys). Arbitrates only between groups, never per agent."""

    def __init__(self, transport: Transport, *, config: CoordinatorConfig | None = None) -> None:
        super().__init__(transport, replica_name("coordinator"))
        self.config = config or CoordinatorConfig.from_env()
        self.groups: dict[str, GroupHeartbeat] = {}
        self.leases: dict[str, Lease] = {}
        self.reservations: dict[str, tuple[ReservationRequest, float]] = {}
        self._bucket: Any = None
        self._agents: Any = None

    @classmethod
    async def connect(
        cls, url: str | Sequence[str], *, nats_options: dict[str, Any] | None = None, **kwargs: Any
    ) -> Coordinator:
        """Connect to NATS (``nats_options`` go to `nats.connect`: credentials, TLS, inbox prefix) and start."""
        opts = {"name": "kvbus-coordinator", **(nats_options or {})}
        coord = cls(await NatsTransport.connect(url, **opts), **kwargs)
        await coord.start()
        return coord

    # -- lifecycle -----------------------------------------------------------------------------------

    async def start(self, *, wait_leader: bool = True) -> None:
        """Open the durable state, then campaign for leadership; the leader serves requests.

        With ``wait_leader`` the first campaign happens before this returns (a lone coordinator
        serves when it does); otherwise the renewal loop makes it.
        """
        js = self.transport.jetstream()
        if js is not None:
            self._bucket = await key_value(js, COORD_BUCKET)
            self._agents = await key_value(js, AGENTS_BUCKET)
        await self.campaign(self._bucket, "leader", ttl=self.config.leader_ttl_s, try_now=wait_leader)

    def endpoints(self) -> list[Endpoint]:
        """Heartbeats and leaves reach every serving replica; requests go to one (a queue group)."""
        q = "kvbus-coordinator"
        return [
            Endpoint(f"{COORD_REGISTER}.*", self._on_heartbeat),
            Endpoint(f"{COORD_LEAVE}.*", self._on_leave),
            Endpoint(COORD_GROUPS, self._on_groups, q),
            Endpoint(COORD_LEASE, self._on_lease, q),
            Endpoint(COORD_RESERVE, self._on_reserve, q),
            Endpoint(COORD_UNRESERVE, self._on_unreserve, q),
            Endpoint(COORD_PLACE, self._on_place, q),
        ]

    async def prepare_to_serve(self) -> None:
        """Continue from the durable state the last leader left."""
        await self._restore()

    async def now_serving(self) -> None:
        """Say what it continues from."""
        logger.info(
            "%s serving (%d groups, %d reservations restored)", self.name, len(self.groups), len(self.reservations)
        )

    # -- durable state ---------------------------------------------------------------------------------

    async def _put(self, key: str, value: bytes) -> None:
        if self._bucket is not None:
            await self._bucket.put(key, value)

    async def _delete(self, key: str) -> None:
        if self._bucket is not None:
            try:
                await self._bucket.delete(key)
            except KeyNotFoundError:
                pass

    async def _restore(self) -> None:
        if self._bucket is None:
            return
        try:
            keys = await self._bucket.keys()
        except NoKeysError:
            return
        for key in keys:
            try:
                entry = await self._bucket.get(key)
            except KeyNotFoundError:
                continue
            if not entry.value:
                continue
            try:
                if key.startswith("group."):
                    hb = GroupHeartbeat.decode(entry.value)
                    self.groups[hb.group] = hb
                elif key.startswith("res."):
                    req = ReservationRequest.decode(entry.value)
                    self.reservations[req.reservation_id] = (req, _reservation_rate(req))
                elif key.startswith("lease."):
                    grant = LeaseGrant.decode(entry.value)
                    self.leases[grant.group] = Lease(
                        grant.group,
                        grant.share_bps,
                        1.0,
                        grant.share_bps,
                        grant.expires_at - grant.epoch_s * self.config.lease_grace_epochs,
                    )
            except WireFormatError:
                logger.warning("coordinator state %s is malformed; ignored", key)
        # A group that stopped heartbeating while no coordinator ran is gone: it does not come back.
        await self.expire_groups()

    # -- membership -------------------------------------------------------------------------------------

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = GroupHeartbeat.decode(msg.data)
            _check_group_subject(msg.subject, hb.group)
        except (WireFormatError, ValueError) as exc:
            logger.warning("group heartbeat dropped: %s", exc)
            return
        # When it was heard is the coordinator's clock, never what the message says (a heartbeat
        # dated in the future would keep a group alive for ever).
        hb = replace(hb, ts=time.time())
        if hb.group not in self.groups:
            logger.info("group %s joined (scheduler %s)", hb.group, hb.scheduler)
        self.groups[hb.group] = hb
        await self._put(f"group.{hb.group}", hb.encode())

    async def _on_leave(self, msg: Msg) -> None:
        try:
            leave = GroupLeave.decode(msg.data)
            _check_group_subject(msg.subject, leave.group)
        except (WireFormatError, ValueError) as exc:
            logger.warning("group leave dropped: %s", exc)
            return
        await self._forget_group(leave.group)
        logger.info("group %s left", leave.group)

    async def _forget_group(self, group: str) -> None:
        """Drop a group, its lease and their durable records."""
        self.groups.pop(group, None)
        self.leases.pop(group, None)
        await self._delete(f"group.{group}")
        await self._delete(f"lease.{group}")

    def live_groups(self) -> dict[str, GroupHeartbeat]:
        """Groups whose scheduler was heard from within ``group_ttl_s``."""
        now = time.time()
        return {g: hb for g, hb in self.groups.items() if now - hb.ts <= self.config.group_ttl_s}

    async def expire_groups(self, now: float | None = None) -> list[str]:
        """Forget the groups not heard from for ``group_ttl_s`` (with their leases and durable
        records): they take no more placements and hold no share. Returns their names."""
        now = time.time() if now is None else now
        gone = [g for g, hb in self.groups.items() if now - hb.ts > self.config.group_ttl_s]
        for g in gone:
            await self._forget_group(g)
            logger.info("group %s expired (no heartbeat for %.0f s)", g, self.config.group_ttl_s)
        return gone

    async def _on_groups(self, msg: Msg) -> None:
        await self.expire_groups()
        body = {
            g: {"scheduler": hb.scheduler, "agents": hb.agents, "age_s": round(time.time() - hb.ts, 3)}
            for g, hb in self.live_groups().items()
        }
        await self.transport.reply(msg, packb(body))

    # -- leases -----------------------------------------------------------------------------------------

    @property
    def reserved_bps(self) -> float:
        """Bandwidth the admitted reservations set aside."""
        return sum(rate for _, rate in self.reservations.values())

    def lease_capacity(self) -> float:
        """What leases may share: the capacity minus what reservations set aside."""
        return max(0.0, self.config.capacity_bps - self.reserved_bps)

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Drop leases not renewed for ``lease_grace_epochs`` epochs; returns their groups."""
        now = time.time() if now is None else now
        limit = self.config.epoch_s * self.config.lease_grace_epochs
        gone = [g for g, lease in self.leases.items() if now - lease.renewed > limit]
        for g in gone:
            del self.leases[g]
        return gone

    def allocate(self, now: float | None = None) -> dict[str, float]:
        """Weighted max-min shares of the leasable capacity among the live leases."""
        self.expire_leases(now)
        shares = weighted_max_min(
            self.lease_capacity(),
            {g: lz.demand_bps for g, lz in self.leases.items()},
            {g: max(lz.priority, 1e-6) for g, lz in self.leases.items()},
        )
        for g, share in shares.items():
            self.leases[g].share_bps = share
        return shares

    async def _on_lease(self, msg: Msg) -> None:
        try:
            req = LeaseRequest.decode(msg.data)
        except WireFormatError as exc:
            await self.transport.reply(msg, LeaseGrant("", 0.0, 0.0, self.config.epoch_s).encode())
            logger.warning("bad lease request: %s", exc)
            return
        with _traced(
            "kvbus.coord.lease", req.traceparent, {"kvbus.group": req.group, "kvbus.demand_bps": req.demand_bps}
        ) as span:
            now = time.time()
            if req.demand_bps <= 0:
                self.leases.pop(req.group, None)
                await self._delete(f"lease.{req.group}")
                share = 0.0
            else:
                self.leases[req.group] = Lease(req.group, req.demand_bps, req.priority, 0.0, now)
                share = self.allocate(now).get(req.group, 0.0)
            expires = now + self.config.epoch_s * self.config.lease_grace_epochs
            grant = LeaseGrant(req.group, share, expires, self.config.epoch_s, self.config.capacity_bps)
            if span is not None:
                span.set_attributes({"kvbus.share_bps": share, "kvbus.groups": len(self.leases)})
            await self.transport.reply(msg, grant.encode())
            await self._put(f"lease.{req.group}", grant.encode())

    # -- reservations ------------------------------------------------------------------------------------

    def admit(self, req: ReservationRequest) -> ReservationReply:
        """Admission control: the reservation's peak rate must fit in what reservations may take."""
        if req.period_s <= 0 or req.deadline_s <= 0 or req.size_bytes <= 0:
            return ReservationReply(
                req.reservation_id, False, "period, deadline and size must be positive", code=Reason.MALFORMED
            )
        if req.deadline_s > req.period_s:
            return ReservationReply(
                req.reservation_id,
                False,
                f"deadline {req.deadline_s} s is longer than the period {req.period_s} s",
                code=Reason.MALFORMED,
            )
        rate = _reservation_rate(req)
        limit = self.config.capacity_bps * self.config.reservable_fraction
        others = sum(r for rid, (_, r) in self.reservations.items() if rid != req.reservation_id)
        if others + rate > limit:
            return ReservationReply(
                req.reservation_id,
                False,
                f"needs {rate * 8 / 1e6:.1f} Mbit/s ({req.size_bytes} B within {req.deadline_s} s); only "
                f"{max(0.0, limit - others) * 8 / 1e6:.1f} of the {limit * 8 / 1e6:.1f} Mbit/s reservations may "
                f"take is left",
                code=Reason.REFUSED,
            )
        self.reservations[req.reservation_id] = (req, rate)
        return ReservationReply(req.reservation_id, True, "admitted", rate)

    async def _on_reserve(self, msg: Msg) -> None:
        try:
            req = ReservationRequest.decode(msg.data)
        except WireFormatError as exc:
            await self.transport.reply(msg, ReservationReply("", False, str(exc), code=Reason.MALFORMED).encode())
            return
        with _traced(
            "kvbus.coord.reserve",
            req.traceparent,
            {"kvbus.group": req.group, "kvbus.reservation_id": req.reservation_id},
        ) as span:
            reply = self.admit(req)
            if span is not None:
                span.set_attributes({"kvbus.admitted": reply.ok, "kvbus.reason": reply.reason})
            if reply.ok:
                await self._put(f"res.{req.reservation_id}", req.encode())
                self.allocate()
            await self.transport.reply(msg, reply.encode())

    async def _on_unreserve(self, msg: Msg) -> None:
        try:
            req = ReservationCancel.decode(msg.data)
        except WireFormatError:
            return
        self.reservations.pop(req.reservation_id, None)
        await self._delete(f"res.{req.reservation_id}")
        await self.transport.reply(msg, ReservationReply(req.reservation_id, True, "cancelled").encode())

    # -- placement ---------------------------------------------------------------------------------------

    async def place(self, agent: str, talks_to: list[str]) -> PlacementReply:
        """The group of the agents it talks to most, else the least loaded live group."""
        await self.expire_groups()
        live = self.live_groups()
        if not live:
            return PlacementReply(agent, "", "no live group")
        peers: Counter[str] = Counter()
        if self._agents is not None:
            for peer in talks_to[:64]:
                try:
                    entry = await self._agents.get(peer)
                    record = AgentRecord.decode(entry.value)
                except Exception:  # noqa: BLE001 - unknown or malformed: skip
                    continue
                if record.group in live:
                    peers[record.group] += 1
        if peers:
            group, n = peers.most_common(1)[0]
            return PlacementReply(agent, group, f"{n} of the agents it talks to are there")
        group = min(live, key=lambda g: (live[g].agents, g))
        return PlacementReply(agent, group, f"least loaded ({live[group].agents} agents)")

    async def _on_place(self, msg: Msg) -> None:
        try:
            req = PlacementRequest.decode(msg.data)
        except WireFormatError as exc:
            await self.transport.reply(msg, PlacementReply("", "", str(exc)).encode())
            return
        with _traced("kvbus.coord.place", req.traceparent, {"kvbus.agent": req.agent}) as span:
            reply = await self.place(req.agent, [p for p in req.talks_to if isinstance(p, str)])
            if span is not None:
                span.set_attributes({"kvbus.group": reply.group, "kvbus.reason": reply.reason})
            await self.transport.reply(msg, reply.encode())


def _check_group_subject(subject: str, group: str) -> None:
    """Raise `WireFormatError` unless ``subject`` is ``group``'s own (`group_subject`): in secure mode a
    scheduler may publish only on its own group's, so a message cannot speak for another group."""
    if subject.rsplit(".", 1)[-1] != group:
        raise WireFormatError("group message", f"group {group!r} came on the subject {subject[:200]!r}")


def _reservation_rate(req: ReservationRequest) -> float:
    """Bandwidth a periodic flow needs: its size within its deadline."""
    return req.size_bytes / req.deadline_s if req.deadline_s > 0 else float("inf")


def _traced(name: str, traceparent: str | None, attributes: dict[str, Any]) -> AbstractContextManager[Any]:
    """A server span in the caller's trace when the request carries one; nothing otherwise (the
    lease renewals every epoch would each start a trace of their own)."""
    if not traceparent:
        return nullcontext(None)
    return telemetry.span(name, parent=traceparent, kind=SpanKind.SERVER, attributes=attributes)
