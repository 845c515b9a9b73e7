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
    n = len(flows)
    rates: dict[K, float] = {}
    weight = [max(f.weight, 1e-9) for f in flows]
    uses: list[list[Hashable]] = [[r for r in f.resources if r in capacity] for f in flows]
    users: dict[Hashable, list[int]] = {}
    wsum: dict[Hashable, float] = {}
    for i in range(n):
        if not uses[i]:
            rates[flows[i].key] = 0.0
            continue
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
            rate = weight[i] * level
            rates[flows[i].key] = rate
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
    return rates


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
