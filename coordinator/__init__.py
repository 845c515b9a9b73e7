"""The coordinator: membership, inter-group leases, reservations, placement, durable state."""

from kvbus.coordinator.arbiter import weighted_max_min
from kvbus.coordinator.config import CoordinatorConfig
from kvbus.coordinator.coordinator import Coordinator
from kvbus.net.coordinator_client import CoordinatorClient
from kvbus.net.leader import LeaderLease

__all__ = ["Coordinator", "CoordinatorClient", "CoordinatorConfig", "LeaderLease", "weighted_max_min"]
