"""Smooth weighted round robin (the nginx upstream algorithm) over the pairs with pending work.

Each pick, every eligible key's ``current`` grows by its weight; the key with the largest
``current`` is picked and loses the total weight of the eligible keys. Over any run of picks
with fixed weights a key is picked in proportion to its weight, and the picks of different
keys interleave evenly (a heavy key does not get all its turns in a burst). A key that leaves
the table loses its accumulated credit, so an idle pair cannot save up turns.

Keys live in numbered slots (see `kvbus.group_scheduler.pairs.PairQueues`) and the weights
come as an array, so a pick is a few vector operations however many pairs wait.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


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
        w = weights * eligible
        current += w
        masked = self._masked[:n]
        np.copyto(masked, current)
        masked[~eligible] = -np.inf
        best = int(masked.argmax())
        current[best] -= w.sum()
        return best

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
