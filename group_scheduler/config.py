"""Settings of a group scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from kvbus.config import from_env
from kvbus.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Override any field with ``KVBUS_SCHEDULER_<FIELD>``."""

    bandwidth_bps: float = 0.0
    """The group's bandwidth budget in bytes/s (0 = unlimited)."""
    max_active: int = 4
    """Transfers running at once in the group."""
    tick_s: float = 0.010
    """Time slice of the scheduling loop; the loop sleeps when nothing changes."""
    transfer_timeout: float = 300.0
    """A granted transfer that reports nothing for this long is dropped from the active set."""
    heartbeat_s: float = 2.0
    """Seconds between announcements to the coordinator."""
    directory_ttl: float = 2.0
    """Seconds a directory lookup is cached."""
    selector: str = "adaptive"
    """How media are chosen: ``adaptive`` (the cost model) or ``static`` (requested, else full/tokens)."""
    hysteresis: float = 0.15
    """A pair switches medium only if the new one is predicted at least this much faster."""
    default_bandwidth_bps: float = 1e9
    """Bandwidth assumed for a pair with no observation and no declared capacity."""

    def __post_init__(self) -> None:
        if not 0.001 <= self.tick_s <= 1.0:
            raise ConfigError(f"tick_s {self.tick_s} must be within 1 ms .. 1 s")
        if self.max_active < 1:
            raise ConfigError("max_active must be at least 1")
        if self.selector not in ("adaptive", "static"):
            raise ConfigError(f"selector {self.selector!r} must be 'adaptive' or 'static'")
        if not 0 <= self.hysteresis < 1:
            raise ConfigError(f"hysteresis {self.hysteresis} must be in [0, 1)")

    @classmethod
    def from_env(cls, **overrides: object) -> SchedulerConfig:
        return from_env(cls, "scheduler", **overrides)
