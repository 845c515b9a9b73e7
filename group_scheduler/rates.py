"""The weighted policy's rates: a new grant's share at once, weighted max-min once per slice.

A new grant gets its weighted share of its tightest resource (the group budget minus what
reservations hold, its sender's egress, each receiver's ingress: the declared link capacities,
and for an inter-group transfer the coordinator's lease). Once per time slice `adjust`
recomputes weighted max-min rates (`kvbus.fairness`) for all running transfers and tells the
senders whose rate moved by more than ``rate_epsilon`` (a ``rate`` control).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from kvbus.fairness import Flow, weighted_max_min
from kvbus.group_scheduler.bookkeeping import BUDGET, Run, WeightedBook
from kvbus.group_scheduler.policy import Adjustment
from kvbus.group_scheduler.reservations import ReservationTable
from kvbus.group_scheduler.state import GroupState, Pending
from kvbus.protocol import ControlAction

#: Rates never go below this (a rate of 0 means unpaced on the wire).
MIN_RATE_BPS = 1024.0


def _mbit(bps: float) -> str:
    return "unpaced" if bps <= 0 else f"{bps * 8 / 1e6:.1f} Mbit/s"


class WeightedRates(WeightedBook):
    """The rate part of `WeightedPolicy` (a mixin: the attributes are the policy's own)."""

    reservations: ReservationTable
    rate_epsilon: float
    tick_s: float
    reallocations: int
    _immediate: list[Adjustment]
    _dirty: bool
    _at_once: bool
    _last_adjust: float
    _held: frozenset[str]
    _deadline_flows: bool

    def _urgency_moved(self, run: Run) -> None:
        """A running transfer's urgency changed (its deadline nears): the policy re-indexes it."""

    def _held_now(
        self, state: GroupState, now: float, new: Sequence[Pending] = ()
    ) -> tuple[dict[Hashable, float], frozenset[str]]:
        """Bandwidth reservations hold at ``now`` per resource (open windows and instances being
        sent, ``new`` ones included), and the ids of those reservations."""
        sending = [p for p in state.active.values() if p.reservation] + [p for p in new if p.reservation]
        held: dict[Hashable, float] = {}
        ids = []
        for r, rate in self.reservations.set_aside(now, sending):
            ids.append(r.reservation_id)
            for key in (BUDGET, ("out", r.src), *(("in", rx) for rx in r.dst)):
                held[key] = held.get(key, 0.0) + rate
        return held, frozenset(ids)

    def _share(self, state: GroupState, run: Run, held: dict[Hashable, float]) -> float:
        """A new transfer's rate: its weighted share of its tightest resource (max-min refines it next slice)."""
        if not run.resources:
            return 0.0
        level = math.inf
        load = self._load
        for r in run.resources:
            full = self._capacity(state, r)
            if full <= 0:
                continue  # uncapped right now (no lease in force)
            cap = full - held[r] if held and r in held else full
            cap = max(cap, 0.01 * full, MIN_RATE_BPS)
            share = cap / max(load.get(r, 0.0), run.weight)
            if share < level:
                level = share
        if level == math.inf:
            return 0.0
        return max(run.weight * level, MIN_RATE_BPS)

    def allocate(self, state: GroupState, now: float) -> dict[str, float]:
        """Weighted max-min rates of every running transfer (reserved ones at their reserved rate)."""
        flows: list[Flow[str]] = []
        caps: dict[Hashable, float] = {}
        rates: dict[str, float] = {}
        deadline_flows = False
        # The load sums are rebuilt exactly in the same pass (deadline weights moved, float
        # error accumulated), in the order `_add_load` would have added them.
        load: dict[Hashable, float] = {}
        get = load.get
        capacity = self._capacity
        for run in self._runs.values():
            f = run.pending
            if f.deadline_at is not None:
                deadline_flows = True
                u = self.urgency.urgency(f, now, running=True)
                run.weight += u - run.urgency
                if u != run.urgency:
                    run.urgency = u
                    self._urgency_moved(run)
            if f.paused or f.done:  # done: only its rate budget holds it (`budget_only`)
                run.loaded = False
                continue
            w = run.weight
            res = run.resources
            flows.append(Flow(f.transfer_id, w, res))
            for key in res:
                load[key] = get(key, 0.0) + w
                if key not in caps:
                    cap = capacity(state, key)
                    if cap > 0:  # 0: uncapped for now (the inter-group lease when none is in force)
                        caps[key] = cap
            run.loaded = w > 0
        self._load = load
        for p in state.active.values():
            if p.reservation:
                r = self.reservations.get(p.reservation)
                rates[p.transfer_id] = r.rate_bps if r is not None else MIN_RATE_BPS
        held, self._held = self._held_now(state, now) if len(self.reservations) else ({}, frozenset())
        for key in caps:
            full = caps[key]
            caps[key] = max(full - held.get(key, 0.0), 0.01 * full, MIN_RATE_BPS)
        for key, rate in weighted_max_min(flows, caps).items():
            rates[key] = rate if rate <= 0 else max(rate, MIN_RATE_BPS)
        self._deadline_flows = deadline_flows
        return rates

    def adjust(self, state: GroupState, now: float) -> list[Adjustment]:
        """The pauses and resumes of the last pass, and once per slice the reallocated rates (at
        once when an urgent transfer started or ended: `WeightedPolicy._at_once`)."""
        out, self._immediate = self._immediate, []
        if not self._dirty and len(self.reservations):
            self._dirty = self._held_now(state, now)[1] != self._held
        if not self._dirty and self._deadline_flows:
            self._dirty = True  # their urgency (and weight) grows as the deadline nears
        if not self._dirty or (now - self._last_adjust < self.tick_s and not self._at_once):
            return out
        self._catch_up(state)
        self._dirty = self._at_once = False
        self._last_adjust = now
        self.reallocations += 1
        rates = self.allocate(state, now)
        for run in self._runs.values():
            f = run.pending
            if f.paused or f.done:
                continue
            new = rates.get(f.transfer_id, 0.0)
            old = f.rate_bps
            if old == new or (old > 0 and new > 0 and abs(new - old) <= self.rate_epsilon * old):
                continue
            f.rate_bps = new
            out.append(Adjustment(f, ControlAction.RATE, rate_bps=new, reason=f"reallocated: {_mbit(new)}"))
        return out
