"""Reservations: periodic critical flows (heartbeats, global syncs) with bandwidth set aside.

A reservation declares a flow from ``src`` to ``dst``: ``size_bytes`` every ``period_s``, each
instance due ``deadline_s`` after its period starts. Admitted, it is given
``rate = headroom * size_bytes / deadline_s`` (the headroom covers the round trips and encode
of each instance) and that rate is set aside in the slices it needs:

- from ``lead_s`` before an instance is expected until it arrives (or its deadline passes),
  so the capacity is free the moment it asks (no rate controls to win it back first);
- while an instance is being sent.

Outside those windows the capacity goes to everyone else. An instance is a critical send from
``src`` to exactly ``dst``; its arrival re-anchors the next expected start one period later,
so the windows follow the sender's actual rhythm. Admission is a strategy (`AdmissionControl`):
`LocalAdmission` checks the group's own budget and the agents' declared capacities;
`CoordinatorAdmission` adds the deployment-wide check against the coordinator's reservation
table (over NATS, ``kvbus.coord.reserve``).
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from kvbus.errors import WireFormatError
from kvbus.group_scheduler.state import GroupState, Pending
from kvbus.net.rpc import RpcClient
from kvbus.net.transport import NoResponders, Transport
from kvbus.protocol import (
    COORD_RESERVE,
    COORD_UNRESERVE,
    FlowReservation,
    Reason,
    ReservationCancel,
    ReservationReply,
    ReservationRequest,
)

DEFAULT_RESERVABLE_FRACTION = 0.5
DEFAULT_HEADROOM = 1.25


@dataclass
class Reservation:
    """One admitted periodic flow."""

    reservation_id: str
    src: str
    dst: tuple[str, ...]
    period_s: float
    size_bytes: int
    deadline_s: float
    rate_bps: float = 0.0
    """Bandwidth set aside while its window is open, bytes/s."""
    created: float = field(default_factory=time.time)
    """Wall-clock time it was admitted (persisted)."""
    next_start: float = 0.0
    """Monotonic time the next instance is expected."""
    arrived: bool = False
    """The instance of the current period has arrived."""
    instances: int = 0
    skipped: int = 0
    """Periods (after the first instance) in which no instance came before the deadline."""

    @property
    def key(self) -> tuple[str, frozenset[str]]:
        """``(src, frozenset(dst))``: one reservation per flow; a new one for the same flow replaces it."""
        return self.src, frozenset(self.dst)

    def window_open(self, now: float, lead_s: float) -> bool:
        """Whether its bandwidth is set aside at ``now`` for an instance that has not arrived yet."""
        self.roll(now, lead_s)
        return not self.arrived and self.next_start - lead_s <= now <= self.next_start + self.deadline_s

    def roll(self, now: float, lead_s: float) -> None:
        """Move on to the period that ``now`` falls in."""
        while self.period_s > 0:
            if self.arrived:
                if now < self.next_start + self.period_s - lead_s:
                    return
                self.arrived = False
            elif now > self.next_start + self.deadline_s:
                if self.instances:
                    self.skipped += 1
            else:
                return
            self.next_start += self.period_s

    def on_instance(self, now: float) -> None:
        """An instance arrived at ``now``: its period starts now, the next one a period later."""
        self.instances += 1
        self.arrived = True
        self.next_start = now

    def next_event(self, now: float, lead_s: float) -> float:
        """Monotonic time its set-aside next opens or closes."""
        self.roll(now, lead_s)
        if self.arrived:
            return self.next_start + self.period_s - lead_s
        if now < self.next_start - lead_s:
            return self.next_start - lead_s
        return self.next_start + self.deadline_s

    def message(self, group: str) -> FlowReservation:
        """The reservation as the wire/KV record of group ``group`` (what is persisted and replayed)."""
        return FlowReservation(
            reservation_id=self.reservation_id,
            src=self.src,
            dst=list(self.dst),
            group=group,
            period_s=self.period_s,
            size_bytes=self.size_bytes,
            deadline_s=self.deadline_s,
            ts=self.created,
        )

    @classmethod
    def from_message(cls, msg: FlowReservation, now: float) -> Reservation:
        """Rebuild a reservation from its record; its first instance is expected at ``now``."""
        return cls(
            msg.reservation_id,
            msg.src,
            tuple(msg.dst),
            msg.period_s,
            msg.size_bytes,
            msg.deadline_s,
            created=msg.ts,
            next_start=now,
        )


@dataclass(frozen=True, slots=True)
class Admission:
    """The answer of admission control."""

    ok: bool
    reason: str
    rate_bps: float = 0.0
    code: Reason = Reason.NONE
    """For a refusal: why, as a code (the reservation reply carries it)."""


class AdmissionControl(ABC):
    """Admits or refuses reservations; a strategy of the group scheduler."""

    @abstractmethod
    async def admit(self, reservation: Reservation, table: ReservationTable, state: GroupState) -> Admission:
        """Whether ``reservation`` fits next to those in ``table``; the rate it gets if so."""

    async def release(self, reservation: Reservation) -> None:  # noqa: B027 - nothing to undo locally
        """A reservation was cancelled."""


def _mbit(bps: float) -> str:
    return f"{bps * 8 / 1e6:.1f} Mbit/s"


class LocalAdmission(AdmissionControl):
    """Admission against the group's own budget and its agents' declared link capacities.

    A reservation's rate must fit, next to the other reservations, in ``reservable_fraction``
    of the group budget and of the declared capacity of its sender and of each receiver (the
    rest stays for bulk traffic). Limits that are not known (no budget, no declared link) are
    not checked.
    """

    def __init__(
        self, reservable_fraction: float = DEFAULT_RESERVABLE_FRACTION, headroom: float = DEFAULT_HEADROOM
    ) -> None:
        self.reservable_fraction = reservable_fraction
        self.headroom = headroom

    def check(self, r: Reservation, table: ReservationTable, state: GroupState) -> Admission:
        """Check ``r`` against the group budget and its agents' declared capacities, without I/O.

        Refused (MALFORMED) when period, deadline or size is not positive and finite or the deadline is
        longer than the period; refused (REFUSED) when its rate does not fit next to the others.
        """
        if not all(0 < x < math.inf for x in (r.period_s, r.deadline_s, r.size_bytes)):
            return Admission(False, "period, deadline and size must all be positive and finite", code=Reason.MALFORMED)
        if r.deadline_s > r.period_s:
            return Admission(
                False, f"deadline {r.deadline_s} s is longer than the period {r.period_s} s", code=Reason.MALFORMED
            )
        rate = self.headroom * r.size_bytes / r.deadline_s
        others = [o for o in table.all() if o.reservation_id != r.reservation_id]
        need = f"needs {_mbit(rate)} ({r.size_bytes} B within {r.deadline_s} s, x{self.headroom} headroom)"
        if state.bandwidth_bps > 0:
            limit = self.reservable_fraction * state.bandwidth_bps
            taken = sum(o.rate_bps for o in others)
            if taken + rate > limit:
                return Admission(
                    False,
                    f"{need}; only {_mbit(max(0.0, limit - taken))} of the {_mbit(limit)} "
                    f"reservations may take of group {state.group!r}'s budget is left",
                    code=Reason.REFUSED,
                )
        for side, agent in [("egress", r.src)] + [("ingress", rx) for rx in r.dst]:
            cap = state.capacity(agent)
            if cap <= 0:
                continue
            limit = self.reservable_fraction * cap
            taken = sum(
                o.rate_bps
                for o in others
                if (side == "egress" and o.src == agent) or (side == "ingress" and agent in o.dst)
            )
            if taken + rate > limit:
                return Admission(
                    False,
                    f"{need}; only {_mbit(max(0.0, limit - taken))} of the {_mbit(limit)} "
                    f"reservations may take of {agent}'s {side} is left",
                    code=Reason.REFUSED,
                )
        return Admission(True, f"admitted: {_mbit(rate)} set aside in its windows", rate)

    async def admit(self, reservation: Reservation, table: ReservationTable, state: GroupState) -> Admission:
        """The local check (`check`) alone."""
        return self.check(reservation, table, state)


class CoordinatorAdmission(AdmissionControl):
    """The group's own check first, then the deployment's: the coordinator's reservation table.

    The coordinator sets aside the peak rate (size / deadline) of every admitted reservation
    against the shared capacity; a group scheduler that cannot reach it refuses (a reservation
    is a promise, so it is not made on half the information).
    """

    def __init__(
        self, transport: Transport, group: str, local: LocalAdmission | None = None, *, timeout: float = 2.0
    ) -> None:
        self.transport = transport
        self.group = group
        self.local = local or LocalAdmission()
        self.timeout = timeout
        self.rpc = RpcClient(transport, timeout=timeout)

    async def admit(self, reservation: Reservation, table: ReservationTable, state: GroupState) -> Admission:
        """The group's check, then the coordinator's; refused when the coordinator does not answer."""
        verdict = self.local.check(reservation, table, state)
        if not verdict.ok:
            return verdict
        r = reservation
        req = ReservationRequest(
            r.reservation_id, self.group, f"{r.src}->{','.join(r.dst)}", r.period_s, r.size_bytes, r.deadline_s
        )
        try:
            data = await self.rpc.request(COORD_RESERVE, req.encode(), key=r.reservation_id)
            reply = ReservationReply.decode(data)
        except (NoResponders, TimeoutError):
            return Admission(
                False,
                "no coordinator answers to admit it deployment-wide (start one with "
                "`kvbus coordinator`, or use local admission)",
                code=Reason.UNAVAILABLE,
            )
        except WireFormatError as exc:
            return Admission(False, f"bad answer from the coordinator: {exc}", code=Reason.UNAVAILABLE)
        if not reply.ok:
            return Admission(
                False,
                f"refused by the coordinator: {reply.reason}",
                code=reply.code if reply.code != Reason.NONE else Reason.REFUSED,
            )
        return verdict

    async def release(self, reservation: Reservation) -> None:
        """Tell the coordinator the reservation is cancelled (best effort)."""
        try:
            await self.rpc.request(
                COORD_UNRESERVE, ReservationCancel(reservation.reservation_id).encode(), key=reservation.reservation_id
            )
        except (NoResponders, TimeoutError):
            pass  # the coordinator drops it when it learns; nothing else to do


class ReservationTable:
    """The group's admitted reservations."""

    def __init__(self, lead_s: float = 0.02) -> None:
        self.lead_s = lead_s
        """How long before an expected instance its bandwidth is set aside."""
        self._by_id: dict[str, Reservation] = {}
        self._by_key: dict[tuple[str, frozenset[str]], Reservation] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def all(self) -> list[Reservation]:
        """Every admitted reservation."""
        return list(self._by_id.values())

    def get(self, reservation_id: str) -> Reservation | None:
        """The reservation ``reservation_id``, or None."""
        return self._by_id.get(reservation_id)

    def add(self, r: Reservation) -> None:
        """Admit ``r`` into the table; an older reservation of the same flow (`Reservation.key`) is replaced."""
        old = self._by_key.get(r.key)
        if old is not None and old.reservation_id != r.reservation_id:
            self._by_id.pop(old.reservation_id, None)
        self._by_id[r.reservation_id] = r
        self._by_key[r.key] = r

    def remove(self, reservation_id: str) -> Reservation | None:
        """Forget ``reservation_id``; returns the reservation, or None if unknown."""
        r = self._by_id.pop(reservation_id, None)
        if r is not None and self._by_key.get(r.key) is r:
            del self._by_key[r.key]
        return r

    def match(self, p: Pending) -> Reservation | None:
        """The reservation a queued transfer is an instance of: a critical send on a reserved pair."""
        if not p.request.critical or not self._by_id:
            return None
        return self._by_key.get((p.request.src, frozenset(p.request.dst)))

    def set_aside(self, now: float, active: list[Pending]) -> list[tuple[Reservation, float]]:
        """Reservations holding bandwidth at ``now`` (open window or an instance being sent), with their rate."""
        running = {p.reservation for p in active if p.reservation}
        out = []
        for r in self._by_id.values():
            if r.reservation_id in running or r.window_open(now, self.lead_s):
                out.append((r, r.rate_bps))
        return out

    def next_event(self, now: float) -> float | None:
        """Monotonic time the next reservation window opens or closes, or None without reservations."""
        times = [r.next_event(now, self.lead_s) for r in self._by_id.values()]
        return min(times) if times else None
