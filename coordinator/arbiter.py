"""Weighted max-min fair division of a shared capacity between groups.

The arithmetic is `kvbus.fairness` (one weighted max-min for the whole of kvbus): each group is a
flow over the shared capacity and over a resource of its own whose capacity is its demand.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvbus.fairness import fair_shares


def weighted_max_min(
    capacity: float, demands: Mapping[str, float], weights: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Split ``capacity`` between claimants by weighted max-min fairness (`kvbus.fairness.fair_shares`).

    Every claimant gets at most its demand; capacity a claimant does not need is shared by the
    others in proportion to their weights; no capacity stays idle while a claimant wants more.

    Args:
        capacity: what there is to share (>= 0).
        demands: claimant -> what it asks for (>= 0).
        weights: claimant -> weight (> 0; default 1).

    Returns:
        claimant -> share, with sum(shares) = min(capacity, sum(demands)).

    Raises:
        ValueError: a negative capacity or demand, or a weight that is not positive.
    """
    return fair_shares(capacity, demands, weights)
