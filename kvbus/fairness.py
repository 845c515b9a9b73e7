"""Weighted max-min fairness by progressive filling: the one implementation kvbus has.

Every flow uses a set of resources, each with a capacity. All unfrozen flows grow together at
``weight * lambda``; when a resource fills, the flows through it freeze at their current rate
and the others keep growing. The result is weighted max-min fair: no flow can get more without
taking from one whose rate per weight is no larger; every flow is held back by a full resource,
so no capacity stays idle while a flow through it could use more. A flow that crosses no finite
resource gets rate 0 (for a group scheduler: unpaced on the wire).

A heap of the resources' fill levels makes one allocation O(F·d·log R) for F flows of d
resources each over R resources.

The group scheduler allocates its transfers' rates with `weighted_max_min` (resources: the
group budget, each sender's egress, each receiver's ingress, the inter-group lease); the
coordinator splits the inter-group capacity between groups with `fair_shares`, which is the
same allocation with each claimant a flow over the shared capacity and a resource of its own
whose capacity is its demand.

Pure arithmetic: imports nothing from the rest of kvbus.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Flow", "fair_shares", "weighted_max_min"]

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Flow(Generic[K]):
    """One flow to allocate: its key, weight and the resources it crosses."""

    key: K
    weight: float
    resources: tuple[Hashable, ...]


def weighted_max_min(flows: Sequence[Flow[K]], capacity: Mapping[Hashable, float]) -> dict[K, float]:
    """Rates for ``flows`` under ``capacity``; resources missing from ``capacity`` are unlimited.

    Returns a rate for every flow's key; 0 for flows that cross no finite resource.
    """
    weight = [max(f.weight, 1e-9) for f in flows]
    levels = _freeze_levels(weight, [f.resources for f in flows], capacity)
    return {f.key: (w * lv if lv != math.inf else 0.0) for f, w, lv in zip(flows, weight, levels, strict=True)}


def _freeze_levels(
    weight: Sequence[float], resources: Sequence[tuple[Hashable, ...]], capacity: Mapping[Hashable, float]
) -> list[float]:
    """Progressive filling: per flow the level ``lambda`` at which it froze (its rate is
    ``weight * lambda``); ``inf`` for a flow that crosses no finite resource."""
    n = len(weight)
    levels = [math.inf] * n
    uses: list[list[Hashable]] = [[r for r in res if r in capacity] for res in resources]
    users: dict[Hashable, list[int]] = {}
    wsum: dict[Hashable, float] = {}
    for i in range(n):
        for r in uses[i]:
            users.setdefault(r, []).append(i)
            wsum[r] = wsum.get(r, 0.0) + weight[i]
    remaining = {r: max(0.0, float(capacity[r])) for r in users}
    version = dict.fromkeys(users, 0)
    heap = [(remaining[r] / wsum[r], 0, i, r) for i, r in enumerate(users)]
    heapq.heapify(heap)
    frozen = [False] * n
    done: set[Hashable] = set()
    order = {r: i for i, r in enumerate(users)}
    while heap:
        level, ver, _, r = heapq.heappop(heap)
        if r in done or ver != version[r]:
            continue
        done.add(r)
        touched: set[Hashable] = set()
        for i in users[r]:
            if frozen[i]:
                continue
            frozen[i] = True
            levels[i] = level
            rate = weight[i] * level
            for r2 in uses[i]:
                if r2 == r or r2 in done:
                    continue
                remaining[r2] -= rate
                wsum[r2] -= weight[i]
                touched.add(r2)
        for r2 in touched:
            version[r2] += 1
            if wsum[r2] <= 1e-12:
                done.add(r2)
                continue
            heapq.heappush(heap, (max(0.0, remaining[r2]) / wsum[r2], version[r2], order[r2], r2))
    return levels


#: The resource every claimant of `fair_shares` crosses.
_SHARED = ("fairness.shared",)


def fair_shares(
    capacity: float, demands: Mapping[str, float], weights: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Split ``capacity`` between claimants by weighted max-min fairness.

    Every claimant gets at most its demand; capacity a claimant does not need is shared by the
    others in proportion to their weights; no capacity stays idle while a claimant wants more.
    It is `weighted_max_min` with each claimant a flow over the shared capacity and over a
    resource of its own whose capacity is its demand.

    Args:
        capacity: what there is to share (>= 0).
        demands: claimant -> what it asks for (>= 0).
        weights: claimant -> weight (> 0; default 1).

    Returns:
        claimant -> share, with sum(shares) = min(capacity, sum(demands)).

    Raises:
        ValueError: a negative capacity or demand, or a weight that is not positive.
    """
    if capacity < 0:
        raise ValueError(f"capacity {capacity} must be >= 0")
    w = {k: float((weights or {}).get(k, 1.0)) for k in demands}
    for k, v in w.items():
        if v <= 0:
            raise ValueError(f"weight of {k!r} must be > 0, got {v}")
    for k, d in demands.items():
        if d < 0:
            raise ValueError(f"demand of {k!r} must be >= 0, got {d}")
    flows = [Flow(k, w[k], (_SHARED, ("demand", k))) for k in demands]
    caps: dict[Hashable, float] = {_SHARED: float(capacity)}
    for k, d in demands.items():
        caps[("demand", k)] = float(d)
    rates = weighted_max_min(flows, caps)
    return {k: float(rates[k]) for k in demands}


class _Live:
    """One flow of `IncrementalMaxMin`."""

    __slots__ = ("key", "level", "order", "resources", "side", "told", "ver", "weight", "wver")

    def __init__(self, key: Hashable, weight: float, resources: tuple[Hashable, ...], order: float, told: float):
        self.key = key
        self.weight = max(weight, 1e-9)
        self.resources = resources
        self.order = order
        self.level = math.inf
        """The level it freezes at in the allocation without the shared resource."""
        self.side = _OUT
        self.ver = 0
        """Version of its entry in the split's heaps (older entries are stale)."""
        self.wver = 0
        """Version of its entries in the drift heaps."""
        self.told = told


#: Sides of a flow in the split at the shared resource: not placed, held below the shared level
#: by a resource of its own, frozen at the shared level.
_OUT, _BELOW, _AT = 0, 1, 2
#: Margin of the drift heaps' keys: an entry comes out a little early and is checked exactly.
_MARGIN = 1e-9
#: Relative tolerance of the split: a flow within it of ``L`` may sit on either side.
_TOL = 1e-12
#: The split's sums are summed again, and its heaps' stale entries dropped, after this many
#: changes (entries) per flow plus `_REBUILD_MIN`: O(n) each time, so rare enough that a slice
#: pays for it well under 1 % of the time (amortised O(1)), and float error stays ~1e-12.
_REBUILD_FACTOR, _REBUILD_MIN = 16, 4096


class IncrementalMaxMin(Generic[K]):
    """`weighted_max_min` kept up to date as flows come and go and weights and capacities move.

    The inputs are the same (flows with weights and resources, finite capacities); `solve`
    brings the allocation up to date and returns the flows whose rate may have moved past
    ``epsilon`` of what they were last told (`tell`), so that a caller that reports rate
    changes never looks at the others.

    How it stays cheap: one resource, ``shared`` (a group's budget), may be crossed by every flow.
    Progressive filling then runs exactly as it would without it until the shared resource fills
    at level ``L``, where every flow still growing freezes: a flow's rate is
    ``weight * min(L, level)``, ``level`` being the one it freezes at in the allocation without
    the shared resource. That allocation splits into connected components (flows linked by the
    other resources they share: a sender's egress, a receiver's ingress), and a change recomputes
    only the components it touches. ``L`` solves ``sum(w * min(L, level)) = capacity``: the flows
    are split into those held below ``L`` (a max-heap by level) and those at ``L`` (a min-heap),
    with the sums of ``w * level`` and of ``w`` kept per side, so a change moves across the split
    only the flows it must, O(log n) each. Two more heaps hold, per flow at ``L``, the values of
    ``L`` past which its rate drifts more than ``epsilon`` from its told rate: when ``L`` moves,
    the flows to report come off their tops.

    Per change: O(size of the touched components + (flows that cross the split or drift) * log n).
    Without a shared resource that every flow crosses (no budget, or a flow that does not cross
    it), the shared resource counts as any other: one component, recomputed as a whole. After
    ``16 * len(flows) + 4096`` changes the split's two sums are summed again from scratch (O(n)
    additions, amortised O(1) per change), so float error in them does not build up; the heaps'
    stale entries are dropped at the same size.

    Pure arithmetic, one thread; equal within float rounding to `weighted_max_min` over the same
    flows (tests/test_fairness_incremental.py checks it against that one).
    """

    def __init__(
        self,
        shared: Hashable | None = None,
        *,
        epsilon: float = 0.0,
        rebuild_after: tuple[int, int] = (_REBUILD_FACTOR, _REBUILD_MIN),
    ) -> None:
        self.shared = shared
        self.epsilon = epsilon
        self.rebuild_after = rebuild_after
        """(per flow, plus): changes after which the sums are summed again, heap entries after which stale ones go."""
        self._flows: dict[Hashable, _Live] = {}
        self._cap: dict[Hashable, float] = {}
        self._users: dict[Hashable, dict[Hashable, None]] = {}
        self._dirty: dict[Hashable, None] = {}
        """Flows whose component is recomputed in the next `solve`."""
        self._dirty_res: dict[Hashable, None] = {}
        """Resources whose capacity or flows changed: their components are recomputed."""
        self._crossing = 0
        """Flows that cross ``shared``."""
        self._split = False
        """Whether the allocation is split at the shared resource (as of the last solve)."""
        self.level = math.inf
        """The shared resource's level ``L`` (inf: it does not fill, or there is no split)."""
        self._a = 0.0
        """Sum of ``w * level`` of the flows below ``L``."""
        self._w = 0.0
        """Sum of ``w`` of the flows at ``L``."""
        self._n = [0, 0, 0]
        """Flows per side."""
        self._below: list[tuple[float, int, Hashable]] = []
        self._at: list[tuple[float, int, Hashable]] = []
        self._up: list[tuple[float, int, Hashable]] = []
        self._down: list[tuple[float, int, Hashable]] = []
        self._changes = 0
        self.recomputed = 0
        """Flows whose component was recomputed, over all solves (a cost counter)."""

    def __len__(self) -> int:
        return len(self._flows)

    def __contains__(self, key: object) -> bool:
        return key in self._flows

    # -- inputs --------------------------------------------------------------------------------

    def set_capacity(self, resource: Hashable, capacity: float | None) -> None:
        """``resource``'s capacity (``None``: unlimited)."""
        old = self._cap.get(resource)
        if capacity is None:
            if old is None:
                return
            del self._cap[resource]
        else:
            capacity = float(capacity)
            if old == capacity:
                return
            self._cap[resource] = capacity
        self._dirty_res[resource] = None

    def capacity(self, resource: Hashable) -> float | None:
        """``resource``'s capacity as set (``None``: unlimited)."""
        return self._cap.get(resource)

    def resources(self) -> list[Hashable]:
        """Every resource a flow crosses or a capacity was set for."""
        return list(dict.fromkeys([*self._users, *self._cap]))

    def add(
        self, key: K, weight: float, resources: tuple[Hashable, ...], *, told: float = 0.0, order: float = 0.0
    ) -> None:
        """A flow joins (or replaces the one with its key). ``told``: the rate it runs at now;
        ``order``: its place among the flows (float rounding follows that order)."""
        if key in self._flows:
            self.remove(key)
        f = _Live(key, weight, tuple(dict.fromkeys(resources)), order, told)
        self._flows[key] = f
        for r in f.resources:
            self._users.setdefault(r, {})[key] = None
        if self.shared is not None and self.shared in f.resources:
            self._crossing += 1
        self._dirty[key] = None
        self._changes += 1

    def remove(self, key: K) -> None:
        """A flow leaves."""
        f = self._flows.pop(key)
        self._unplace(f)
        for r in f.resources:
            users = self._users[r]
            del users[key]
            if users:
                self._dirty_res[r] = None
            else:
                del self._users[r]
        if self.shared is not None and self.shared in f.resources:
            self._crossing -= 1
        self._dirty.pop(key, None)
        self._changes += 1

    def set_weight(self, key: K, weight: float) -> None:
        """A flow's weight moved."""
        f = self._flows[key]
        w = max(weight, 1e-9)
        if w != f.weight:
            self._unplace(f)
            f.weight = w
            self._dirty[key] = None
            self._changes += 1

    def tell(self, key: K, rate: float) -> None:
        """The flow runs at ``rate`` now: its drift is measured from there."""
        f = self._flows[key]
        f.told = rate
        if f.side == _AT:
            self._watch(f)

    # -- outputs -------------------------------------------------------------------------------

    def rate(self, key: K) -> float:
        """A flow's rate as of the last `solve` (0: it crosses no finite resource)."""
        return self._rate(self._flows[key])

    def _rate(self, f: _Live) -> float:
        lv = self.level if f.side == _AT else f.level
        return f.weight * lv if lv != math.inf else 0.0

    def rates(self) -> dict[K, float]:
        """Every flow's rate (O(n): for tests)."""
        return {k: self._rate(f) for k, f in self._flows.items()}  # type: ignore[misc]

    # -- the allocation ------------------------------------------------------------------------

    def solve(self) -> list[K]:
        """Bring the allocation up to date. Returns, in flow order, the flows whose rate moved
        past ``epsilon`` of what they were told; `tell` each its rate once acted on."""
        s = self.shared
        split = s is not None and s in self._cap and 0 < self._crossing == len(self._flows)
        if split != self._split:
            self._split = split
            self._reset_split()
            self._dirty.update(dict.fromkeys(self._flows))
        elif split and self._changes > self.rebuild_after[0] * len(self._flows) + self.rebuild_after[1]:
            self._resum()
        cands: dict[Hashable, None] = {}
        skip = s if split else None
        cap = self._cap
        for comp in self._components(skip):
            self.recomputed += len(comp)
            if len(comp) == 1:
                # Alone on its links: it freezes where the first of them fills (as progressive
                # filling computes it, to the bit).
                one = comp[0]
                lv = math.inf
                for r in one.resources:
                    if r in cap and r != skip:
                        c = cap[r]
                        x = (c if c > 0.0 else 0.0) / one.weight
                        if x < lv:
                            lv = x
                levels = [lv]
            else:
                comp.sort(key=lambda f: f.order)
                caps = {r: cap[r] for f in comp for r in f.resources if r in cap and r != skip}
                levels = _freeze_levels([f.weight for f in comp], [f.resources for f in comp], caps)
            for f, lv in zip(comp, levels, strict=True):
                if not split:
                    f.level = lv
                elif f.level != lv or f.side == _OUT:
                    self._side(f, _BELOW if lv < self.level else _AT, lv)
                cands[f.key] = None
        if not split:
            self.level = math.inf
            return self._drifted(cands, [])
        for f in self._fix_split():
            cands[f.key] = None
        # The flows at L whose rate drifted past epsilon of what they were told.
        lv = self.level
        flows = self._flows
        popped: list[_Live] = []
        for heap, sign in ((self._up, 1.0), (self._down, -1.0)):
            while heap and heap[0][0] < sign * lv:
                _, ver, key = heapq.heappop(heap)
                g = flows.get(key)
                if g is not None and g.wver == ver and g.side == _AT:
                    cands[key] = None
                    popped.append(g)
        limit = self.rebuild_after[0] * len(flows) + self.rebuild_after[1]
        if len(self._at) > limit or len(self._up) > limit or len(self._down) > limit or len(self._below) > limit:
            self._compact(limit)
        return self._drifted(cands, popped)

    def _compact(self, limit: int) -> None:
        """Drop the stale entries of the heaps (amortised: it takes as many pushes to come here)."""
        flows = self._flows

        def live(heap: list[tuple[float, int, Hashable]], side: int, drift: bool) -> list[tuple[float, int, Hashable]]:
            kept = [
                e
                for e in heap
                if (f := flows.get(e[2])) is not None and (f.wver if drift else f.ver) == e[1] and f.side == side
            ]
            heapq.heapify(kept)
            return kept

        if len(self._below) > limit:
            self._below = live(self._below, _BELOW, False)
        if len(self._at) > limit:
            self._at = live(self._at, _AT, False)
        if len(self._up) > limit:
            self._up = live(self._up, _AT, True)
        if len(self._down) > limit:
            self._down = live(self._down, _AT, True)

    def _drifted(self, cands: dict[Hashable, None], popped: list[_Live]) -> list[K]:
        eps, flows, level = self.epsilon, self._flows, self.level
        out: list[_Live] = []
        for key in cands:
            f = flows.get(key)
            if f is None:
                continue
            lv = level if f.side == _AT else f.level
            new, old = (f.weight * lv if lv != math.inf else 0.0), f.told
            if old == new or (old > 0 and new > 0 and abs(new - old) <= eps * old):
                continue
            out.append(f)
        told = {f.key for f in out}
        for f in popped:
            if f.key not in told and f.side == _AT:
                told.add(f.key)
                self._watch(f)  # it came off a drift heap early (the margin): watch it again
        out.sort(key=lambda f: f.order)
        return [f.key for f in out]  # type: ignore[misc]

    def _components(self, skip: Hashable | None) -> list[list[_Live]]:
        """The flows of each component a change touched (linked by finite resources but ``skip``)."""
        cap, users, flows = self._cap, self._users, self._flows
        starts = list(self._dirty)
        for r in self._dirty_res:
            if r != skip:  # finite or not (a capacity that went away frees its flows)
                starts.extend(users.get(r, ()))
        self._dirty.clear()
        self._dirty_res.clear()
        seen_f: set[Hashable] = set()
        seen_r: set[Hashable] = set()
        comps = []
        for k0 in starts:
            if k0 in seen_f or k0 not in flows:
                continue
            seen_f.add(k0)
            comp, stack = [], [k0]
            while stack:
                f = flows[stack.pop()]
                comp.append(f)
                for r in f.resources:
                    if r == skip or r in seen_r or r not in cap:
                        continue
                    seen_r.add(r)
                    for k2 in users[r]:
                        if k2 not in seen_f:
                            seen_f.add(k2)
                            stack.append(k2)
            comps.append(comp)
        return comps

    # -- the split at the shared resource --------------------------------------------------------

    def _reset_split(self) -> None:
        self._a = self._w = 0.0
        self._n = [0, 0, 0]
        self._below, self._at, self._up, self._down = [], [], [], []
        self.level = math.inf
        for f in self._flows.values():
            f.side = _OUT
            f.ver += 1

    def _side(self, f: _Live, side: int, level: float | None = None) -> None:
        """Move ``f`` to ``side`` (at its new ``level``, if given), keeping the sums (a side
        left empty sums to exactly 0)."""
        n = self._n
        if f.side == _BELOW:
            n[_BELOW] -= 1
            self._a = self._a - f.weight * f.level if n[_BELOW] else 0.0
        elif f.side == _AT:
            n[_AT] -= 1
            self._w = self._w - f.weight if n[_AT] else 0.0
        if level is not None:
            f.level = level
        f.side = side
        f.ver += 1
        if side == _BELOW:
            n[_BELOW] += 1
            self._a += f.weight * f.level
            heapq.heappush(self._below, (-f.level, f.ver, f.key))
        elif side == _AT:
            n[_AT] += 1
            self._w += f.weight
            heapq.heappush(self._at, (f.level, f.ver, f.key))
            self._watch(f)

    def _resum(self) -> None:
        """The split's sums from scratch (float error of the running sums does not build up)."""
        self._changes = 0
        flows = self._flows.values()
        self._a = math.fsum(f.weight * f.level for f in flows if f.side == _BELOW)
        self._w = math.fsum(f.weight for f in flows if f.side == _AT)

    def _unplace(self, f: _Live) -> None:
        if f.side != _OUT:
            self._side(f, _OUT)

    def _watch(self, f: _Live) -> None:
        """Drift heap entries of ``f`` at ``L``: the values of ``L`` past which its rate drifts
        more than epsilon from its told rate."""
        f.wver += 1
        v, k = f.wver, f.key
        t, w, eps = f.told, f.weight, self.epsilon
        heapq.heappush(self._up, (t * (1 + eps) / w * (1 - _MARGIN), v, k))
        heapq.heappush(self._down, (-(t * (1 - eps) / w * (1 + _MARGIN)), v, k))

    def _top(self, heap: list[tuple[float, int, Hashable]], side: int) -> _Live | None:
        flows = self._flows
        while heap:
            _, ver, key = heap[0]
            f = flows.get(key)
            if f is not None and f.ver == ver and f.side == side:
                return f
            heapq.heappop(heap)
        return None

    def _fix_split(self) -> list[_Live]:
        """Move flows across the split until ``L`` lies between the two sides' levels; the moved ones."""
        cap = max(0.0, self._cap[self.shared])
        moved = []
        while True:
            empty = math.inf if self._a <= cap else -math.inf
            lv = (cap - self._a) / self._w if self._n[_AT] else empty
            b = self._top(self._below, _BELOW)
            # A tolerance of float rounding: a move cannot undo itself (a flow that moves to
            # ``L`` moves ``L`` towards its level, not past it, but rounding could).
            if b is not None and lv < b.level - _TOL * b.level:
                self._side(b, _AT)
                moved.append(b)
                continue
            s = self._top(self._at, _AT)
            if s is not None and lv > s.level + _TOL * s.level:
                self._side(s, _BELOW)
                moved.append(s)
                continue
            break
        self.level = max(lv, 0.0)
        return moved
