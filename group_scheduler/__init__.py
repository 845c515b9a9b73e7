"""The group scheduler: state S(t), the scheduling loop and its policies."""

from kvbus.group_scheduler.config import SchedulerConfig
from kvbus.group_scheduler.policy import Decision, FifoPolicy, MediumSelector, SchedulingPolicy, StaticSelector
from kvbus.group_scheduler.scheduler import GroupScheduler
from kvbus.group_scheduler.state import AgentState, GroupState, LinkEstimate, Pending

__all__ = [
    "AgentState", "Decision", "FifoPolicy", "GroupScheduler", "GroupState", "LinkEstimate", "MediumSelector",
    "Pending", "SchedulerConfig", "SchedulingPolicy", "StaticSelector",
]
