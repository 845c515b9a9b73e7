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

import heapq
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Hashable

import numpy as np

logger = logging.getLogger(__name__)

#: Largest weight a slot counts with (a sum of a million of them is still far from overflow).
MAX_WEIGHT = 1e150
#: Smallest weight `StrideWRR` counts with (its stride is ``1 / W``).
MIN_WEIGHT = 1e-150


class PairPicker(ABC):
    """Picks which pair may start a transfer next; a strategy object of the weighted policy.

    A picker whose ``incremental`` is true keeps its own index of the slots that may be picked
    (`StrideWRR`): the policy's `PairQueues` calls ``assign(slot, pair)`` / ``release(slot)`` as
    pairs take and leave slots and ``ready(slot)`` / ``unready(slot)`` as they may or may not
    start a transfer (in the scheduler's thread); the policy asks ``pick_ready()`` for the next
    slot and reports ``served(slot, weight)``. It does not use `pick` with vectors then.
    """

    incremental = False

    @abstractmethod
    def pick(self, weights: np.ndarray, eligible: np.ndarray) -> int:
        """The slot to serve, among those where ``eligible`` is true (``weights`` are the W_ij, positive)."""

    def reset(self, slot: int) -> None:  # noqa: B027 - optional hook
        """A slot was given to a new pair: forget what its previous pair had accumulated."""

    # The incremental form (``incremental`` true): the policy never calls `pick` then.

    def assign(self, slot: int, key: Hashable | None) -> None:
        """Pair ``key`` takes ``slot``."""
        raise NotImplementedError

    def release(self, slot: int) -> None:
        """``slot``'s pair left the table (no queued work)."""
        raise NotImplementedError

    def ready(self, slot: int) -> None:
        """``slot`` may be picked from now on."""
        raise NotImplementedError

    def unready(self, slot: int) -> None:
        """``slot`` may not be picked until it is ready again."""
        raise NotImplementedError

    def pick_ready(self) -> int | None:
        """The ready slot to serve next, or None."""
        raise NotImplementedError

    def served(self, slot: int, weight: float) -> None:
        """``slot`` was served with its pair's weight ``weight``."""
        raise NotImplementedError


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


class StrideWRR(PairPicker):
    """Weighted round robin by virtual time (stride scheduling) over a heap: O(log n) per pick.

    Each slot has a pass value. The ready slot with the smallest pass is picked (the oldest
    ready one on a tie); the virtual time moves to its pass, and the pass grows by ``1 / W`` of
    the pair's weight at that moment. A slot that becomes ready starts at the virtual time if
    its pass is behind (time spent not ready saves no turns, as smooth WRR's reset does); a new
    pair starts at the virtual time. Over any run of picks among ready slots, a slot is picked
    in proportion to its weight, as under smooth WRR; turns of different slots interleave in
    pass order.

    Unlike `SmoothWRR` it does not look at every slot on a pick: the policy tells it which
    slots become ready or stop being ready (`ready`, `unready`, through
    `kvbus.group_scheduler.pairs.PairQueues`), and asks only the picked pair's weight.

    Weights are clamped as `SmoothWRR` does: into ``MIN_WEIGHT..MAX_WEIGHT``, a non-finite
    one counting as the largest finite weight seen (1 if none), with a warning.
    """

    incremental = True

    def __init__(self) -> None:
        self.vtime = 0.0
        self._pass: dict[int, float] = {}
        self._heap: list[tuple[float, int, int]] = []
        self._entry: dict[int, int] = {}
        """Per ready slot, the sequence number of its live heap entry."""
        self._seq = 0
        self._wmax = 0.0
        self._key: dict[int, Hashable | None] = {}
        """Per slot, the pair in it (as `assign` was told)."""
        self._left: dict[Hashable, float] = {}
        """Per pair that left the table, the pass its last turn left it at (while ahead of the virtual time)."""
        self.clamped = 0

    def ready(self, slot: int) -> None:
        """``slot`` may be picked from now on (a no-op if it already may)."""
        if slot in self._entry:
            return
        p = self._pass.get(slot, self.vtime)
        if p < self.vtime:
            p = self.vtime
        self._pass[slot] = p
        self._seq += 1
        self._entry[slot] = self._seq
        heapq.heappush(self._heap, (p, self._seq, slot))

    def unready(self, slot: int) -> None:
        """``slot`` may not be picked until it is ready again."""
        if self._entry.pop(slot, None) is not None and len(self._heap) > 8 * len(self._entry) + 1024:
            # Drop the stale entries: O(heap), after as many pushes (amortised O(1)).
            entry = self._entry
            self._heap = [e for e in self._heap if entry.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def reset(self, slot: int) -> None:
        """A new pair in ``slot``: it starts at the virtual time."""
        self.assign(slot, None)

    def assign(self, slot: int, key: Hashable | None) -> None:
        """Pair ``key`` takes ``slot``: it starts at the virtual time, or at the pass its last
        turn left it at if that is later (a pair that empties its queue and comes back at once
        is not forgiven the turn it just had; one that was away saves nothing)."""
        start = self.vtime
        if key is not None:
            left = self._left.pop(key, None)
            if left is not None and left > start:
                start = left
        self._key[slot] = key
        self._pass[slot] = start
        if slot in self._entry:  # re-queue it at its new pass
            del self._entry[slot]
            self.ready(slot)

    def release(self, slot: int) -> None:
        """``slot``'s pair left the table (no queued work): its pass is kept for a while, by pair."""
        self.unready(slot)
        key = self._key.pop(slot, None)
        p = self._pass.get(slot, self.vtime)
        if key is not None and p > self.vtime:
            self._left[key] = p
            if len(self._left) > 2 * len(self._key) + 64:
                vt = self.vtime  # passes the virtual time has reached no longer matter
                self._left = {k: v for k, v in self._left.items() if v > vt}

    def pick_ready(self) -> int | None:
        """The ready slot to serve next (it stays ready; `served` charges it), or None."""
        heap, entry = self._heap, self._entry
        while heap:
            _, seq, slot = heap[0]
            if entry.get(slot) == seq:
                return slot
            heapq.heappop(heap)
        return None

    def served(self, slot: int, weight: float) -> None:
        """``slot`` was served with weight ``weight``: the virtual time moves to its pass and its
        pass grows by ``1 / weight``."""
        w = weight
        if not (MIN_WEIGHT <= w <= MAX_WEIGHT):
            w = self._clamp(w)
        elif w > self._wmax:
            self._wmax = w
        p = self._pass.get(slot, self.vtime)
        if p > self.vtime:
            self.vtime = p
        self._pass[slot] = max(p, self.vtime) + 1.0 / w
        if self._entry.pop(slot, None) is not None:
            self.ready(slot)

    def _clamp(self, w: float) -> float:
        if math.isfinite(w):
            return min(max(w, MIN_WEIGHT), MAX_WEIGHT)
        if self.clamped % 10_000 == 0:
            logger.warning(
                "stride WRR: a non-finite weight counted as %g (%d picks so far)", self._wmax or 1.0, self.clamped + 1
            )
        self.clamped += 1
        return self._wmax or 1.0

    def pick(self, weights: np.ndarray, eligible: np.ndarray) -> int:
        """The array form (for callers that hold vectors): O(slots) to bring readiness in line."""
        for slot in range(len(weights)):
            if eligible[slot]:
                self.ready(slot)
            else:
                self.unready(slot)
        best = self.pick_ready()
        if best is None:
            raise ValueError("no eligible slot")
        self.served(best, float(weights[best]))
        return best
