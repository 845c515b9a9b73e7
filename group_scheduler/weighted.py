"""The weighted policy: reservations, urgent admission with preemption, weighted round robin
over pairs, and weighted max-min rates.

Each pass (on every event; between events only when something can change by itself):

1. **Resume** paused transfers whose preemptors are done (or that waited ``max_pause_s``).
2. **Reservations**: a critical send on a reserved pair starts at once at its reserved rate.
3. **Urgent admission**: a queued transfer that *outranks* (urgency ``ratio`` times higher) a
   running transfer it competes with, or one that holds the slot it waits for, starts at
   once, past ``max_active`` and ``per_pair``. Waiting time counts only for a pair with
   nothing running; otherwise only a transfer's own urgency (deadline, critical) does. Aging
   makes every waiting pair urgent after ``aging_delay_s`` behind ordinary transfers, which
   bounds its queue delay (`UrgencyModel.starvation_bound_s`); the pass that admits it is
   scheduled for that moment, so a waiting queue costs no CPU between events.
4. **Weighted round robin**: free slots (``max_active`` running ordinary transfers, at most
   ``per_pair`` per pair) go to pairs with queued work, picked in proportion to
   W_ij = role_priority_i + role_priority_j + urgency of the pair's oldest transfer: by
   virtual time (`StrideWRR`, the default: a heap, W computed for the picked pair only) or by
   smooth WRR (`SmoothWRR`: every pair's W on every pick).
5. **Preemption**: a started transfer of at least ``preempt_min_bytes`` pauses the running
   transfers it outranks on its resources, through the preemption strategy (the sender
   declines past the threshold).
6. **Rates**: a new grant gets its weighted share of its tightest resource at once (the group
   budget minus what reservations hold, its sender's egress, each receiver's ingress: the
   declared link capacities). Once per time slice, `adjust` recomputes weighted max-min rates
   for all running transfers (shares follow the weights where they compete; no capacity stays
   idle while a transfer could use it) and tells senders whose rate moved by more than
   ``rate_epsilon`` (a ``rate`` control).

The bookkeeping is incremental (per-pair queues, per-resource weight sums, a heap of waiting
times, heaps of urgency, the round robin's heap of virtual times), so a pass that grants one
transfer costs O(log pairs) for the round robin and O(1) for its rate; the max-min runs at
most once per slice, incrementally (O((changes + rate controls) log n), see
`kvbus.group_scheduler.rates`). The index lives in
`kvbus.group_scheduler.bookkeeping` (kept by the `SchedulingPolicy` hooks), the rates in
`kvbus.group_scheduler.rates`; this module holds the decisions.
"""

from __future__ import annotations

import heapq
import itertools
import math
from bisect import bisect_left

import numpy as np

from kvbus.group_scheduler.bookkeeping import Pair, Run
from kvbus.group_scheduler.config import SchedulerConfig
from kvbus.group_scheduler.pairs import PairQueues
from kvbus.group_scheduler.policy import Adjustment, Decision, MediumSelector, SchedulingPolicy
from kvbus.group_scheduler.preemption import NoPreemption, PreemptionStrategy, ThresholdPreemption, UrgencyHeap
from kvbus.group_scheduler.rates import MIN_RATE_BPS, WeightedRates, _mbit
from kvbus.group_scheduler.reservations import ReservationTable
from kvbus.group_scheduler.state import GroupState, Pending
from kvbus.group_scheduler.weights import UrgencyModel
from kvbus.group_scheduler.wrr import PairPicker, StrideWRR
from kvbus.protocol import ControlAction

__all__ = ["WeightedPolicy"]

#: What a pass starts: (transfer, its urgency, medium, reason).
Started = tuple[Pending, float, str, str]


class WeightedPolicy(WeightedRates, SchedulingPolicy):
    """Weighted round robin with urgency, preemption, reservations and max-min rates."""

    def __init__(
        self,
        selector: MediumSelector | None = None,
        *,
        urgency: UrgencyModel | None = None,
        picker: PairPicker | None = None,
        preemption: PreemptionStrategy | None = None,
        reservations: ReservationTable | None = None,
        max_active: int = 8,
        per_pair: int = 1,
        preempt_min_bytes: int = 1 << 20,
        max_pause_s: float = 10.0,
        rate_epsilon: float = 0.05,
        tick_s: float = 0.010,
    ) -> None:
        super().__init__(selector)
        self.urgency = urgency or UrgencyModel()
        self.picker = picker or StrideWRR()
        self.preemption = preemption or ThresholdPreemption()
        self.reservations = reservations if reservations is not None else ReservationTable()
        self.max_active = max_active
        self.per_pair = per_pair
        self.preempt_min_bytes = preempt_min_bytes
        self.max_pause_s = max_pause_s
        self.rate_epsilon = rate_epsilon
        self.tick_s = tick_s
        self.urgent_admissions = 0
        self.reallocations = 0
        """Max-min reallocations run by `adjust`."""
        self.preemptions = 0
        """Pauses asked for (some may have been declined by their senders)."""
        u0 = self.urgency.base + self.urgency.alpha
        self._u0 = u0
        """Urgency of an ordinary running transfer: the least any running transfer has."""
        self.aging_delay_s = max(0.0, self.urgency.starvation_bound_s(self.preemption.ratio, 0.0))
        """Waiting time after which an ordinary transfer outranks ordinary running ones."""
        self._immediate: list[Adjustment] = []
        self._dirty = False
        self._at_once = False
        """Reallocate in this pass, not at the next slice: an urgent transfer started or ended."""
        self._victims: dict[str, set[str]] = {}
        """Per running preemptor, the transfers it holds paused (so its end looks at those alone)."""
        self._to_check: set[str] = set()
        """Paused transfers to look at in the next `_resume`: a preemptor of theirs ended."""
        self._rescan = False
        """Look at every paused transfer in the next `_resume` (a pause was declined outside a pass)."""
        self._pause_ends: list[tuple[float, str]] = []
        """Heap of (paused_at + max_pause_s, transfer id); stale entries are skipped."""
        self._last_adjust = -math.inf
        self._held: frozenset[str] = frozenset()
        self._deadline_flows = False
        # The urgency index of the running transfers (`_preempt`, `_outranks_rivals`): with a
        # group budget every transfer competes with every other, and these answer "the least
        # urgent one" and "those it outranks" without a scan of the running set.
        self._stamps = itertools.count()
        """Stamps in event order: a run's place in the running order, a pause, a hold."""
        self._order: dict[str, int] = {}
        """Per running transfer, the stamp of its start (``_runs`` is in that order)."""
        self._by_pair: dict[Pair, dict[str, Run]] = {}
        """The running transfers of each pair."""
        self._all_u = UrgencyHeap()
        """Every running transfer by urgency."""
        self._unpaused_u = UrgencyHeap()
        """The running transfers this policy has not paused."""
        self._preemptible_u = UrgencyHeap()
        """The unpaused ones that may be asked to pause (not known to decline)."""
        self._paused_u = UrgencyHeap(most_first=True)
        """The ones it paused, the most urgent first."""
        self._pause_stamp: dict[str, int] = {}
        """Per paused transfer, the stamp of its pause."""
        self._pause_log: list[tuple[int, str]] = []
        """(stamp, id) of the pauses in stamp order; entries of transfers resumed since are stale."""
        self._holds: dict[str, tuple[int, frozenset[str]]] = {}
        """Per urgent preemptor (with a group budget), the stamp of its start and the paused
        transfers it did not outrank then: until it is done it holds paused every transfer
        whose pause is older, but those (instead of one ``paused_by`` entry in each)."""
        self._hold_log: list[tuple[int, str]] = []
        """(stamp, id) of the holds in stamp order; entries of holds that ended are stale."""
        self._full_holds: list[tuple[int, str]] = []
        """The same for the holds that left nothing out."""
        self._init_book(PairQueues(self.picker, per_pair=per_pair))

    @classmethod
    def from_config(cls, config: SchedulerConfig, selector: MediumSelector | None = None) -> WeightedPolicy:
        """The policy with the urgency model, preemption, reservations and limits ``config`` sets."""
        urgency = UrgencyModel(
            base=config.urgency_base,
            alpha=config.urgency_alpha,
            beta=config.urgency_beta,
            max_delay_s=config.urgency_max_delay_s,
            deadline_boost=config.deadline_boost,
            deadline_horizon_s=config.deadline_horizon_s,
            critical_boost=config.critical_boost,
        )
        kind = ThresholdPreemption if config.preempt else NoPreemption
        return cls(
            selector,
            urgency=urgency,
            preemption=kind(config.preempt_ratio, config.preempt_threshold),
            reservations=ReservationTable(lead_s=config.reservation_lead_s),
            max_active=config.max_active,
            per_pair=config.per_pair,
            preempt_min_bytes=config.preempt_min_bytes,
            max_pause_s=config.max_pause_s,
            rate_epsilon=config.rate_epsilon,
            tick_s=config.tick_s,
        )

    def starvation_bound_s(self) -> float:
        """Longest queue delay of a transfer waiting behind other pairs' ordinary transfers."""
        return self.urgency.starvation_bound_s(self.preemption.ratio, self.tick_s)

    def changed(self) -> None:
        """Something outside `decide` changed the running set (a done, a declined pause):
        reallocate at the next slice (looking at every running transfer), and look at every
        paused transfer in the next pass."""
        self._dirty = True
        self._rescan = True
        self._resync = True

    def _ended(self, pending: Pending) -> None:
        """``pending`` no longer preempts anything (done, or only its budget runs): its victims are looked at."""
        tid = pending.transfer_id
        victims = self._victims.pop(tid, None)
        if victims:
            runs = self._runs
            for v in victims:
                run = runs.get(v)
                if run is not None:
                    run.pending.paused_by.discard(tid)
            self._to_check |= victims
        hold = self._holds.pop(tid, None)
        if hold is not None:
            top = self._live_tail(self._full_holds)
            top_stamp = top[0] if top else -1
            if hold[0] > top_stamp:
                # What this hold held may be held by nothing now: the transfers paused since
                # the latest hold that left nothing out (older ones that one still holds).
                log, live = self._pause_log, self._pause_stamp
                for s, v in log[bisect_left(log, (top_stamp + 1,)) : bisect_left(log, (hold[0],))]:
                    if live.get(v) == s:
                        self._to_check.add(v)
            for log in (self._hold_log, self._full_holds):
                self._live_tail(log)
                if len(log) > 2 * len(self._holds) + 64:
                    log[:] = [e for e in log if self._holds.get(e[1], (None,))[0] == e[0]]

    def _live_tail(self, log: list[tuple[int, str]]) -> tuple[int, str] | None:
        """The latest entry of a hold log that is in force (ended ones at the end are dropped)."""
        holds = self._holds
        while log and holds.get(log[-1][1], (None,))[0] != log[-1][0]:
            log.pop()
        return log[-1] if log else None

    def _hold_covers(self, tid: str) -> bool:
        """Whether a hold keeps the paused ``tid`` paused: one in force, started after its
        pause, that did not leave it out."""
        s = self._pause_stamp.get(tid)
        if s is None:
            return False
        holds = self._holds
        for stamp, ptid in reversed(self._hold_log):
            if stamp < s:
                return False
            hold = holds.get(ptid)
            if hold is not None and hold[0] == stamp and tid not in hold[1]:
                return True
        return False

    # -- the urgency index -------------------------------------------------------------------------

    def _run(self, state: GroupState, p: Pending, now: float, rp: float | None = None) -> Run:
        run = super()._run(state, p, now, rp)
        tid = p.transfer_id
        self._order[tid] = next(self._stamps)
        self._by_pair.setdefault(p.pair, {})[tid] = run
        self._all_u.add(tid, run.urgency)
        self._unpaused_u.add(tid, run.urgency)
        if not p.unpreemptible:
            self._preemptible_u.add(tid, run.urgency)
        return run

    def _unrun(self, tid: str) -> None:
        run = self._runs.get(tid)
        if run is not None:
            pair = run.pending.pair
            mine = self._by_pair.get(pair)
            if mine is not None:
                mine.pop(tid, None)
                if not mine:
                    del self._by_pair[pair]
        self._order.pop(tid, None)
        self._all_u.discard(tid)
        self._unpaused_u.discard(tid)
        self._preemptible_u.discard(tid)
        self._paused_u.discard(tid)
        self._pause_stamp.pop(tid, None)
        super()._unrun(tid)

    def _urgency_moved(self, run: Run) -> None:
        """A running transfer's urgency changed (a deadline nears): re-index it."""
        tid, u = run.pending.transfer_id, run.urgency
        for index in (self._all_u, self._unpaused_u, self._preemptible_u, self._paused_u):
            if tid in index:
                index.add(tid, u)

    def _index_pause(self, run: Run) -> None:
        tid = run.pending.transfer_id
        stamp = next(self._stamps)
        self._pause_stamp[tid] = stamp
        log = self._pause_log
        log.append((stamp, tid))
        if len(log) > 2 * len(self._pause_stamp) + 64:
            live = self._pause_stamp
            self._pause_log = [e for e in log if live.get(e[1]) == e[0]]
        self._unpaused_u.discard(tid)
        self._preemptible_u.discard(tid)
        self._paused_u.add(tid, run.urgency)

    def _index_unpause(self, run: Run) -> None:
        tid = run.pending.transfer_id
        self._pause_stamp.pop(tid, None)
        self._paused_u.discard(tid)
        self._unpaused_u.add(tid, run.urgency)
        if not run.pending.unpreemptible:
            self._preemptible_u.add(tid, run.urgency)

    def _urgent_run(self, pending: Pending) -> bool:
        """Whether ``pending`` runs with an urgency that passes the preemption rule (critical, a near deadline)."""
        run = self._runs.get(pending.transfer_id)
        return run is not None and run.urgency >= self.preemption.ratio * self._u0

    def released(self, pending: Pending) -> None:
        """A running transfer ended; an urgent one gives its share back in this pass, not at the next slice."""
        if self._urgent_run(pending):
            self._at_once = True
        self._ended(pending)
        super().released(pending)

    def budget_only(self, pending: Pending) -> None:
        """An urgent transfer that is done gives its share back in this pass (its budget holds no share)."""
        if self._urgent_run(pending):
            self._at_once = True
        self._ended(pending)
        super().budget_only(pending)

    # -- decide --------------------------------------------------------------------------------

    def decide(self, state: GroupState, now: float) -> list[Decision]:
        """Resume, reservations, urgent admission, round robin, preemption and the new grants' rates."""
        self._catch_up(state)
        if self._idle:
            self._mark_idle(now)
        if self._paused:
            self._resume(state, now)
        elif self._to_check or self._rescan:
            self._to_check.clear()
            self._rescan = False
        if not self._queued:
            return []
        urgency = self.urgency.urgency
        decisions: list[Decision] = []
        started: list[Started] = []

        # Reservations, critical and deadline transfers, and those that waited long: urgent
        # admission when they outrank what they compete with or wait for.
        cands = list(self._special.values()) if self._special else []
        cutoff = now - self.aging_delay_s
        aged: list[tuple[float, Pair]] = []
        seen: set[Pair] = set()
        pairs = self._pairs
        while self._aging and self._aging[0][0] <= cutoff:
            since, _, pair = heapq.heappop(self._aging)
            if pairs.waiting_since(pair) != since or pair in seen:
                continue  # stale (it ran since, or left the queue), or a second entry of the same wait
            seen.add(pair)
            aged.append((since, pair))
            head = pairs.head(pairs.slots[pair])
            if head.transfer_id not in self._special:
                cands.append(head)
        if cands:
            scored = sorted(
                ((urgency(p, now, since=max(p.arrived, pairs.waiting_since(p.pair))), p) for p in cands),
                key=lambda x: -x[0],
            )
            floor = self.preemption.ratio * self._u0
            for u, p in scored:
                r = self.reservations.match(p) if len(self.reservations) else None
                if r is not None:
                    medium, reason, code = selection = self.selector.select(state, p)
                    self._unqueue(p.transfer_id)
                    if selection.refused:
                        decisions.append(Decision.refusal(p, reason, code))
                        continue
                    p.reservation = r.reservation_id
                    r.on_instance(now)
                    started.append((p, u, medium, f"reservation {r.reservation_id}; {reason}"))
                    continue
                slots = self.max_active - len(self._runs)
                if u < floor or not self._outranks_rivals(state, p, u, urgency(p, now, running=True), slots):
                    continue
                medium, reason, code = selection = self.selector.select(state, p)
                self._unqueue(p.transfer_id)
                if selection.refused:
                    decisions.append(Decision.refusal(p, reason, code))
                    continue
                self.urgent_admissions += 1
                self._run(state, p, now)
                started.append((p, u, medium, f"urgent (urgency {u:.1f}); {reason}"))
            for since, pair in aged:
                if pairs.waiting_since(pair) == since:  # not admitted: look again next slice
                    heapq.heappush(self._aging, (since, next(self._seq), pair))

        if self.max_active > len(self._runs) and len(self._pairs):
            self._round_robin(state, now, started, decisions)
        if not started:
            return decisions
        held = self._held_with_leases(state, now, [p for p, _, _, _ in started])
        for p, u, medium, reason in started:
            if p.reservation:
                r = self.reservations.get(p.reservation)
                rate = r.rate_bps if r is not None else MIN_RATE_BPS
            else:
                run = self._runs[p.transfer_id]
                if u >= self.preemption.ratio * self._u0:
                    # Decided on arrival, and the transfers it competes with make room in this
                    # pass (`adjust` reallocates at once), not at the next slice.
                    self._at_once = True
                    if p.request.nbytes >= self.preempt_min_bytes:
                        self._preempt(state, p, u, run.urgency, now)
                rate = self._share(state, run, held)
            decisions.append(Decision(p, medium, rate, f"{reason}; {_mbit(rate)}", start_at=now))
        self._dirty = True
        return decisions

    def _outranks_rivals(self, state: GroupState, p: Pending, u: float, u_own: float, slots: int) -> bool:
        """Whether ``p`` outranks a running transfer it competes with or waits for (its slot or pair).

        Waiting (``u``) counts only for a pair that has nothing running: aging is there so that
        no pair starves, not to give a served pair more transfers at once. Otherwise, and
        against its own pair's transfers, only its own urgency counts (``u_own``: deadline,
        critical).
        """
        pair = p.pair
        blocked_pair = self._pair_running.get(pair, 0) >= self.per_pair
        outranks = self.preemption.outranks
        if state.bandwidth_bps > 0:  # everything competes: the index answers
            mine = self._by_pair.get(pair)
            if mine:
                for run in mine.values():
                    if (slots <= 0 or blocked_pair or not run.pending.paused) and outranks(u_own, run.urgency):
                        return True
            least = (self._all_u if slots <= 0 else self._unpaused_u).first(skip=mine or ())
            return least is not None and outranks(u, least[0])
        for run in self._runs.values():
            f = run.pending
            same = f.pair == pair
            holder = slots <= 0 or (blocked_pair and same)
            if not holder and (f.paused or not self.competes(state, p, f)):
                continue
            if outranks(u_own if same else u, run.urgency):
                return True
        return False

    def _round_robin(self, state: GroupState, now: float, started: list[Started], decisions: list[Decision]) -> None:
        """Fill free slots by weighted round robin over pairs with queued work (oldest transfer of
        a pair first): with an incremental picker (`StrideWRR`, the default) O(log pairs) per
        grant and only the picked pair's weight computed; with `SmoothWRR`, vector passes over
        every pair."""
        pairs = self._pairs
        picker = self.picker
        if picker.incremental:
            while len(self._runs) < self.max_active:
                slot = picker.pick_ready()
                if slot is None:
                    return
                w = pairs.weight(slot, now, self.urgency)
                picker.served(slot, w)
                self._rr_start(state, now, slot, w, started, decisions)
            return
        eligible = pairs.ready[: pairs.n]  # kept up to date by _unqueue and _run as we go
        n_eligible = int(np.count_nonzero(eligible))
        if not n_eligible:
            return
        weights = pairs.weights(now, self.urgency, self.tick_s)
        while n_eligible and len(self._runs) < self.max_active:
            slot = picker.pick(weights, eligible)
            self._rr_start(state, now, slot, float(weights[slot]), started, decisions)
            if not eligible[slot]:
                n_eligible -= 1
            else:
                weights[slot] = pairs.weight(slot, now, self.urgency)

    def _rr_start(
        self, state: GroupState, now: float, slot: int, w: float, started: list[Started], decisions: list[Decision]
    ) -> None:
        """Start (or refuse) the oldest transfer of the pair the round robin picked, of weight ``w``."""
        pairs = self._pairs
        p = pairs.head(slot)
        rp = float(pairs.rp[slot])
        medium, reason, code = selection = self.selector.select(state, p)
        self._unqueue(p.transfer_id)
        if selection.refused:
            decisions.append(Decision.refusal(p, reason, code))
        else:
            self._run(state, p, now, rp)
            started.append((p, w - rp, medium, f"round robin (W {w:.1f}); {reason}"))

    def _preempt(self, state: GroupState, p: Pending, u: float, u_own: float, now: float) -> None:
        """Pause the running transfers ``p`` outranks among those it competes with.

        Those it outranks of its own pair by its own urgency (``u_own``), the others by ``u``.
        The paused ones it outranks stay paused until it is done too. With a group budget (every
        transfer competes with every other) the urgency index finds them: O(log n) plus the
        victims; without one, a scan of the running transfers.
        """
        if not (state.bandwidth_bps > 0 and self.preemption.picks_outranked_only):
            self._preempt_scan(state, p, u, u_own, now)
            return
        ptid, pair = p.transfer_id, p.pair
        outranks = self.preemption.outranks
        runs = self._runs
        mine = self._by_pair.get(pair, {})
        paused = self._paused_u
        if len(paused):
            # The paused transfers it outranks stay paused until it is done too: one hold that
            # names those it does not outrank (its pair's by ``u_own``, the most urgent others).
            out = [tid for tid, run in mine.items() if tid in paused and not outranks(u_own, run.urgency)]
            above = paused.pop_while(lambda uf: not outranks(u, uf))
            for uf, tid in above:
                paused.add(tid, uf)
                if tid not in mine:
                    out.append(tid)
            stamp = next(self._stamps)
            self._holds[ptid] = (stamp, frozenset(out))
            self._hold_log.append((stamp, ptid))
            if not out:
                self._full_holds.append((stamp, ptid))
        level = max(u, u_own)
        taken = self._preemptible_u.pop_while(lambda uf: outranks(level, uf))
        order = self._order
        others: list[tuple[int, Pending, float]] = []
        own: list[tuple[int, Pending, float]] = []
        back: list[tuple[Pending, float]] = []
        for uf, tid in taken:
            f = runs[tid].pending
            if f is not p and outranks(u_own if f.pair == pair else u, uf):
                (own if f.pair == pair else others).append((order[tid], f, uf))
            else:
                back.append((f, uf))
        for group, lvl in ((others, u), (own, u_own)):
            if not group:
                continue
            group.sort(key=lambda x: x[0])  # the running order, as a scan would find them
            chosen = self.preemption.victims(lvl, [(f, uf) for _, f, uf in group], now)
            ids = {f.transfer_id for f in chosen}
            back.extend((f, uf) for _, f, uf in group if f.transfer_id not in ids)
            for f in chosen:
                self._pause(p, f, lvl, now)
        for f, uf in back:
            if not f.paused and not f.unpreemptible:
                self._preemptible_u.add(f.transfer_id, uf)

    def _pause(self, p: Pending, f: Pending, level: float, now: float) -> None:
        """``p`` pauses ``f``."""
        run = self._runs[f.transfer_id]
        f.paused = True
        f.paused_at = now
        f.paused_by.add(p.transfer_id)
        self._victims.setdefault(p.transfer_id, set()).add(f.transfer_id)
        self._paused.add(f.transfer_id)
        self._index_pause(run)
        heapq.heappush(self._pause_ends, (now + self.max_pause_s, f.transfer_id))
        if run.loaded:
            self._add_load(run, -run.weight)
        self.preemptions += 1
        self._immediate.append(
            Adjustment(
                f,
                ControlAction.PAUSE,
                max_fraction=self.preemption.threshold,
                reason=f"preempted by {p.transfer_id} (urgency {level:.1f} vs {run.urgency:.1f})",
            )
        )

    def _preempt_scan(self, state: GroupState, p: Pending, u: float, u_own: float, now: float) -> None:
        """`_preempt` by a scan of every running transfer (no group budget, or a strategy that may
        pick transfers it does not outrank)."""
        others: list[tuple[Pending, float]] = []
        mine: list[tuple[Pending, float]] = []
        for run in self._runs.values():
            f = run.pending
            if f is p or not self.competes(state, p, f):
                continue
            (mine if f.pair == p.pair else others).append((f, run.urgency))
        for group, level in ((others, u), (mine, u_own)):
            for f, uf in group:
                if f.paused and self.preemption.outranks(level, uf):
                    f.paused_by.add(p.transfer_id)  # stays paused until this one is done too
                    self._victims.setdefault(p.transfer_id, set()).add(f.transfer_id)
            for f in self.preemption.victims(level, group, now):
                self._pause(p, f, level, now)

    def _resume(self, state: GroupState, now: float) -> None:
        """Resume the paused transfers whose preemptors are done or whose pause ran out, and take
        back the ones whose sender declined. Looks only at those that may have changed: the
        victims of preemptors that ended, the pauses that ran out (a heap), or all of them after
        a pause was declined outside a pass (`changed`)."""
        ends = self._pause_ends
        if self._rescan:
            self._rescan = False
            self._to_check.clear()
            cands = set(self._paused)
        else:
            cands, self._to_check = self._to_check, set()
        while ends and ends[0][0] <= now:
            cands.add(heapq.heappop(ends)[1])
        order = self._order
        # In the running order: the resumes (and the load sums they add to) do not depend on
        # how a set happens to iterate.
        for tid in sorted(cands, key=lambda t: order.get(t, -1)):
            if tid not in self._paused:
                continue
            run = self._runs.get(tid)
            if run is None:
                self._paused.discard(tid)
                continue
            f = run.pending
            if not f.paused:  # the sender declined the pause
                self._paused.discard(tid)
                self._index_unpause(run)
                if not run.loaded and not f.done:
                    self._add_load(run, run.weight)
                continue
            # Its preemptors that ended (done, or only their budget runs) left f.paused_by in
            # `_ended`, and a hold that ended left `_holds`.
            held = bool(f.paused_by) or self._hold_covers(tid)
            if held and now - f.paused_at < self.max_pause_s:
                continue
            why = "its preemptors are done" if not held else f"paused for {now - f.paused_at:.1f} s"
            f.paused = False
            f.paused_by.clear()
            self._paused.discard(tid)
            self._index_unpause(run)
            if not f.done:  # a budget resumes without a share again
                self._add_load(run, run.weight)
            self._immediate.append(Adjustment(f, ControlAction.RESUME, reason=why))
            self._dirty = True

    def _pause_end(self, tid: str) -> float:
        run = self._runs.get(tid)
        return run.pending.paused_at + self.max_pause_s if run is not None else -math.inf

    def next_wakeup(self, state: GroupState, now: float) -> float | None:
        """The earliest of: pending controls, a special transfer's next look, aging, the slice's
        reallocation, a pause running out, a reservation window opening or closing."""
        times = []
        if self._immediate:
            times.append(now)
        if self._special:
            times.append(now + self.tick_s)  # deadlines near, critical ones wait for a rival to go
        while self._aging and self._pairs.waiting_since(self._aging[0][2]) != self._aging[0][0]:
            heapq.heappop(self._aging)
        if self._aging:
            times.append(max(self._aging[0][0] + self.aging_delay_s, now + self.tick_s))
        if self._dirty:
            times.append(now if self._at_once else max(now, self._last_adjust + self.tick_s))
        if self._paused and (self._to_check or self._rescan):
            times.append(now)
        ends = self._pause_ends
        while ends and (ends[0][1] not in self._paused or self._pause_end(ends[0][1]) != ends[0][0]):
            heapq.heappop(ends)  # resumed, or paused again since (its entry is later in the heap)
        if ends:
            times.append(ends[0][0])
        if len(self.reservations):
            t = self.reservations.next_event(now)
            if t is not None:
                times.append(max(now, t))
        return min(times) if times else None
