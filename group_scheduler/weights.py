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

Every weight is finite by construction, whatever the clock or a transfer says: the exponent
``beta * queue_delay`` stops growing at `MAX_EXPONENT` (as it does at ``max_delay_s``), the
model's parameters are finite and at most `MAX_TERM`, and a NaN or infinite time counts as no
wait (or, for a deadline, as a deadline reached). ``exp`` never overflows, so no urgency is
``inf`` and no difference of two urgencies is NaN (which would hand every pick of the round
robin to one pair).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvbus.errors import ConfigError
from kvbus.group_scheduler.state import GroupState, Pending

DEFAULT_BASE = 1.0
DEFAULT_ALPHA = 1.0
DEFAULT_BETA = 2.0
DEFAULT_MAX_DELAY_S = 30.0
DEFAULT_DEADLINE_BOOST = 8.0
DEFAULT_DEADLINE_HORIZON_S = 0.5
DEFAULT_CRITICAL_BOOST = 50.0
#: Largest exponent of the waiting term: ``exp(200)`` is 7.2e86, far from float overflow (e^709.8).
MAX_EXPONENT = 200.0
#: Largest base, alpha and boost: with `MAX_EXPONENT` an urgency stays below 1e100.
MAX_TERM = 1e12
#: Largest urgency any transfer can have, 7.2e98: plus two role priorities (at most 1e6 each), a
#: weight stays far below the round robin's `MAX_WEIGHT`, and sums of many stay finite.
MAX_URGENCY = 3 * MAX_TERM + MAX_TERM * math.exp(MAX_EXPONENT)


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
    """Queue delay beyond which the term stops growing (it also stops where ``beta * delay``
    reaches `MAX_EXPONENT`)."""
    deadline_boost: float = DEFAULT_DEADLINE_BOOST
    """Urgency added at (or past) a transfer's deadline."""
    deadline_horizon_s: float = DEFAULT_DEADLINE_HORIZON_S
    """How far ahead a deadline starts to count: the boost decays as exp(-slack / horizon)."""
    critical_boost: float = DEFAULT_CRITICAL_BOOST
    """Urgency added for a transfer flagged critical."""

    def __post_init__(self) -> None:
        for name in ("base", "alpha", "beta", "max_delay_s", "deadline_boost", "deadline_horizon_s", "critical_boost"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
                raise ConfigError(f"urgency {name} must be a number, got {value!r}")
        if not (0 <= self.base <= MAX_TERM and 0 < self.alpha <= MAX_TERM and 0 < self.beta < math.inf):
            raise ConfigError(f"urgency needs base in 0..{MAX_TERM:g}, alpha in (0, {MAX_TERM:g}] and beta > 0, finite")
        if self.max_delay_s <= 0 or not 0 < self.deadline_horizon_s < math.inf:
            raise ConfigError("max_delay_s and deadline_horizon_s must be positive (deadline_horizon_s finite)")
        if not (0 <= self.deadline_boost <= MAX_TERM and 0 <= self.critical_boost <= MAX_TERM):
            raise ConfigError(f"deadline_boost and critical_boost must be within 0..{MAX_TERM:g}")

    @property
    def delay_cap_s(self) -> float:
        """Queue delay beyond which the waiting term stops growing: ``max_delay_s``, or less when
        ``beta * max_delay_s`` would pass `MAX_EXPONENT`."""
        return min(self.max_delay_s, MAX_EXPONENT / self.beta)

    def waiting_term(self, delay: float) -> float:
        """``alpha * exp(beta * delay)``, with the delay within ``0..delay_cap_s`` (NaN: 0)."""
        d = delay if delay > 0 else 0.0  # NaN and negative delays are no wait
        return self.alpha * math.exp(self.beta * min(d, self.delay_cap_s))

    def waiting_terms(self, delays: np.ndarray) -> np.ndarray:
        """`waiting_term` of every element of ``delays``, computed in place (and returned)."""
        np.fmax(delays, 0.0, out=delays)  # fmax: NaN becomes 0
        np.minimum(delays, self.delay_cap_s, out=delays)
        delays *= self.beta
        np.exp(delays, out=delays)
        delays *= self.alpha
        return delays

    def urgency(self, p: Pending, now: float, *, running: bool = False, since: float | None = None) -> float:
        """Urgency of ``p`` at monotonic time ``now``.

        Args:
            running: it is no longer waiting (no waiting term).
            since: when its waiting started, if not at its arrival (the weighted policy counts a
                pair's waiting from when it last had nothing running).
        """
        start = p.arrived if since is None else since
        u = self.base + (self.alpha if running else self.waiting_term(now - start))
        if p.deadline_at is not None:
            slack = p.deadline_at - now
            # not slack > 0: reached, passed, or NaN (a broken clock counts as a deadline reached)
            u += self.deadline_boost * (math.exp(-slack / self.deadline_horizon_s) if slack > 0 else 1.0)
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
