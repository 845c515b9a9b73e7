"""Smooth weighted round robin (the nginx upstream algorithm) over the pairs with pending work.

Each pick, every eligible key's ``current`` grows by its weight; the key with the largest
``current`` is picked and loses the total weight of the eligible keys. Over any run of picks
with fixed weights a key is picked in proportion to its weight, and the picks of different
keys interleave evenly (a heavy key does not get all its turns in a burst). A key that leaves
the table loses its accumulated credit, so an idle pair cannot save up turns.

Keys live in numbered slots (see `kvbus.group_scheduler.pairs.PairQueues`) and the weights
come as an array, so a pick is a few vector operations however many pairs wait.

The weights are finite by construction (`kvbus.group_scheduler.weights`), and the picker does
not rely on it: one NaN or infinite weight would make the credits NaN, and ``argmax`` would then
hand every pick to one slot for good. A slot that is not eligible counts with nothing, whatever
its weight; an eligible one's weight is clamped into ``0..MAX_WEIGHT``, and a non-finite one
counts as the largest finite weight among the eligible slots, or 1 if there is none (an
overflowed urgency is as urgent as the most urgent well-formed one, never more), with a warning.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod

import numpy as np

logger = logging.getLogger(__name__)

#: Largest weight a slot counts with (a sum of a million of them is still far from overflow).
MAX_WEIGHT = 1e150


class PairPicker(ABC):
    """Picks which pair may start a transfer next; a strategy object of the weighted policy."""

    @abstractmethod
    def pick(self, weights: np.ndarray, eligible: np.ndarray) -> int:
        """The slot to serve, among those where ``eligible`` is true (``weights`` are the W_ij, positive)."""

    def reset(self, slot: int) -> None:  # noqa: B027 - optional hook
        """A slot was given to a new pair: forget what its previous pair had accumulated."""


class SmoothWRR(PairPicker):
    """nginx's smooth weighted round robin over slots."""

    def __init__(self) -> None:
        self.current = np.zeros(64)
        self._masked = np.empty(64)
        self.clamped = 0
        """Picks whose weights had to be clamped (out of range or not finite)."""

    def _grow(self, n: int) -> None:
        if n > len(self.current):
            self.current = np.concatenate([self.current, np.zeros(max(n, 2 * len(self.current)) - len(self.current))])

    def pick(self, weights: np.ndarray, eligible: np.ndarray) -> int:
        """Add each eligible slot's weight to its credit; the slot with the most credit wins and pays the total."""
        n = len(weights)
        self._grow(n)
        if n > len(self._masked):
            self._masked = np.empty(len(self.current))
        current = self.current[:n]
        w = np.where(eligible, weights, 0.0)  # not weights * eligible: inf * 0 is NaN
        # The sum only of weights that are not negative: inf + -inf would warn (and be NaN).
        total = w.sum() if w.min() >= 0.0 else math.nan
        if not total <= MAX_WEIGHT:  # NaN and inf too
            total = self._clamp(w, eligible)
        current += w
        masked = self._masked[:n]
        np.copyto(masked, current)
        masked[~eligible] = -np.inf
        best = int(masked.argmax())
        current[best] -= total
        return best

    def _clamp(self, w: np.ndarray, eligible: np.ndarray) -> float:
        """Bring the eligible slots' weights in ``w`` into ``0..MAX_WEIGHT``, in place; their sum.

        Warns on the first pick that needed it, then on every 10,000th (picks run on every grant).
        """
        finite = np.isfinite(w)
        if finite.all() and w.min() >= 0.0 and w.max() <= MAX_WEIGHT:
            return float(w.sum())  # only the sum is large: fine as it is
        np.clip(w, 0.0, MAX_WEIGHT, out=w)  # NaN stays NaN, and is replaced below
        w[~finite] = w[finite & eligible].max(initial=0.0) or 1.0
        if self.clamped % 10_000 == 0:
            logger.warning(
                "smooth WRR: weights outside 0..%g clamped (non-finite in slots %s; %d picks so far)",
                MAX_WEIGHT,
                np.flatnonzero(~finite)[:8].tolist(),
                self.clamped + 1,
            )
        self.clamped += 1
        return float(w.sum())

    def reset(self, slot: int) -> None:
        """Zero ``slot``'s credit."""
        self._grow(slot + 1)
        self.current[slot] = 0.0


def smooth_wrr_order(weights: dict[object, float], picks: int) -> list[object]:
    """The sequence of ``picks`` keys smooth WRR serves for fixed ``weights`` (for tests and docs)."""
    keys = list(weights)
    w = np.array([weights[k] for k in keys], dtype=float)
    picker = SmoothWRR()
    eligible = np.ones(len(keys), dtype=bool)
    return [keys[picker.pick(w, eligible)] for _ in range(picks)]
