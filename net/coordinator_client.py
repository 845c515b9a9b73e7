"""What group schedulers and agents use to talk to the coordinator."""

from __future__ import annotations

import uuid
from typing import Any

from kvbus.net.transport import NoResponders, Transport
from kvbus.errors import CoordinatorUnavailable, ReservationRefused
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
    ReservationCancel,
    ReservationReply,
    ReservationRequest,
    unpackb,
)



class CoordinatorClient:
    """Requests to the coordinator over a `Transport`."""

    def __init__(self, transport: Transport, *, timeout: float = 2.0) -> None:
        self.transport = transport
        self.timeout = timeout

    async def _request(self, subject: str, payload: bytes, what: str) -> bytes:
        try:
            return await self.transport.request(subject, payload, timeout=self.timeout)
        except (NoResponders, TimeoutError):
            raise CoordinatorUnavailable(what) from None

    async def lease(self, group: str, scheduler: str, demand_bps: float, priority: float = 1.0, *,
                    traceparent: str | None = None) -> LeaseGrant:
        req = LeaseRequest(group, scheduler, demand_bps, priority, traceparent=traceparent)
        data = await self._request(COORD_LEASE, req.encode(), "lease")
        return LeaseGrant.decode(data)

    async def reserve(self, group: str, who: str, *, period_s: float, size_bytes: int, deadline_s: float,
                      reservation_id: str | None = None, traceparent: str | None = None) -> ReservationReply:
        """Admit a periodic flow; raises `ReservationRefused` with the reason when it does not fit."""
        rid = reservation_id or uuid.uuid4().hex[:16]
        req = ReservationRequest(rid, group, who, period_s, size_bytes, deadline_s, traceparent=traceparent)
        reply = ReservationReply.decode(await self._request(COORD_RESERVE, req.encode(), "reserve"))
        if not reply.ok:
            raise ReservationRefused(rid, reply.reason)
        return reply

    async def unreserve(self, reservation_id: str) -> None:
        await self._request(COORD_UNRESERVE, ReservationCancel(reservation_id).encode(), "unreserve")

    async def place(self, agent: str, talks_to: list[str] | None = None) -> PlacementReply:
        data = await self._request(COORD_PLACE, PlacementRequest(agent, list(talks_to or [])).encode(), "place")
        return PlacementReply.decode(data)

    async def groups(self) -> dict[str, Any]:
        return unpackb(await self._request(COORD_GROUPS, b"", "groups"), "groups reply")

    async def leave(self, group: str, scheduler: str = "") -> None:
        await self.transport.publish(COORD_LEAVE, GroupLeave(group, scheduler).encode())
