"""Bandwidth allocation of the group's transfers: weighted max-min over resources.

The implementation lives in `kvbus.fairness` (one weighted max-min for the whole of kvbus);
this module keeps the names the group scheduler has always exported.
"""

from kvbus.fairness import Flow, weighted_max_min

__all__ = ["Flow", "weighted_max_min"]
