"""Messages between group schedulers (and agents) and the coordinator: membership, leases,
reservations and placement."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvbus.protocol.wire import (
    MAX_BYTES,
    MAX_COUNT,
    MAX_EPOCH_S,
    MAX_PRIORITY,
    MAX_RATE_BPS,
    MAX_SECONDS,
    ListOf,
    Message,
    OptStr,
    float_in,
    int_in,
    message,
)
from kvbus.reasons import Reason

#: The ranges of this module's numeric fields (see `kvbus.protocol.wire.Num`).
EPOCH = float_in(0.0, MAX_EPOCH_S)
SECONDS = float_in(0.0, MAX_SECONDS)
RATE = float_in(0.0, MAX_RATE_BPS)
PRIORITY = float_in(0.0, MAX_PRIORITY)


@message("group", {"group": str, "scheduler": str, "agents": int_in(0, MAX_COUNT), "ts": EPOCH})
@dataclass(frozen=True, slots=True)
class GroupHeartbeat(Message):
    """A group scheduler announces itself to the coordinator."""

    group: str
    scheduler: str
    agents: int = 0
    ts: float = field(default_factory=time.time)


@message("leave", {"group": str, "scheduler": str})
@dataclass(frozen=True, slots=True)
class GroupLeave(Message):
    """A group scheduler deregisters (its group's lease is released at once)."""

    group: str
    scheduler: str = ""


@message(
    "lease_request", {"group": str, "scheduler": str, "demand_bps": RATE, "priority": PRIORITY, "traceparent": OptStr}
)
@dataclass(frozen=True, slots=True)
class LeaseRequest(Message):
    """A group asks for its share of the shared (inter-group) capacity for the next epoch."""

    group: str
    scheduler: str
    demand_bps: float
    """Bandwidth its inter-group transfers want (0 releases the lease)."""
    priority: float = 1.0
    """Weight of the group in the max-min split."""
    traceparent: str | None = None
    """The transfer that made the group ask (W3C trace context): the coordinator's span joins its trace."""


@message("lease", {"group": str, "share_bps": RATE, "expires_at": EPOCH, "epoch_s": SECONDS, "capacity_bps": RATE})
@dataclass(frozen=True, slots=True)
class LeaseGrant(Message):
    """The coordinator's answer: the group's share until ``expires_at`` (epoch seconds)."""

    group: str
    share_bps: float
    expires_at: float
    epoch_s: float
    capacity_bps: float = 0.0


@message(
    "reserve",
    {
        "reservation_id": str,
        "group": str,
        "who": str,
        "period_s": SECONDS,
        "size_bytes": int_in(0, MAX_BYTES),
        "deadline_s": SECONDS,
        "traceparent": OptStr,
    },
)
@dataclass(frozen=True, slots=True)
class ReservationRequest(Message):
    """A periodic critical flow asks for bandwidth set aside: ``size_bytes`` every ``period_s``,
    each due within ``deadline_s`` of its period's start."""

    reservation_id: str
    group: str
    who: str
    period_s: float
    size_bytes: int
    deadline_s: float
    traceparent: str | None = None


@message("reserve_reply", {"reservation_id": str, "ok": bool, "reason": str, "rate_bps": RATE, "code": Reason})
@dataclass(frozen=True, slots=True)
class ReservationReply(Message):
    """Admitted (with the rate set aside) or refused with the reason."""

    reservation_id: str
    ok: bool
    reason: str = ""
    rate_bps: float = 0.0
    code: Reason = Reason.NONE
    """Why it was refused, as a code to match on (`reason` is for people)."""


@message("unreserve", {"reservation_id": str})
@dataclass(frozen=True, slots=True)
class ReservationCancel(Message):
    """A group scheduler cancels a reservation it had admitted with the coordinator."""

    reservation_id: str


@message("place", {"agent": str, "talks_to": ListOf(str, max_len=1 << 12), "traceparent": OptStr})
@dataclass(frozen=True, slots=True)
class PlacementRequest(Message):
    """Which group should this agent join? ``talks_to`` names the agents it exchanges most with."""

    agent: str
    talks_to: list = field(default_factory=list)
    traceparent: str | None = None


@message("placement", {"agent": str, "group": str, "reason": str})
@dataclass(frozen=True, slots=True)
class PlacementReply(Message):
    """The coordinator's answer to a `PlacementRequest`: the group to join (empty with ``reason`` if none)."""

    agent: str
    group: str
    reason: str = ""
