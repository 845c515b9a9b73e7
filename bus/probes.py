"""What an agent reports about itself to its group scheduler: queue, memory, compute load, link.

A `Probe` goes out every ``probe_interval``; a scheduler that hears none for a while marks the
agent down. With a cache tier, its resident bytes are the agent's memory use and its events
are counted as metrics (`kvbus.telemetry.CacheMetrics`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from kvbus import telemetry
from kvbus.bus.endpoint import Endpoint
from kvbus.bus.pacing import EmulatedLink
from kvbus.protocol import Probe, sched_subject

logger = logging.getLogger(__name__)


class Probes:
    """Builds and publishes one agent's probes; ``queue_size`` counts its pending transfers."""

    def __init__(self, endpoint: Endpoint, queue_size: Callable[[], int]) -> None:
        self._ep = endpoint
        self._queue_size = queue_size
        self._cache_bytes = 0
        self._cpu = (time.process_time(), time.monotonic())
        self._cache_metrics = _count_cache_events(endpoint)

    @property
    def cache_bytes(self) -> int:
        """KV bytes the agent holds: its cache tier's resident bytes, or what the owner set."""
        if self._ep.cache is not None:
            return self._ep.cache.memory_bytes
        return self._cache_bytes

    @cache_bytes.setter
    def cache_bytes(self, value: int) -> None:
        self._cache_bytes = int(value)

    def compute_load(self) -> float:
        """This process's CPU use since the last call, as a fraction of the machine's cores."""
        cpu, wall = time.process_time(), time.monotonic()
        last_cpu, last_wall = self._cpu
        self._cpu = (cpu, wall)
        if wall <= last_wall:
            return 0.0
        return min(1.0, (cpu - last_cpu) / (wall - last_wall) / (os.cpu_count() or 1))

    def probe(self) -> Probe:
        """The agent's state now (this also counts the cache tier's hits since the last probe)."""
        ep = self._ep
        link = ep.link or EmulatedLink()
        if self._cache_metrics is not None and ep.cache is not None:
            self._cache_metrics.observe(ep.cache.stats)
        return Probe(
            agent=ep.name,
            group=ep.group,
            queue_size=self._queue_size(),
            cache_bytes=self.cache_bytes,
            compute_load=self.compute_load(),
            role_priority=ep.priority,
            role=ep.role,
            link_bps=link.bandwidth_bps,
            latency_s=link.latency_s,
            prefill_tps=ep.prefill.tokens_per_s,
            prefill_tokens=ep.prefill.tokens,
            prefill_held=ep.prefill.held,
        )

    async def publish(self) -> None:
        """Send one probe to the group scheduler now."""
        await self._ep.transport.publish(sched_subject(self._ep.group, "probe", self._ep.name), self.probe().encode())

    async def loop(self) -> None:
        """Publish a probe every ``probe_interval`` (runs until cancelled, through reconnects)."""
        while True:
            try:
                await self.publish()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.debug("probe publish failed", exc_info=True)
            await asyncio.sleep(self._ep.config.probe_interval)


def _count_cache_events(endpoint: Endpoint) -> telemetry.CacheMetrics | None:
    """Hook metrics into the agent's cache tier: its listener is wrapped by a `CacheMetrics` that
    counts every event and passes it on. None without a tier, or when its events are counted already."""
    cache = endpoint.cache
    if cache is None or isinstance(cache.listener, telemetry.CacheMetrics):
        return None
    metrics = telemetry.CacheMetrics(endpoint.name, inner=cache.listener)
    cache.listener = metrics
    return metrics
