"""The baselines of `kvbus bench sched` (issue 33 item 4): strict priority and the usual FIFO.
Deterministic: the policies on a hand-driven state, no servers, no wall-clock timing."""

from __future__ import annotations

from kvbus.app.bench.sched import ARMS, BASELINES, FIFO_PASSES, arm_config
from kvbus.group_scheduler import GroupState, Pending, SchedulerConfig, StrictPriorityPolicy, make_policy
from kvbus.group_scheduler.policy import SchedulingPolicy
from kvbus.group_scheduler.simulate import SIM_SIGNATURE, FixedSelector
from kvbus.protocol import ControlAction, TransferRequest

MB = 1_000_000


def _pending(tid: str, src: str, *, critical: bool = False, nbytes: int = 8 * MB) -> Pending:
    req = TransferRequest(
        transfer_id=tid,
        src=src,
        dst=["rx"],
        group="g",
        n_tokens=1,
        nbytes=nbytes,
        signature=SIM_SIGNATURE.to_dict(),
        critical=critical,
    )
    return Pending(req, {"rx": SIM_SIGNATURE}, arrived=0.0)


def _pass(policy: SchedulingPolicy, state: GroupState, *arrivals: Pending) -> list[str]:
    """Queue ``arrivals``, run one pass as the grant loop does; the granted transfer ids."""
    for p in arrivals:
        state.queue.append(p)
        policy.queued(state, p)
    granted = []
    for d in policy.decide(state, 0.0):
        state.queue.remove(d.pending)
        if not d.refused:
            d.pending.rate_bps = d.rate_bps
            state.active[d.pending.transfer_id] = d.pending
            policy.started(state, d.pending)
            granted.append(d.pending.transfer_id)
    return granted


def test_strict_priority_grants_critical_first_and_throttles_bulk_at_once() -> None:
    policy = StrictPriorityPolicy(FixedSelector(), max_active=2, tick_s=1.0)
    state = GroupState("g", bandwidth_bps=100 * MB)
    assert _pass(policy, state, _pending("b0", "s0"), _pending("b1", "s1"), _pending("b2", "s2")) == ["b0", "b1"]
    # b0 was granted the whole budget before b1 came: evened out in the same pass.
    assert [(a.pending.transfer_id, a.rate_bps) for a in policy.adjust(state, 0.0)] == [("b0", 50 * MB)]
    assert state.active["b0"].rate_bps == 50 * MB
    # A critical request behind a queued bulk one: granted first, past max_active, at the whole budget.
    assert _pass(policy, state, _pending("c0", "c", critical=True, nbytes=64 * 1024)) == ["c0"]
    assert state.active["c0"].rate_bps == 100 * MB
    adj = policy.adjust(state, 0.0)  # the same pass: no time slice waited for
    assert {(a.pending.transfer_id, a.action) for a in adj} == {("b0", ControlAction.RATE), ("b1", ControlAction.RATE)}
    assert all(a.rate_bps == 0.5 * MB for a in adj)  # bulk keeps the 1 % floor between them
    # The critical transfer ends: the bulk gets the budget back at once; the queued bulk still waits.
    del state.active["c0"]
    policy.released(state.queue[0])
    assert {a.rate_bps for a in policy.adjust(state, 0.0)} == {50 * MB}
    assert _pass(policy, state) == []


def test_strict_by_name_and_the_bench_arms() -> None:
    assert isinstance(make_policy(SchedulerConfig(policy="strict"), FixedSelector()), StrictPriorityPolicy)
    assert ARMS[0] == "wrr" and set(BASELINES) == {"fifo", "fifo1", "strict", "unscheduled"}
    fifo1, declared = arm_config("fifo1", 40 * MB)
    assert fifo1["policy"] == "fifo" and fifo1["max_active"] == 1 and declared > 0
    SchedulerConfig(**fifo1)
    SchedulerConfig(**arm_config("strict", 40 * MB)[0])
    assert FIFO_PASSES  # max_active 8 holds the 4 bulk and 2 critical senders at once


def test_the_usual_fifo_makes_critical_wait_behind_bulk() -> None:
    policy = make_policy(SchedulerConfig(**arm_config("fifo1", 40 * MB)[0]), FixedSelector())
    state = GroupState("g", bandwidth_bps=40 * MB)
    assert _pass(policy, state, _pending("b0", "s0")) == ["b0"]
    assert _pass(policy, state, _pending("c0", "c", critical=True)) == []
