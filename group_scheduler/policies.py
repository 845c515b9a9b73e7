"""The registry of scheduling policies by name (``SchedulerConfig.policy``, ``kvbus group-scheduler --policy``)."""

from __future__ import annotations

from collections.abc import Callable

from kvbus.group_scheduler.config import SchedulerConfig
from kvbus.group_scheduler.policy import FifoPolicy, MediumSelector, SchedulingPolicy, StrictPriorityPolicy
from kvbus.group_scheduler.weighted import WeightedPolicy

PolicyFactory = Callable[[SchedulerConfig, MediumSelector], SchedulingPolicy]

POLICIES: dict[str, PolicyFactory] = {}


def register_policy(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    """Register a policy factory under ``name``."""

    def wrap(factory: PolicyFactory) -> PolicyFactory:
        POLICIES[name] = factory
        return factory

    return wrap


@register_policy("wrr")
def _weighted(config: SchedulerConfig, selector: MediumSelector) -> SchedulingPolicy:
    return WeightedPolicy.from_config(config, selector)


@register_policy("fifo")
def _fifo(config: SchedulerConfig, selector: MediumSelector) -> SchedulingPolicy:
    return FifoPolicy(selector, max_active=config.max_active, tick_s=config.tick_s)


@register_policy("strict")
def _strict(config: SchedulerConfig, selector: MediumSelector) -> SchedulingPolicy:
    return StrictPriorityPolicy(selector, max_active=config.max_active, tick_s=config.tick_s)


def make_policy(config: SchedulerConfig, selector: MediumSelector) -> SchedulingPolicy:
    """The policy ``config.policy`` names.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    factory = POLICIES.get(config.policy)
    if factory is None:
        raise ValueError(f"unknown scheduling policy {config.policy!r}; known policies: {', '.join(sorted(POLICIES))}")
    return factory(config, selector)
