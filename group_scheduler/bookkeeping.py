"""The weighted policy's incremental index of the queue and the running set.

`WeightedPolicy` does not scan ``state.queue`` on a pass: it keeps queued transfers per pair
(`PairQueues`), the running ones with their weights and resources, the per-resource weight
sums and a heap of waiting times. The index (and which resources a transfer's weight loads)
follows the state by the `SchedulingPolicy` hooks its driver calls (`queued`, `withdrawn`,
`released`) and by the policy's own decisions, never by comparing copies of the state.

Arrivals are indexed at the start of the next pass (`_catch_up`), not inside `queued`: a pair's
role priorities and running count are taken at the moment the policy first looks at the
transfer, which is when they were always taken.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

from kvbus.group_scheduler.pairs import PairQueues
from kvbus.group_scheduler.state import GroupState, Pending
from kvbus.group_scheduler.weights import UrgencyModel

Pair = tuple[str, tuple[str, ...]]

#: The resource every transfer crosses when the group has a budget.
BUDGET = "budget"
#: The resource every inter-group transfer crosses: the group's lease from the coordinator.
INTER = "inter"


@dataclass(slots=True)
class Run:
    """A running ordinary transfer as the policy accounts for it."""

    pending: Pending
    urgency: float
    """Its urgency while running (no waiting term)."""
    weight: float
    resources: tuple[Hashable, ...]
    loaded: bool = True
    """Its weight counts in its resources' load (it is not paused)."""


class WeightedBook:
    """The index part of `WeightedPolicy` (a mixin: the attributes are the policy's own)."""

    urgency: UrgencyModel
    _u0: float
    _dirty: bool
    _runs: dict[str, Run]
    _load: dict[Hashable, float]
    _pair_running: Counter[Pair]
    _paused: set[str]
    _pairs: PairQueues
    _queued: dict[str, Pending]
    _arrivals: list[Pending]
    _aging: list[tuple[float, int, Pair]]
    _idle: set[Pair]
    _special: dict[str, Pending]
    _seq: itertools.count[int]

    def _init_book(self, pairs: PairQueues) -> None:
        self._runs = {}
        self._load = {}
        self._pair_running = Counter()
        self._paused = set()
        self._pairs = pairs
        self._queued = {}
        self._arrivals = []
        """Transfers queued since the last pass, in arrival order (indexed by `_catch_up`)."""
        self._aging = []
        """Heap of (waiting since, seq, pair) for pairs with queued work and nothing running."""
        self._idle = set()
        """Pairs whose last running transfer ended since the last pass."""
        self._special = {}
        self._seq = itertools.count()

    # -- resources -----------------------------------------------------------------------------

    @staticmethod
    def resources(state: GroupState, p: Pending) -> tuple[Hashable, ...]:
        """The finite resources a transfer crosses: the budget, its sender's egress, its receivers' ingress."""
        res: list[Hashable] = []
        if state.bandwidth_bps > 0:
            res.append(BUDGET)
        if state.remote and state.inter_group(p):
            res.append(INTER)  # always listed: the lease comes and goes while the transfer runs
        if state.capacity(p.src) > 0:
            res.append(("out", p.src))
        for rx in p.dst:
            if state.capacity(rx) > 0:
                res.append(("in", rx))
        return tuple(res)

    @staticmethod
    def _capacity(state: GroupState, key: Hashable) -> float:
        if key == BUDGET:
            return state.bandwidth_bps
        if key == INTER:
            return state.inter_bps
        assert isinstance(key, tuple), key  # the others are ("in" | "out", agent)
        return state.capacity(key[1])

    @staticmethod
    def competes(state: GroupState, a: Pending, b: Pending) -> bool:
        """Whether two transfers share a resource (the budget, a sender, a receiver)."""
        if state.bandwidth_bps > 0 or a.src == b.src:
            return True
        if state.inter_bps > 0 and state.inter_group(a) and state.inter_group(b):
            return True
        return any(rx in b.dst for rx in a.dst)

    # -- hooks -----------------------------------------------------------------------------------

    def queued(self, state: GroupState, pending: Pending) -> None:
        """A request joined the queue: indexed at the start of the next pass."""
        self._arrivals.append(pending)

    def withdrawn(self, state: GroupState, pending: Pending) -> None:
        """A queued transfer was refused outside the policy (an agent went down): forget it."""
        if pending.transfer_id in self._queued:
            self._unqueue(pending.transfer_id)
            return
        for i, p in enumerate(self._arrivals):
            if p is pending:
                del self._arrivals[i]
                return

    def released(self, pending: Pending) -> None:
        """A running transfer ended (done, failed, expired): its slot and its share are free."""
        if pending.transfer_id in self._runs:
            self._unrun(pending.transfer_id)
        self._dirty = True

    def budget_only(self, pending: Pending) -> None:
        """A transfer whose budget outlives it: it keeps its slot but no longer a weighted share
        of the bandwidth (a critical one's urgency weighed 13x a bulk transfer's and held most of
        the link for messages of a few KB; what its transfers use is held out of the budget
        instead, `WeightedRates.leased`), and it preempts nothing any more."""
        run = self._runs.get(pending.transfer_id)
        if run is not None and run.loaded:
            self._add_load(run, -run.weight)
        self._dirty = True

    def _catch_up(self, state: GroupState) -> None:
        """Index the transfers that arrived since the last pass."""
        if self._arrivals:
            arrivals, self._arrivals = self._arrivals, []
            for p in arrivals:
                self._enqueue(state, p)

    # -- the index -------------------------------------------------------------------------------

    @staticmethod
    def _rp(state: GroupState, p: Pending) -> float:
        """Role priority of the sender plus the highest of its receivers'."""
        dst = p.dst
        rx = state.role_priority(dst[0]) if len(dst) == 1 else max(state.role_priority(r) for r in dst)
        return state.role_priority(p.src) + rx

    def _enqueue(self, state: GroupState, p: Pending) -> None:
        self._queued[p.transfer_id] = p
        pair = p.pair
        new_pair = pair not in self._pairs.slots
        running = self._pair_running.get(pair, 0)
        self._pairs.push(p, self._rp(state, p), running, math.inf if running else p.arrived)
        if new_pair and not running:
            heapq.heappush(self._aging, (p.arrived, next(self._seq), pair))
        if p.request.critical or p.deadline_at is not None:
            self._special[p.transfer_id] = p

    def _unqueue(self, tid: str) -> None:
        p = self._queued.pop(tid)
        self._pairs.remove(p)
        self._special.pop(tid, None)

    def _run(self, state: GroupState, p: Pending, now: float, rp: float | None = None) -> Run:
        u = self.urgency.urgency(p, now, running=True) if p.request.critical or p.deadline_at is not None else self._u0
        w = (self._rp(state, p) if rp is None else rp) + u
        run = Run(p, u, w, self.resources(state, p))
        self._runs[p.transfer_id] = run
        self._pair_running[p.pair] += 1
        self._pairs.set_running(p.pair, self._pair_running[p.pair], math.inf)
        self._add_load(run, w)
        return run

    def _unrun(self, tid: str) -> None:
        run = self._runs.pop(tid)
        self._paused.discard(tid)
        pair = run.pending.pair
        self._pair_running[pair] -= 1
        self._pairs.set_running(pair, self._pair_running[pair], math.inf)
        if self._pair_running[pair] <= 0:
            del self._pair_running[pair]
            self._idle.add(pair)  # it waits from the next pass on (the time is known there)
        if run.loaded:
            self._add_load(run, -run.weight)
        self._dirty = True

    def _add_load(self, run: Run, w: float) -> None:
        load = self._load
        for r in run.resources:
            load[r] = load.get(r, 0.0) + w
        run.loaded = w > 0

    def _mark_idle(self, now: float) -> None:
        """Pairs whose last running transfer ended start waiting now (if they have queued work)."""
        for pair in self._idle:
            if pair in self._pairs.slots and not self._pair_running.get(pair, 0):
                self._pairs.set_running(pair, 0, now)
                heapq.heappush(self._aging, (now, next(self._seq), pair))
        self._idle.clear()
