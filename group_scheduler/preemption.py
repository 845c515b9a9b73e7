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

from abc import ABC, abstractmethod
from collections.abc import Iterable

from kvbus.errors import ConfigError
from kvbus.group_scheduler.state import Pending

DEFAULT_RATIO = 4.0
DEFAULT_THRESHOLD = 0.30


class PreemptionStrategy(ABC):
    """Decides when a transfer outranks running ones and which of them to pause."""

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

    def victims(self, urgency_new: float, running: Iterable[tuple[Pending, float]], now: float) -> list[Pending]:
        """None, ever."""
        return []
