"""Weighted max-min fair division of a shared capacity between groups."""

from __future__ import annotations

from collections.abc import Mapping


def weighted_max_min(capacity: float, demands: Mapping[str, float], weights: Mapping[str, float] | None = None
                     ) -> dict[str, float]:
    """Split ``capacity`` between claimants by weighted max-min fairness (water-filling).

    Every claimant gets at most its demand; capacity a claimant does not need is shared by the
    others in proportion to their weights; no capacity stays idle while a claimant wants more.

    Args:
        capacity: what there is to share (>= 0).
        demands: claimant -> what it asks for (>= 0).
        weights: claimant -> weight (> 0; default 1).

    Returns:
        claimant -> share, with sum(shares) = min(capacity, sum(demands)).
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
    shares = {k: 0.0 for k in demands}
    active = {k for k, d in demands.items() if d > 0}
    left = float(capacity)
    while active and left > 1e-12:
        total_w = sum(w[k] for k in active)
        # The fill level at which the first active claimant is satisfied.
        step = min((demands[k] - shares[k]) / w[k] for k in active)
        if step * total_w >= left:
            for k in active:
                shares[k] += left * w[k] / total_w
            left = 0.0
            break
        for k in active:
            shares[k] += step * w[k]
        left -= step * total_w
        active = {k for k in active if demands[k] - shares[k] > 1e-9}
    return shares
