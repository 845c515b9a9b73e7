"""The weighted policy's rates: a new grant's share at once, weighted max-min once per slice.

A new grant gets its weighted share of its tightest resource (the group budget minus what
reservations hold, its sender's egress, each receiver's ingress: the declared link capacities,
and for an inter-group transfer the coordinator's lease). Once per time slice `adjust` brings
the weighted max-min rates of the running transfers up to date and tells the senders whose rate
moved by more than ``rate_epsilon`` (a ``rate`` control).

The max-min is incremental (`kvbus.fairness.IncrementalMaxMin`, split at the group budget): the
transfers whose share may have changed since the last slice (started, ended, paused, resumed, a
deadline weight that moved) are handed to it, and it recomputes only the components of the
sender/receiver links they touch and moves the budget's level, returning the transfers whose
rate drifted past ``rate_epsilon``. A slice costs O(changes * log n), not O(running transfers).
Capacities are re-read for the budget and the inter-group lease on every slice, for the agents'
links when a declaration changed, and for every resource while reservations are in the table
(what they hold moves with their windows). `allocate` is the from-scratch recomputation.

Rate budgets (`Grant.budget_s`: small transfers that start without a request) hold no weighted
share, but they are kept inside the group budget: the max-min shares out the budget less
`LEASE_HEADROOM` times the rate the budgets' transfers used over the last `LEASE_WINDOW_S`
(`LeaseUse`). Without it the bulk took the whole budget and the budgets' messages came on top:
on the testbed (budget 0.94 of a 320 Mbit/s link, headers 4.6 %) the link was 100 % busy and a
critical 64 KB message waited behind the ones before it.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Hashable, Sequence

from kvbus.fairness import Flow, IncrementalMaxMin, weighted_max_min
from kvbus.group_scheduler.bookkeeping import BUDGET, INTER, Run, WeightedBook
from kvbus.group_scheduler.pairs import PairQueues
from kvbus.group_scheduler.policy import Adjustment
from kvbus.group_scheduler.reservations import ReservationTable
from kvbus.group_scheduler.state import GroupState, Pending
from kvbus.protocol import ControlAction

#: Rates never go below this (a rate of 0 means unpaced on the wire).
MIN_RATE_BPS = 1024.0
#: The group budget set aside for rate budgets, over the rate their transfers used: twice, so
#: that the link the others leave idle drains a burst of them in half the time it took to come.
LEASE_HEADROOM = 2.0
#: Seconds of rate-budget traffic `LeaseUse` averages over (the default `budget_s`).
LEASE_WINDOW_S = 1.0
#: Most of the group budget rate budgets may hold.
LEASE_MAX_SHARE = 0.5


class LeaseUse:
    """Bytes sent under rate budgets over a sliding window of ``window_s`` seconds."""

    def __init__(self, window_s: float = LEASE_WINDOW_S) -> None:
        self.window_s = window_s
        self._sent: collections.deque[tuple[float, int]] = collections.deque()
        self._bytes = 0

    def __bool__(self) -> bool:
        return bool(self._sent)

    def add(self, now: float, nbytes: int) -> None:
        """``nbytes`` were reported sent under a rate budget at ``now``."""
        self._sent.append((now, nbytes))
        self._bytes += nbytes

    def rate(self, now: float) -> float:
        """Bytes per second over the window ending at ``now``."""
        sent, start = self._sent, now - self.window_s
        while sent and sent[0][0] <= start:
            self._bytes -= sent.popleft()[1]
        if not sent:
            self._bytes = 0
        return self._bytes / self.window_s


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

    def _init_book(self, pairs: PairQueues) -> None:
        super()._init_book(pairs)
        self._alloc: IncrementalMaxMin[str] = IncrementalMaxMin(BUDGET, epsilon=self.rate_epsilon)
        """The running, unpaused transfers' max-min rates, kept up to date by `adjust`."""
        self._touched: dict[str, None] = {}
        """Transfers whose share may have changed since the last reallocation."""
        self._resync = True
        """Look at every running transfer in the next reallocation (something changed outside the policy)."""
        self._deadline: dict[str, Run] = {}
        """The running transfers with a deadline: their weight grows as it nears."""
        self._run_seq: dict[str, int] = {}
        self._run_count = itertools.count()
        self._declared_seen = -1
        self._rebuild_in = 0
        self._lease = LeaseUse()
        """What the rate budgets' transfers sent lately (`leased`)."""

    def _run(self, state: GroupState, p: Pending, now: float, rp: float | None = None) -> Run:
        run = super()._run(state, p, now, rp)
        tid = p.transfer_id
        self._run_seq[tid] = next(self._run_count)
        if p.deadline_at is not None:
            self._deadline[tid] = run
        return run

    def _unrun(self, tid: str) -> None:
        super()._unrun(tid)
        self._touched[tid] = None
        self._deadline.pop(tid, None)
        self._run_seq.pop(tid, None)

    def _add_load(self, run: Run, w: float) -> None:
        super()._add_load(run, w)
        self._touched[run.pending.transfer_id] = None

    def _urgency_moved(self, run: Run) -> None:
        """A running transfer's urgency changed (its deadline nears): the policy re-indexes it."""

    def leased(self, holder: Pending, nbytes: int, now: float) -> None:
        """A transfer ran under a rate budget: the budget the others share out shrinks with it."""
        self._lease.add(now, nbytes)
        self._dirty = True

    def _lease_hold(self, state: GroupState, now: float) -> float:
        """The part of the group budget rate budgets hold now (see the module's docstring)."""
        if not self._lease or state.bandwidth_bps <= 0:
            return 0.0
        return min(LEASE_HEADROOM * self._lease.rate(now), LEASE_MAX_SHARE * state.bandwidth_bps)

    def _held_with_leases(self, state: GroupState, now: float, new: Sequence[Pending] = ()) -> dict[Hashable, float]:
        """What reservations (`_held_now`) and rate budgets (`_lease_hold`) hold per resource now."""
        held = self._held_now(state, now, new)[0] if len(self.reservations) else {}
        lease = self._lease_hold(state, now)
        if lease > 0:
            held[BUDGET] = held.get(BUDGET, 0.0) + lease
        return held

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
        lease = self._lease_hold(state, now)
        if lease > 0:
            held[BUDGET] = held.get(BUDGET, 0.0) + lease
        for key in caps:
            full = caps[key]
            caps[key] = max(full - held.get(key, 0.0), 0.01 * full, MIN_RATE_BPS)
        for key, rate in weighted_max_min(flows, caps).items():
            rates[key] = rate if rate <= 0 else max(rate, MIN_RATE_BPS)
        self._deadline_flows = deadline_flows
        return rates

    def _effective_cap(self, state: GroupState, key: Hashable, held: dict[Hashable, float]) -> float | None:
        full = self._capacity(state, key)
        if full <= 0:
            return None  # uncapped for now (the inter-group lease when none is in force)
        return max(full - held.get(key, 0.0), 0.01 * full, MIN_RATE_BPS) if held else full

    def _sync(self, state: GroupState, now: float) -> None:
        """Hand the incremental max-min what changed since the last reallocation."""
        alloc, runs = self._alloc, self._runs
        alloc.epsilon = self.rate_epsilon
        held: dict[Hashable, float] = {}
        if len(self.reservations):
            held, self._held = self._held_now(state, now)
        elif self._held:
            self._held = frozenset()
            self._declared_seen = -1  # what they held is back: re-read every capacity
        every = bool(held)
        lease = self._lease_hold(state, now)
        if lease > 0:  # the budget only: set again below on every slice
            held[BUDGET] = held.get(BUDGET, 0.0) + lease
        cap = self._effective_cap
        for shared in (BUDGET, INTER):
            alloc.set_capacity(shared, cap(state, shared, held))
        if every or state.declared_version != self._declared_seen:
            self._declared_seen = state.declared_version
            for key in alloc.resources():
                alloc.set_capacity(key, cap(state, key, held))
        for tid, run in self._deadline.items():
            f = run.pending
            u = self.urgency.urgency(f, now, running=True)
            if u != run.urgency:
                if run.loaded:
                    self._add_load(run, -run.weight)
                    run.weight += u - run.urgency
                    self._add_load(run, run.weight)
                else:
                    run.weight += u - run.urgency
                run.urgency = u
                self._urgency_moved(run)
                self._touched[tid] = None
        self._deadline_flows = bool(self._deadline)
        self._rebuild_in -= 1
        if self._resync:
            # Something changed outside the policy (a pause declined or taken by hand): every
            # transfer is looked at.
            self._resync = False
            self._touched.update(dict.fromkeys(runs))
            self._touched.update(dict.fromkeys(k for k in alloc.rates() if k not in runs))
            self._rebuild_in = 0
        if self._rebuild_in <= 0:
            # The load sums exactly, now and then (float error; amortised O(1) per slice).
            self._rebuild_in = 64 + 8 * len(runs)
            self._rebuild_load()
        touched, self._touched = self._touched, {}
        for tid in touched:
            r = runs.get(tid)
            if r is None or r.pending.paused or r.pending.done:
                if tid in alloc:
                    alloc.remove(tid)
                continue
            if tid in alloc:
                alloc.set_weight(tid, r.weight)
                continue
            for key in r.resources:
                if alloc.capacity(key) is None:
                    alloc.set_capacity(key, cap(state, key, held))
            alloc.add(tid, r.weight, r.resources, told=r.pending.rate_bps, order=self._run_seq.get(tid, 0))

    def _rebuild_load(self) -> None:
        """The load sums and loaded flags from scratch, in the order `_add_load` would have added them."""
        load: dict[Hashable, float] = {}
        get = load.get
        for run in self._runs.values():
            f = run.pending
            if f.paused or f.done:
                run.loaded = False
                continue
            w = run.weight
            for key in run.resources:
                load[key] = get(key, 0.0) + w
            run.loaded = w > 0
        self._load = load

    def adjust(self, state: GroupState, now: float) -> list[Adjustment]:
        """The pauses and resumes of the last pass, and once per slice the reallocated rates (at
        once when an urgent transfer started or ended: `WeightedPolicy._at_once`)."""
        out, self._immediate = self._immediate, []
        if not self._dirty and len(self.reservations):
            self._dirty = self._held_now(state, now)[1] != self._held
        if not self._dirty and self._deadline_flows:
            self._dirty = True  # their urgency (and weight) grows as the deadline nears
        if not self._dirty and self._lease:
            self._dirty = True  # what the rate budgets hold moves with their window
        if not self._dirty or (now - self._last_adjust < self.tick_s and not self._at_once):
            return out
        self._catch_up(state)
        self._dirty = self._at_once = False
        self._last_adjust = now
        self.reallocations += 1
        self._sync(state, now)
        alloc, runs, eps = self._alloc, self._runs, self.rate_epsilon
        for tid in alloc.solve():
            f = runs[tid].pending
            new = alloc.rate(tid)
            if new > 0:
                new = max(new, MIN_RATE_BPS)
            old = f.rate_bps
            if not (old == new or (old > 0 and new > 0 and abs(new - old) <= eps * old)):
                f.rate_bps = new
                out.append(Adjustment(f, ControlAction.RATE, rate_bps=new, reason=f"reallocated: {_mbit(new)}"))
            alloc.tell(tid, f.rate_bps)
        return out
