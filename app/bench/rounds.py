"""What every bench shares: interleaved rounds and how a figure over rounds is reported.

A headline figure is measured in ``rounds`` interleaved rounds (arm A, B, C, A, B, C, ...: each
arm sees the same machine load over the run) and reported as `spread`: the median with the
smallest and largest round, and every round's value. A ratio is taken per round (A and B of
the same round, minutes apart at most) and the ratios are spread, not the medians divided.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

#: Rounds of a full run; ``--quick`` and smoke runs use fewer (their JSON says how many).
FULL_ROUNDS = 5


def spread(values: Iterable[float | None], *, digits: int = 4) -> dict[str, Any]:
    """``{"median", "min", "max", "n", "values"}`` of the finite values (None/NaN left out; the
    median is None when nothing is left)."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {
        "median": round(statistics.median(vals), digits),
        "min": round(min(vals), digits),
        "max": round(max(vals), digits),
        "n": len(vals),
        "values": [round(v, digits) for v in vals],
    }


def median(values: Iterable[float | None]) -> float | None:
    """The median of the finite values (None when there are none)."""
    value = spread(values, digits=12)["median"]
    return None if value is None else float(value)


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def jain(xs: Sequence[float]) -> float:
    """Jain's fairness index (1 = all equal)."""
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs and any(xs) else float("nan")


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` when both are finite and ``b`` is not 0."""
    if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or b == 0:
        return None
    return a / b
