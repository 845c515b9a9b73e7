"""The coordinator: membership, inter-group leases, reservations, placement, durable state."""

from kvbus.coordinator.arbiter import weighted_max_min
from kvbus.coordinator.client import CoordinatorClient
from kvbus.coordinator.config import CoordinatorConfig
from kvbus.coordinator.coordinator import Coordinator
from kvbus.coordinator.leader import LeaderLease

__all__ = ["Coordinator", "CoordinatorClient", "CoordinatorConfig", "LeaderLease", "weighted_max_min"]
