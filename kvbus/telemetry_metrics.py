"""The instruments kvbus records, made once per process (`kvbus.telemetry.instruments`).

Counters are `Tally` objects: an add is a dict update under a lock, and the SDK reads the totals
when a reader collects (an observable counter), so a transfer does not pay the SDK's
per-measurement path for each of them. Histograms are the SDK's own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import metrics


class Tally:
    """A monotonic counter summed in-process per attribute set, reported at collection time."""

    def __init__(self, meter: metrics.Meter, name: str, *, unit: str = "", description: str = "") -> None:
        self._totals: dict[tuple[tuple[str, Any], ...], float] = {}
        self._lock = threading.Lock()
        meter.create_observable_counter(name, callbacks=[self._observe], unit=unit, description=description)

    def add(self, amount: float, attributes: Mapping[str, Any] | None = None) -> None:
        """Add ``amount`` (>= 0) to the total of ``attributes``."""
        key = tuple(attributes.items()) if attributes else ()
        with self._lock:
            self._totals[key] = self._totals.get(key, 0) + amount

    def _observe(self, options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        with self._lock:
            totals = list(self._totals.items())
        return [metrics.Observation(total, dict(key)) for key, total in totals]


class Metrics:
    """The instruments kvbus records (no-ops unless a meter provider is configured)."""

    def __init__(self, meter: metrics.Meter | None = None) -> None:
        m = meter or metrics.get_meter("kvbus")
        self.transfer_latency = m.create_histogram(
            "kvbus.transfer.duration", unit="s", description="Send to verified delivery, by medium"
        )
        self.transfer_bytes = Tally(m, "kvbus.transfer.bytes", unit="By", description="Payload bytes by medium")
        self.transfers = Tally(m, "kvbus.transfers", description="Transfers by medium and outcome")
        self.queue_delay = m.create_histogram("kvbus.queue.delay", unit="s", description="Request to grant, per agent")
        self.preemptions = Tally(m, "kvbus.preemptions", description="Transfers paused for a more urgent one")
        self.reservation_misses = Tally(m, "kvbus.reservation.misses", description="Reserved slots missed")
        self.link_bandwidth = m.create_histogram(
            "kvbus.link.bandwidth", unit="By/s", description="Observed bandwidth per link"
        )
        self.cache_events = Tally(m, "kvbus.cache.events", description="Cache tier hits, misses, prefetch hits")
        self.memory_peak = m.create_histogram("kvbus.agent.memory", unit="By", description="Agent KV bytes (probe)")
        self.retransmits = Tally(m, "kvbus.chunks.retransmitted", description="Chunks sent again")
