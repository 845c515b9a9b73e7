"""Inter-group arbitration seen from a group scheduler: the bandwidth lease from the coordinator.

Transfers whose receiver is in another group share the deployment's inter-group capacity. While
a group has such transfers (queued or running), its scheduler asks the coordinator for a lease
every epoch, with its demand; the share it gets caps the summed rate of those transfers (the
policy's max-min allocation treats the lease as one more resource they all cross). Without an
answer the last lease holds until it expires; then the group falls back to its own budget.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvbus.errors import CoordinatorUnavailable, WireFormatError
from kvbus.group_scheduler.state import GroupState, Pending
from kvbus.net.coordinator_client import CoordinatorClient
from kvbus.net.transport import Transport

logger = logging.getLogger(__name__)

#: Epoch used until the coordinator has said its own (it does in every lease).
DEFAULT_EPOCH_S = 0.1
#: Without a coordinator, ask again this often (not every epoch: each attempt waits the timeout).
RETRY_S = 1.0
#: Leases never cap below this (a cap of 0 would read as "uncapped").
MIN_SHARE_BPS = 1024.0


class InterGroupLease:
    """Keeps ``state.inter_bps`` at the group's lease while the group has inter-group demand.

    Args:
        transport: the NATS seam (the coordinator answers on ``kvbus.coord.lease``).
        state: the group's S(t); its ``remote`` table says which transfers are inter-group.
        scheduler: this scheduler's name (sent with every request).
        default_bps: what one inter-group transfer wants when its link is not declared.
        priority: the group's weight in the coordinator's split.
        timeout: seconds a lease request waits for an answer.
        on_change: called when the cap changes (the policy reallocates rates).
    """

    def __init__(
        self,
        transport: Transport,
        state: GroupState,
        scheduler: str,
        *,
        default_bps: float,
        priority: float = 1.0,
        timeout: float = 0.5,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.client = CoordinatorClient(transport, timeout=timeout)
        self.state = state
        self.scheduler = scheduler
        self.default_bps = default_bps
        self.priority = priority
        self.on_change = on_change
        self.epoch_s = DEFAULT_EPOCH_S
        self.expires_at = 0.0
        """Epoch seconds when the last lease runs out."""
        self.leases = 0
        """Leases received."""
        self.fallback = False
        """No lease in force: the inter-group transfers are held to the group's own budget."""
        self._held = False
        self._warned = False
        self._retry_at = 0.0
        self._demand = asyncio.Event()
        self._lock = asyncio.Lock()

    def demand_bps(self) -> float:
        """What the group's inter-group transfers want: per transfer its declared link, else the default."""
        total = 0.0
        for p in (*self.state.queue, *self.state.active.values()):
            if self.state.inter_group(p):
                total += self._want(p)
        return total

    def _want(self, p: Pending) -> float:
        declared = [b for b in (self.state.declared_bandwidth(p.src, rx) for rx in p.dst) if b > 0]
        return min(declared) if declared else self.default_bps

    async def ensure(self, traceparent: str | None = None) -> None:
        """Before an inter-group transfer is granted: have a lease in force (or know there is none).

        Only the first inter-group request of a busy period waits (one round trip, at most the
        timeout); later ones find the lease held and cost nothing.
        """
        if self._held or self.fallback:
            self.wake()
            return
        async with self._lock:
            if not self._held and not self.fallback:
                await self.renew(traceparent)
        self._demand.set()  # the loop renews from here on

    def wake(self) -> None:
        """A transfer became inter-group demand: ask now rather than at the next epoch (if none is held)."""
        if not self._held:
            self._demand.set()

    def _set(self, cap: float) -> None:
        if cap != self.state.inter_bps:
            self.state.inter_bps = cap
            if self.on_change is not None:
                self.on_change()

    async def renew(self, traceparent: str | None = None) -> None:
        """One epoch: ask for the current demand (0 releases a lease held), apply the answer.

        ``traceparent``: the transfer whose request made the group ask (its trace shows the wait).
        """
        demand = self.demand_bps()
        if demand <= 0 and not self._held:
            return
        if self.fallback and time.time() < self._retry_at:
            return  # no coordinator lately: do not make every epoch wait for the timeout
        try:
            grant = await self.client.lease(
                self.state.group, self.scheduler, demand, self.priority, traceparent=traceparent
            )
        except (CoordinatorUnavailable, WireFormatError) as exc:
            if time.time() < self.expires_at:
                return  # the last lease still holds
            if not self._warned:
                logger.warning(
                    "group %s: no lease from the coordinator (%s); inter-group transfers fall back "
                    "to the group's own budget",
                    self.state.group,
                    exc,
                )
                self._warned = True
            self.fallback = True
            self._retry_at = time.time() + RETRY_S
            self._held = False
            self._set(self.state.bandwidth_bps)
            return
        if self._warned:
            logger.info("group %s: the coordinator answers again", self.state.group)
        self._warned = False
        self.fallback = False
        self.leases += 1
        self.epoch_s = grant.epoch_s if grant.epoch_s > 0 else DEFAULT_EPOCH_S
        self.expires_at = grant.expires_at
        self._held = demand > 0
        self._set(max(grant.share_bps, MIN_SHARE_BPS) if demand > 0 else 0.0)

    async def run(self) -> None:
        """Renew every epoch while there is demand; sleep until there is (until `stop`)."""
        while not self._stopped:
            try:
                if not self._held and self.demand_bps() <= 0:
                    self._demand.clear()
                    await self._demand.wait()
                await self.renew()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("lease loop of group %s failed; continuing", self.state.group)
            self._demand.clear()
            try:
                await asyncio.wait_for(self._demand.wait(), self.epoch_s)
            except TimeoutError:
                pass

    _stopped = False

    def stop(self) -> None:
        """End the renewal loop (a cancellation inside a NATS request may come back as an error)."""
        self._stopped = True
        self._demand.set()

    async def leave(self) -> None:
        """Deregister the group from the coordinator (its lease goes to the others at once)."""
        try:
            await self.client.leave(self.state.group, self.scheduler)
        except Exception:
            logger.debug("leave of group %s failed", self.state.group, exc_info=True)
