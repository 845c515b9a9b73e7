"""Rate budgets: small transfers that start without a grant round trip.

A grant for a small transfer may carry a rate budget (`Grant.budget_s`): for that long the
transfer's slot stays the sender's, and the next transfers of at most ``budget_bytes`` to the
same receivers, with the same medium asked and the same urgency, start at once at the granted
rate and medium. The scheduler still holds every guarantee: the budget occupies the pair's slot
like a running transfer (the round robin and the reservations count it; the max-min rates give
it no weighted share, as its transfers are small and a critical one's weight would hold the
link, but share out the group budget less twice what its transfers used lately), a ``pause``
control naming it suspends it (a preempting transfer gets the bandwidth) and a ``resume`` gives
it back, a ``rate`` control changes it; each transfer run under it is reported done with
`TransferDone.budget`, so the link estimates keep learning. A budget never makes anyone wait:
the scheduler withdraws it (a ``cancel`` control) as soon as any transfer of the group is
queued, and a sender that asks for a transfer to the same receivers the budget cannot take (too
large, a deadline) ends the budget first, so that its own request is not queued behind it. Under
contention every transfer asks, and the round robin decides as before; an idle group's small
exchanges take one round trip (the `Open`).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvbus.bus.pacing import TokenBucket
from kvbus.protocol import Grant

#: Share of a budget's time a sender spends: the rest covers the grant's way back and clock skew.
USE_SHARE = 0.8
#: Budgets one agent keeps.
MAX_BUDGETS = 256

#: What a transfer must share with the granted one to run under its budget: the receivers, the
#: medium asked (None: the scheduler's choice), critical, whether it builds on a delta base.
BudgetKey = tuple[tuple[str, ...], str | None, bool, bool]


@dataclass
class Budget:
    """One granted transfer's rate budget, as its sender keeps it."""

    transfer_id: str
    """The granted transfer's id: the scheduler's name for the budget."""
    medium: str
    rate_bps: float
    until: float
    """Monotonic time after which it is not used."""
    max_bytes: int
    bucket: TokenBucket = field(default_factory=TokenBucket)
    """Paces every transfer run under the budget together at ``rate_bps``."""
    suspended: bool = False
    """A ``pause`` control named it; a ``resume`` lifts it."""

    def takes(self, nbytes: int, now: float) -> bool:
        """Whether a transfer of a context of ``nbytes`` may start under it now."""
        return not self.suspended and now < self.until and nbytes <= self.max_bytes

    def grant(self, transfer_id: str) -> Grant:
        """The grant a transfer run under the budget gets (made here, not asked for)."""
        return Grant(transfer_id=transfer_id, medium=self.medium, rate_bps=self.rate_bps, reason="rate budget")


class Budgets:
    """An agent's rate budgets, by `BudgetKey`, and the transfers running under them."""

    def __init__(self) -> None:
        self._by_key: collections.OrderedDict[BudgetKey, Budget] = collections.OrderedDict()
        self._running: dict[str, Budget] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def take(self, key: BudgetKey, transfer_id: str, nbytes: int, deadline: float | None) -> Grant | None:
        """A grant for ``transfer_id`` under the budget of ``key``, when it has one that takes it."""
        budget = self._by_key.get(key)
        if budget is None or deadline is not None or not budget.takes(nbytes, time.monotonic()):
            return None
        self._running[transfer_id] = budget
        return budget.grant(transfer_id)

    def add(self, key: BudgetKey, grant: Grant) -> None:
        """Keep the budget ``grant`` carries (one for ``key`` before is replaced)."""
        if grant.budget_s <= 0 or not grant.medium:
            return
        bucket = TokenBucket(grant.rate_bps, burst=max(grant.budget_bytes, grant.rate_bps * 0.02))
        self._by_key[key] = Budget(
            grant.transfer_id,
            grant.medium,
            grant.rate_bps,
            time.monotonic() + USE_SHARE * grant.budget_s,
            grant.budget_bytes,
            bucket,
        )
        self._by_key.move_to_end(key)
        while len(self._by_key) > MAX_BUDGETS:
            self._by_key.popitem(last=False)

    def under(self, transfer_id: str) -> Budget | None:
        """The budget ``transfer_id`` runs under, if any."""
        return self._running.get(transfer_id)

    def finished(self, transfer_id: str) -> Budget | None:
        """``transfer_id`` is over: the budget it ran under, if any."""
        return self._running.pop(transfer_id, None)

    def named(self, transfer_id: str) -> Budget | None:
        """The budget of the granted transfer ``transfer_id``, if this agent keeps one."""
        return next((b for b in self._by_key.values() if b.transfer_id == transfer_id), None)

    def end_for(self, receivers: tuple[str, ...]) -> Iterator[Budget]:
        """Drop and yield the budgets to exactly ``receivers`` still in force (the sender ends them)."""
        now = time.monotonic()
        for key in [k for k in self._by_key if k[0] == receivers]:
            budget = self._by_key.pop(key)
            if now < budget.until:
                yield budget

    def clear(self) -> list[Budget]:
        """Drop every budget; those still in force are returned (to be ended)."""
        now = time.monotonic()
        left = [b for b in self._by_key.values() if now < b.until]
        self._by_key.clear()
        return left
