"""Settings of the coordinator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbus.config import from_env
from kvbus.errors import ConfigError


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    """Override any field with ``KVBUS_COORDINATOR_<FIELD>``."""

    capacity_bps: float = 1.25e9
    """Shared capacity for inter-group transfers, bytes/s (default 10 Gbit/s)."""
    epoch_s: float = 0.1
    """Lease epoch: groups renew their share this often."""
    lease_grace_epochs: int = 3
    """A lease not renewed for this many epochs is gone and its share goes to the others."""
    reservable_fraction: float = 0.5
    """Share of the capacity reservations may take (the rest stays for bulk traffic)."""
    group_ttl_s: float = 10.0
    """A group whose scheduler has not been heard from for this long is considered gone."""
    leader_ttl_s: float = 3.0
    """Replicas: the standby takes over when the leader has not renewed for this long."""

    def __post_init__(self) -> None:
        if self.capacity_bps <= 0:
            raise ConfigError("capacity_bps must be positive")
        if not 0.005 <= self.epoch_s <= 10:
            raise ConfigError(f"epoch_s {self.epoch_s} must be within 5 ms .. 10 s")
        if not 0 < self.reservable_fraction <= 1:
            raise ConfigError("reservable_fraction must be in (0, 1]")

    @classmethod
    def from_env(cls, **overrides: Any) -> CoordinatorConfig:
        """The defaults, overridden by ``KVBUS_COORDINATOR_<FIELD>`` variables, then by ``overrides``."""
        return from_env(cls, "coordinator", **overrides)
