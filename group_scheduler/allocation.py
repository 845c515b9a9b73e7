"""Bandwidth allocation: weighted max-min fairness by progressive filling.

Every flow uses a set of resources (the group's budget, its sender's egress, each receiver's
ingress), each with a capacity. All unfrozen flows grow together at ``weight * lambda``; when
a resource fills, the flows through it freeze at their current rate and the others keep
growing. The result is weighted max-min fair: no flow can get more without taking from one
whose rate per weight is no larger; every flow is held back by a full resource, so no
capacity stays idle while a flow through it could use more. A flow that crosses no finite
resource gets rate 0, which on the wire means unpaced.

A heap of the resources' fill levels makes one allocation O(F·d·log R) for F flows of d
resources each over R resources.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Flow:
    """One flow to allocate: its key, weight and the resources it crosses."""

    key: Hashable
    weight: float
    resources: tuple[Hashable, ...]


def weighted_max_min(flows: Sequence[Flow], capacity: Mapping[Hashable, float]) -> dict[Hashable, float]:
    """Rates (bytes/s) for ``flows`` under ``capacity``; resources missing from ``capacity`` are unlimited.

    Returns a rate for every flow's key; 0 for flows that cross no finite resource (unpaced).
    """
    n = len(flows)
    rates: dict[Hashable, float] = {}
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
