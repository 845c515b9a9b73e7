"""The coordinator: group membership (and, next, arbitration between groups)."""

from kvbus.coordinator.coordinator import Coordinator

__all__ = ["Coordinator"]
