"""The group scheduler: state S(t), the scheduling loop and its policies."""

from kvbus.fairness import Flow, weighted_max_min
from kvbus.group_scheduler.config import SchedulerConfig
from kvbus.group_scheduler.policies import POLICIES, make_policy, register_policy
from kvbus.group_scheduler.policy import (
    Adjustment,
    Decision,
    FifoPolicy,
    MediumSelector,
    SchedulingPolicy,
    Selection,
    StaticSelector,
    StrictPriorityPolicy,
)
from kvbus.group_scheduler.preemption import NoPreemption, PreemptionStrategy, ThresholdPreemption
from kvbus.group_scheduler.reservations import (
    Admission,
    AdmissionControl,
    CoordinatorAdmission,
    LocalAdmission,
    Reservation,
    ReservationTable,
)
from kvbus.group_scheduler.scheduler import GroupScheduler
from kvbus.group_scheduler.state import AgentState, GroupState, LinkEstimate, Pending
from kvbus.group_scheduler.weighted import WeightedPolicy
from kvbus.group_scheduler.weights import UrgencyModel
from kvbus.group_scheduler.wrr import PairPicker, SmoothWRR, StrideWRR

__all__ = [
    "POLICIES",
    "Adjustment",
    "Admission",
    "AdmissionControl",
    "AgentState",
    "CoordinatorAdmission",
    "Decision",
    "FifoPolicy",
    "Flow",
    "GroupScheduler",
    "GroupState",
    "LinkEstimate",
    "LocalAdmission",
    "MediumSelector",
    "NoPreemption",
    "PairPicker",
    "Pending",
    "PreemptionStrategy",
    "Reservation",
    "ReservationTable",
    "SchedulerConfig",
    "SchedulingPolicy",
    "Selection",
    "SmoothWRR",
    "StrideWRR",
    "StaticSelector",
    "StrictPriorityPolicy",
    "ThresholdPreemption",
    "UrgencyModel",
    "WeightedPolicy",
    "make_policy",
    "register_policy",
    "weighted_max_min",
]
