"""Scheduling policies: who may send now, with which medium and at what rate.

A policy is a strategy object passed to the `GroupScheduler`. `FifoPolicy` (first come, first
served) is the baseline; `kvbus.group_scheduler.weighted.WeightedPolicy` (weighted round robin,
max-min rates, preemption, reservations) is the default.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

from kvbus.codecs import get_codec
from kvbus.codecs.errors import CodecError
from kvbus.group_scheduler.signatures import signature_of
from kvbus.group_scheduler.state import AgentState, GroupState, Pending
from kvbus.protocol import ControlAction, Reason


@dataclass(frozen=True)
class Decision:
    """What the policy decided for one pending transfer: (destination, medium, rate, scheduled time).

    A refusal is made with `Decision.refusal` and told by `refused` (its grant goes out with an
    empty medium, which is how the wire says it).
    """

    pending: Pending
    medium: str
    """The granted medium (empty for a refusal: make those with `refusal`, test with `refused`)."""
    rate_bps: float = 0.0
    """Allocated bandwidth in bytes/s (0 = unpaced)."""
    reason: str = ""
    start_at: float = 0.0
    """Monotonic time at which sending may begin (0 = now)."""
    code: Reason = Reason.NONE
    """For a refusal: why, as a code (the grant carries it)."""

    @classmethod
    def refusal(cls, pending: Pending, reason: str, code: Reason = Reason.REFUSED) -> Decision:
        """Refuse ``pending``: ``reason`` for people, ``code`` to match on."""
        return cls(pending, "", 0.0, reason, code=code)

    @property
    def refused(self) -> bool:
        """Whether this refuses the transfer (else it grants ``medium``)."""
        return not self.medium

    @property
    def destination(self) -> tuple[str, ...]:
        """The transfer's receivers."""
        return tuple(self.pending.request.dst)

    def as_tuple(self) -> tuple[tuple[str, ...], str, float, float]:
        """The design's decision tuple: (destination, medium, allocated bandwidth, scheduled time)."""
        return self.destination, self.medium, self.rate_bps, self.start_at


@dataclass(frozen=True)
class Adjustment:
    """A change to a running transfer: ``pause`` (conditional on ``max_fraction``), ``resume`` or ``rate``."""

    pending: Pending
    action: ControlAction
    rate_bps: float = 0.0
    max_fraction: float = 1.0
    reason: str = ""


class Selection(NamedTuple):
    """A selector's answer: the medium (empty to refuse: see `refusal`), why, and for a refusal its code."""

    medium: str
    reason: str
    code: Reason = Reason.NONE

    @classmethod
    def refusal(cls, reason: str, code: Reason = Reason.REFUSED) -> Selection:
        """A refusal: ``reason`` for people, ``code`` to match on."""
        return cls("", reason, code)

    @property
    def refused(self) -> bool:
        """Whether the selector refused the transfer."""
        return not self.medium


class MediumSelector(ABC):
    """Chooses the medium of a transfer."""

    @abstractmethod
    def choose(self, state: GroupState, pending: Pending) -> tuple[str, str]:
        """Return (medium, reason); an empty medium refuses the transfer with that reason."""

    def select(self, state: GroupState, pending: Pending) -> Selection:
        """`choose` with a reason code, which policies put on a refusal's grant.

        The default wraps `choose` (a refusal is `Reason.REFUSED`); selectors that know better
        (an incompatible receiver, an unknown codec) override it.
        """
        medium, reason = self.choose(state, pending)
        return Selection(medium, reason) if medium else Selection.refusal(reason)


class StaticSelector(MediumSelector):
    """The sender's requested medium, else ``default`` when every receiver can use KV, else ``tokens``."""

    def __init__(self, default: str = "full", fallback: str = "tokens") -> None:
        self.default = default
        self.fallback = fallback

    def choose(self, state: GroupState, pending: Pending) -> tuple[str, str]:
        """The requested medium, ``default`` between compatible models, else ``fallback``."""
        medium, reason, _ = self.select(state, pending)
        return medium, reason

    def select(self, state: GroupState, pending: Pending) -> Selection:
        """`choose` with the refusal's code."""
        req = pending.request
        try:
            sender = signature_of(req.signature)
        except Exception as exc:  # noqa: BLE001 - validated on arrival; be safe anyway
            return Selection.refusal(f"bad sender signature: {exc}", Reason.MALFORMED)
        unusable = [rx for rx, sig in pending.receivers.items() if sig is None or not sender.compatible_with(sig)]
        if req.medium:
            try:
                codec = get_codec(req.medium)
            except CodecError as exc:
                return Selection.refusal(str(exc), Reason.UNKNOWN_CODEC)
            if codec.needs_kv and unusable:
                return Selection.refusal(
                    f"medium {req.medium!r} carries KV that {', '.join(unusable)} cannot use "
                    f"(different model); send with medium='tokens' or let kvbus choose",
                    Reason.INCOMPATIBLE,
                )
            return Selection(req.medium, "requested by the sender")
        if unusable:
            return Selection(self.fallback, f"{', '.join(unusable)} cannot use {sender.model} KV")
        return Selection(self.default, "first-cut policy: lossless KV between compatible models")


class SchedulingPolicy(ABC):
    """Decides, each time the state changes, which queued transfers start now.

    The scheduler calls `decide` on every event (request, done, control reply) and at least
    once per time slice while work waits, and `adjust` at most once per slice; `next_wakeup`
    tells it when to look again if nothing happens, so an idle scheduler sleeps.

    Whoever drives a policy (`GroupScheduler`, `kvbus.group_scheduler.simulate.Simulation`, a
    benchmark) owns ``state.queue`` and ``state.active`` and tells the policy of every change
    it makes itself, through the hooks: `queued` after appending to the queue, `withdrawn`
    after taking a transfer out of it other than by a decision of the policy, `started` after
    moving a granted transfer into ``active``, `released` after taking one out of it, `probed`
    after an agent's probe. A policy that indexes the state keeps its index by these events.
    """

    tick_s: float = 0.010
    """The time slice: how often a policy with nothing better to go by looks again while work waits."""

    def __init__(self, selector: MediumSelector | None = None) -> None:
        self.selector = selector or StaticSelector()

    @abstractmethod
    def decide(self, state: GroupState, now: float) -> list[Decision]:
        """Pick transfers from ``state.queue`` to grant now (the scheduler moves them to active)."""

    def adjust(self, state: GroupState, now: float) -> list[Adjustment]:
        """Changes to running transfers (rates, pauses, resumes); none by default."""
        return []

    def next_wakeup(self, state: GroupState, now: float) -> float | None:
        """Monotonic time the policy wants to run again without an event, or None to wait for
        one (default: a slice later while transfers wait)."""
        return now + self.tick_s if state.queue else None

    def changed(self) -> None:  # noqa: B027 - optional hook
        """Something outside `decide` changed the running set (a done, a declined pause)."""

    def queued(self, state: GroupState, pending: Pending) -> None:  # noqa: B027 - optional hook
        """``pending`` was appended to ``state.queue`` (a request arrived)."""

    def withdrawn(self, state: GroupState, pending: Pending) -> None:  # noqa: B027 - optional hook
        """``pending`` left ``state.queue`` other than by this policy's decision (refused: an agent is down)."""

    def started(self, state: GroupState, pending: Pending) -> None:  # noqa: B027 - optional hook
        """``pending``, granted by this policy's decision, is now in ``state.active``."""

    def released(self, pending: Pending) -> None:
        """``pending`` left the active set (done, failed, expired); the default just notes a change."""
        self.changed()

    def budget_only(self, pending: Pending) -> None:
        """``pending`` is done but stays active for its rate budget: it holds the pair's slot, and
        sends only the small transfers the budget lets through (the default notes a change)."""
        self.changed()

    def leased(self, holder: Pending, nbytes: int, now: float) -> None:  # noqa: B027 - optional hook
        """A transfer of ``nbytes`` ran under ``holder``'s rate budget (or ``holder`` itself is done
        and its budget goes on); reported by the sender afterwards, ``now`` on the scheduler's clock."""

    def probed(self, state: GroupState, agent: AgentState) -> None:  # noqa: B027 - optional hook
        """``agent``'s probe arrived and updated ``state``."""


class FifoPolicy(SchedulingPolicy):
    """First come, first served, with at most ``max_active`` transfers running and one per sender.

    The group's bandwidth budget (if any) is split evenly between running transfers.
    """

    def __init__(self, selector: MediumSelector | None = None, *, max_active: int = 4, tick_s: float = 0.010) -> None:
        super().__init__(selector)
        self.max_active = max_active
        self.tick_s = tick_s

    def decide(self, state: GroupState, now: float) -> list[Decision]:
        """The oldest queued transfers of senders with nothing running, into the free slots."""
        decisions: list[Decision] = []
        busy = {p.request.src for p in state.active.values()}
        slots = self.max_active - len(state.active)
        for pending in list(state.queue):
            if slots <= 0:
                break
            if pending.request.src in busy:
                continue
            medium, reason, code = selection = self.selector.select(state, pending)
            running = len(state.active) + len(decisions) + 1
            rate = state.bandwidth_bps / running if state.bandwidth_bps > 0 else 0.0
            # A refusal too carries the even share its grant has always shown (the wire stays as it was).
            decisions.append(Decision(pending, medium, rate, reason, code=code))
            if not selection.refused:
                busy.add(pending.request.src)
                slots -= 1
        return decisions


class StrictPriorityPolicy(FifoPolicy):
    """Strict priority, no weights: critical transfers before bulk, first come first served within each.

    A queued critical transfer is granted before any queued bulk one, past ``max_active`` (but
    one per sender, like FIFO). Rates: the running critical transfers share the group's budget
    evenly; the bulk ones share what is left (at least ``floor`` of the budget between them), and
    are told so at once (a ``rate`` control in the same pass) when a critical transfer starts or
    ends, without waiting for a time slice.
    """

    floor: float = 0.01
    """The share of the budget bulk keeps while critical transfers run."""

    def __init__(self, selector: MediumSelector | None = None, *, max_active: int = 8, tick_s: float = 0.010) -> None:
        super().__init__(selector, max_active=max_active, tick_s=tick_s)
        self._dirty = False

    def changed(self) -> None:
        """A transfer left the running set: the rates are recomputed by the next `adjust`."""
        self._dirty = True

    def started(self, state: GroupState, pending: Pending) -> None:
        """A grant of this policy is running: the rates are recomputed by the next `adjust`."""
        self._dirty = True

    @staticmethod
    def _running(state: GroupState) -> tuple[list[Pending], list[Pending]]:
        crit: list[Pending] = []
        bulk: list[Pending] = []
        for p in state.active.values():
            if not p.done:
                (crit if p.request.critical else bulk).append(p)
        return crit, bulk

    def _rates(self, state: GroupState, n_crit: int, n_bulk: int) -> tuple[float, float]:
        """(rate of each critical transfer, rate of each bulk one); 0 = unpaced (no budget)."""
        budget = state.bandwidth_bps
        if budget <= 0:
            return 0.0, 0.0
        crit = budget / n_crit if n_crit else 0.0
        left = budget - crit * n_crit if n_crit else budget
        bulk = max(left, self.floor * budget) / n_bulk if n_bulk else 0.0
        return crit, bulk

    def decide(self, state: GroupState, now: float) -> list[Decision]:
        """Queued critical transfers first (past ``max_active``), then the oldest bulk ones into free slots."""
        decisions: list[Decision] = []
        crit_run, bulk_run = self._running(state)
        busy = {p.request.src for p in state.active.values()}
        slots = self.max_active - len(state.active)
        queue = [p for p in state.queue if p.request.critical] + [p for p in state.queue if not p.request.critical]
        for pending in queue:
            critical = pending.request.critical
            if (slots <= 0 and not critical) or pending.request.src in busy:
                continue
            medium, reason, code = selection = self.selector.select(state, pending)
            n_crit = len(crit_run) + (1 if critical else 0)
            n_bulk = len(bulk_run) + (0 if critical else 1)
            crit_rate, bulk_rate = self._rates(state, n_crit, n_bulk)
            rate = crit_rate if critical else bulk_rate
            why = f"strict priority ({'critical' if critical else 'bulk'}); {reason}"
            decisions.append(Decision(pending, medium, rate, why, code=code))
            if not selection.refused:
                busy.add(pending.request.src)
                slots -= 1
                (crit_run if critical else bulk_run).append(pending)
        return decisions

    def adjust(self, state: GroupState, now: float) -> list[Adjustment]:
        """After a critical transfer started or ended: every running transfer's new rate, at once."""
        if not self._dirty:
            return []
        self._dirty = False
        crit, bulk = self._running(state)
        crit_rate, bulk_rate = self._rates(state, len(crit), len(bulk))
        out = []
        for p, rate in [(p, crit_rate) for p in crit] + [(p, bulk_rate) for p in bulk]:
            if rate > 0 and p.rate_bps != rate:
                p.rate_bps = rate
                out.append(Adjustment(p, ControlAction.RATE, rate_bps=rate, reason="strict priority"))
        return out
