"""Scheduling weights: W_ij = role_priority_i + role_priority_j + urgency.

    urgency = base + alpha * exp(beta * queue_delay) + deadline term + critical term

- ``queue_delay`` is the time a transfer has waited for its grant; once it runs it waits no
  more, so a running transfer's urgency has ``exp(0) = 1`` there. The weighted policy counts
  a pair's waiting from the moment it had queued work and nothing running (time spent behind
  its own earlier transfers is service, not starvation). Aging is what keeps a low-priority
  pair from starving (see `UrgencyModel.starvation_bound_s`).
- The deadline term grows as the deadline nears: ``deadline_boost * exp(-slack / deadline_horizon_s)``
  with ``slack`` the time left (the full boost once the deadline is reached or passed).
- A critical transfer gets ``critical_boost`` on top.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbus.errors import ConfigError
from kvbus.group_scheduler.state import GroupState, Pending

DEFAULT_BASE = 1.0
DEFAULT_ALPHA = 1.0
DEFAULT_BETA = 2.0
DEFAULT_MAX_DELAY_S = 30.0
DEFAULT_DEADLINE_BOOST = 8.0
DEFAULT_DEADLINE_HORIZON_S = 0.5
DEFAULT_CRITICAL_BOOST = 50.0


@dataclass(frozen=True, slots=True)
class UrgencyModel:
    """The urgency of a transfer and the weight of its pair."""

    base: float = DEFAULT_BASE
    """Urgency every transfer has."""
    alpha: float = DEFAULT_ALPHA
    """Scale of the queue-delay term."""
    beta: float = DEFAULT_BETA
    """Growth rate of the queue-delay term, per second of waiting."""
    max_delay_s: float = DEFAULT_MAX_DELAY_S
    """Queue delay beyond which the term stops growing (keeps exp finite)."""
    deadline_boost: float = DEFAULT_DEADLINE_BOOST
    """Urgency added at (or past) a transfer's deadline."""
    deadline_horizon_s: float = DEFAULT_DEADLINE_HORIZON_S
    """How far ahead a deadline starts to count: the boost decays as exp(-slack / horizon)."""
    critical_boost: float = DEFAULT_CRITICAL_BOOST
    """Urgency added for a transfer flagged critical."""

    def __post_init__(self) -> None:
        if self.base < 0 or self.alpha <= 0 or self.beta <= 0:
            raise ConfigError("urgency needs base >= 0, alpha > 0 and beta > 0")
        if self.max_delay_s <= 0 or self.deadline_horizon_s <= 0:
            raise ConfigError("max_delay_s and deadline_horizon_s must be positive")
        if self.deadline_boost < 0 or self.critical_boost < 0:
            raise ConfigError("deadline_boost and critical_boost must not be negative")

    def urgency(self, p: Pending, now: float, *, running: bool = False, since: float | None = None) -> float:
        """Urgency of ``p`` at monotonic time ``now``.

        Args:
            running: it is no longer waiting (no waiting term).
            since: when its waiting started, if not at its arrival (the weighted policy counts a
                pair's waiting from when it last had nothing running).
        """
        start = p.arrived if since is None else since
        delay = 0.0 if running else min(max(0.0, now - start), self.max_delay_s)
        u = self.base + self.alpha * math.exp(self.beta * delay)
        if p.deadline_at is not None:
            slack = p.deadline_at - now
            u += self.deadline_boost * (1.0 if slack <= 0 else math.exp(-slack / self.deadline_horizon_s))
        if p.request.critical:
            u += self.critical_boost
        return u

    def weight(self, state: GroupState, p: Pending, now: float, *, running: bool = False) -> float:
        """W_ij of the transfer's pair: both role priorities plus its urgency.

        For a broadcast the receivers' side counts with the highest priority among them.
        """
        return (
            state.role_priority(p.src)
            + max((state.role_priority(rx) for rx in p.dst), default=0.0)
            + self.urgency(p, now, running=running)
        )

    def starvation_bound_s(self, ratio: float, tick_s: float) -> float:
        """Longest a pair with queued work and nothing running waits, behind ordinary transfers.

        A running ordinary (not critical, no deadline) transfer has urgency ``u0 = base + alpha``.
        A waiting pair's oldest transfer reaches ``ratio * u0`` after
        ``d = ln((ratio * u0 - base) / alpha) / beta`` seconds; the weighted policy then admits it
        at once, past the slot limits (an *urgent* admission), at the first slice after that:
        ``d + tick_s``. With the defaults (base 1, alpha 1, beta 2/s, ratio 4, 10 ms slices):
        ln(7) / 2 + 0.01 = 0.98 s. (If every transfer it waits behind is itself critical or near
        its deadline, the bound holds with their urgency in place of ``u0``.)
        """
        u0 = self.base + self.alpha
        target = ratio * u0
        if target <= self.base + self.alpha:
            return tick_s
        return math.log((target - self.base) / self.alpha) / self.beta + tick_s
