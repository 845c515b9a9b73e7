"""What group schedulers and agents use to talk to the coordinator."""

from __future__ import annotations

import uuid
from typing import Any

from kvbus.errors import CoordinatorUnavailable, ReservationRefused, WireFormatError
from kvbus.net.rpc import NO_RETRY, Retry, RpcClient
from kvbus.net.transport import NoResponders, Transport
from kvbus.protocol import (
    COORD_GROUPS,
    COORD_LEASE,
    COORD_LEAVE,
    COORD_PLACE,
    COORD_RESERVE,
    COORD_UNRESERVE,
    GroupLeave,
    LeaseGrant,
    LeaseRequest,
    PlacementReply,
    PlacementRequest,
    Reason,
    ReservationCancel,
    ReservationReply,
    ReservationRequest,
    group_subject,
    unpackb,
)


class CoordinatorClient:
    """Requests to the coordinator over a `Transport`.

    Every request is idempotent by a key (the group for a lease, the reservation id, the agent
    for a placement), so a ``retry`` strategy may send it again; the default tries once.

    Args:
        transport: the NATS seam.
        timeout: seconds each try waits for the coordinator.
        retry: how unanswered requests are tried again (default: not at all).
    """

    def __init__(self, transport: Transport, *, timeout: float = 2.0, retry: Retry = NO_RETRY) -> None:
        self.transport = transport
        self.timeout = timeout
        self.rpc = RpcClient(transport, timeout=timeout, retry=retry)

    async def _request(self, subject: str, payload: bytes, what: str, key: str) -> bytes:
        try:
            return await self.rpc.request(subject, payload, key=key)
        except (NoResponders, TimeoutError):
            raise CoordinatorUnavailable(what) from None

    async def lease(
        self, group: str, scheduler: str, demand_bps: float, priority: float = 1.0, *, traceparent: str | None = None
    ) -> LeaseGrant:
        """Ask for the group's share of the inter-group capacity for ``demand_bps`` (0 releases it)."""
        req = LeaseRequest(group, scheduler, demand_bps, priority, traceparent=traceparent)
        data = await self._request(COORD_LEASE, req.encode(), "lease", group)
        return LeaseGrant.decode(data)

    async def reserve(
        self,
        group: str,
        who: str,
        *,
        period_s: float,
        size_bytes: int,
        deadline_s: float,
        reservation_id: str | None = None,
        traceparent: str | None = None,
    ) -> ReservationReply:
        """Admit a periodic flow; raises `ReservationRefused` with the reason when it does not fit."""
        rid = reservation_id or uuid.uuid4().hex[:16]
        req = ReservationRequest(rid, group, who, period_s, size_bytes, deadline_s, traceparent=traceparent)
        reply = ReservationReply.decode(await self._request(COORD_RESERVE, req.encode(), "reserve", rid))
        if not reply.ok:
            raise ReservationRefused(rid, reply.reason, reply.code or Reason.REFUSED)
        return reply

    async def unreserve(self, reservation_id: str) -> None:
        """Cancel a reservation."""
        await self._request(COORD_UNRESERVE, ReservationCancel(reservation_id).encode(), "unreserve", reservation_id)

    async def place(self, agent: str, talks_to: list[str] | None = None) -> PlacementReply:
        """Which group ``agent`` should join (the one of the agents it talks to most, else the least loaded)."""
        data = await self._request(COORD_PLACE, PlacementRequest(agent, list(talks_to or [])).encode(), "place", agent)
        return PlacementReply.decode(data)

    async def groups(self) -> dict[str, Any]:
        """The live groups with their scheduler, agent count and heartbeat age.

        Raises:
            CoordinatorUnavailable: no coordinator answered.
            WireFormatError: the reply is not valid msgpack or not a map.
        """
        reply = unpackb(await self._request(COORD_GROUPS, b"", "groups", "groups"), "groups reply")
        if not isinstance(reply, dict):
            raise WireFormatError("groups reply", f"expected a map, got {type(reply).__name__}")
        return reply

    async def leave(self, group: str, scheduler: str = "") -> None:
        """Deregister a group (its lease goes to the others at once)."""
        await self.transport.publish(group_subject(COORD_LEAVE, group), GroupLeave(group, scheduler).encode())
