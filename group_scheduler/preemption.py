"""Preemption: which running transfers an urgent one pauses.

A new transfer *outranks* a running one when its urgency is at least ``ratio`` times the
running one's. It pauses those it outranks that share a resource with it (sender egress,
receiver ingress, the group budget) and have sent less than ``threshold`` of their bytes.
Only the sender knows exactly how much it has sent, so the pause goes to it as a conditional
request (`Control.max_fraction` = ``threshold``): it pauses at the next chunk boundary if it is
below the threshold and declines otherwise; a transfer that declined is never asked again. A
paused transfer resumes from the first chunk it had not sent once every transfer that preempted
it is done (or after ``max_pause_s``); nothing it already sent goes again.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Iterable, Iterator

from kvbus.errors import ConfigError
from kvbus.group_scheduler.state import Pending

DEFAULT_RATIO = 4.0
DEFAULT_THRESHOLD = 0.30


class PreemptionStrategy(ABC):
    """Decides when a transfer outranks running ones and which of them to pause."""

    picks_outranked_only = False
    """`victims` only ever picks transfers the new one `outranks`, judging each on its own: the
    policy may then hand it only those, found through its urgency index, instead of every
    running transfer it competes with."""

    def __init__(self, ratio: float = DEFAULT_RATIO, threshold: float = DEFAULT_THRESHOLD) -> None:
        if ratio <= 1.0:
            raise ConfigError(f"preemption ratio {ratio} must be above 1")
        if not 0.0 <= threshold <= 1.0:
            raise ConfigError(f"preempt_threshold {threshold} must be within 0..1")
        self.ratio = ratio
        self.threshold = threshold

    def outranks(self, urgency_new: float, urgency_running: float) -> bool:
        """Whether a transfer of ``urgency_new`` may jump ahead of one of ``urgency_running``."""
        return urgency_new >= self.ratio * urgency_running

    @abstractmethod
    def victims(self, urgency_new: float, running: Iterable[tuple[Pending, float]], now: float) -> list[Pending]:
        """Running transfers (given with their urgency) the new one should pause."""


class ThresholdPreemption(PreemptionStrategy):
    """Pause what the new transfer outranks, if less than ``threshold`` of it has been sent
    (checked by the sender)."""

    picks_outranked_only = True

    def victims(self, urgency_new: float, running: Iterable[tuple[Pending, float]], now: float) -> list[Pending]:
        """The running transfers it outranks, except paused, unpreemptible and reserved ones."""
        out = []
        for p, u in running:
            if p.paused or p.unpreemptible or p.reservation:
                continue
            if self.outranks(urgency_new, u):
                out.append(p)
        return out


class NoPreemption(PreemptionStrategy):
    """Never pause anything (urgent transfers still jump the queue and get their weighted share)."""

    picks_outranked_only = True

    def victims(self, urgency_new: float, running: Iterable[tuple[Pending, float]], now: float) -> list[Pending]:
        """None, ever."""
        return []


class UrgencyHeap:
    """Transfer ids by urgency, the least urgent first (or the most, ``most_first``): a heap with
    lazy deletion, so adding, removing and finding the first cost O(log n) amortised.

    The weighted policy keeps its running transfers in these (all of them, the unpaused ones,
    the unpaused preemptible ones, the paused ones) so that finding what an urgent transfer
    outranks does not scan every running transfer. Ties are broken by insertion, and callers
    that need an order among the entries they take (the running order) sort them themselves.
    """

    def __init__(self, *, most_first: bool = False) -> None:
        self._sign = -1.0 if most_first else 1.0
        self._heap: list[tuple[float, int, str]] = []
        self._live: dict[str, int] = {}
        """Id -> the number of its live heap entry (older entries of the id are stale)."""
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, tid: object) -> bool:
        return tid in self._live

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def add(self, tid: str, urgency: float) -> None:
        """Index ``tid`` at ``urgency`` (replacing where it was)."""
        n = next(self._ids)
        self._live[tid] = n
        heapq.heappush(self._heap, (self._sign * urgency, n, tid))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._compact()

    def discard(self, tid: str) -> None:
        """Forget ``tid`` (nothing if it is not indexed)."""
        self._live.pop(tid, None)

    def _compact(self) -> None:
        live = self._live
        self._heap = [e for e in self._heap if live.get(e[2]) == e[1]]
        heapq.heapify(self._heap)

    def first(self, skip: Container[str] = ()) -> tuple[float, str] | None:
        """The (urgency, id) that comes first, ids in ``skip`` passed over; None if there is none."""
        heap, live = self._heap, self._live
        passed: list[tuple[float, int, str]] = []
        found = None
        while heap:
            e = heap[0]
            if live.get(e[2]) != e[1]:
                heapq.heappop(heap)
            elif e[2] in skip:
                passed.append(heapq.heappop(heap))
            else:
                found = (self._sign * e[0], e[2])
                break
        for e in passed:
            heapq.heappush(heap, e)
        return found

    def pop_while(self, keep_going: Callable[[float], bool]) -> list[tuple[float, str]]:
        """Take out, first first, every (urgency, id) while ``keep_going(urgency)`` holds.

        ``keep_going`` must hold for a prefix of the order (a threshold on the urgency); the
        caller adds back those it does not use.
        """
        heap, live, sign = self._heap, self._live, self._sign
        out = []
        while heap:
            u, n, tid = heap[0]
            if live.get(tid) != n:
                heapq.heappop(heap)
                continue
            if not keep_going(sign * u):
                break
            heapq.heappop(heap)
            del live[tid]
            out.append((sign * u, tid))
        return out
