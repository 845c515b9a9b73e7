"""The weighted policy's incremental rates (`kvbus.fairness.IncrementalMaxMin` behind `adjust`):
after any sequence of arrivals, ends, pauses, declined pauses, changed link declarations, budget
changes and deadline transfers (whose weight grows every slice), every running transfer runs
within ``rate_epsilon`` of the from-scratch weighted max-min; and a slice recomputes the
transfers an event touched, not the whole group."""

from __future__ import annotations

from collections.abc import Hashable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbus.app.bench.sched_cost import decision_cost
from kvbus.fairness import Flow, weighted_max_min
from kvbus.group_scheduler import WeightedPolicy
from kvbus.group_scheduler.policy import Decision
from kvbus.group_scheduler.rates import MIN_RATE_BPS
from kvbus.group_scheduler.simulate import SIM_SIGNATURE, FixedSelector
from kvbus.group_scheduler.state import AgentState, GroupState, Pending
from kvbus.protocol import TransferRequest

MB = 1_000_000
CAPS = (10 * MB, 25 * MB, 100 * MB, 0)

#: (kind, a, b, size index): 0-1 arrival a -> b, 2 end, 3 pause by hand, 4 declined pause,
#: 5 agent a declares CAPS[b % 4], 6 the budget becomes a choice by b.
EVENTS = st.lists(
    st.tuples(st.integers(0, 6), st.integers(0, 7), st.integers(0, 7), st.integers(0, 3)), min_size=1, max_size=70
)


def _reference(policy: WeightedPolicy, state: GroupState) -> dict[str, float]:
    flows: list[Flow[str]] = []
    caps: dict[Hashable, float] = {}
    for run in policy._runs.values():
        f = run.pending
        if f.paused or f.done:
            continue
        flows.append(Flow(f.transfer_id, run.weight, run.resources))
        for r in run.resources:
            cap = policy._capacity(state, r)
            if cap > 0:
                caps[r] = cap
    return {k: v if v <= 0 else max(v, MIN_RATE_BPS) for k, v in weighted_max_min(flows, caps).items()}


def _apply(policy: WeightedPolicy, state: GroupState, decisions: list[Decision], now: float) -> None:
    for d in decisions:
        state.queue.remove(d.pending)
        if not d.refused:
            d.pending.granted_at, d.pending.rate_bps = now, d.rate_bps
            state.active[d.pending.transfer_id] = d.pending
            policy.started(state, d.pending)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=EVENTS, budget=st.sampled_from([0, 20 * MB, 200 * MB]), deadlines=st.booleans())
def test_rates_stay_within_epsilon_of_a_from_scratch_max_min(
    events: list[tuple[int, int, int, int]], budget: int, deadlines: bool
) -> None:
    state = GroupState("g", bandwidth_bps=budget)
    for i in range(8):
        state.agents[f"a{i}"] = AgentState(f"a{i}", role_priority=(0.5, 1.0, 2.0)[i % 3], last_seen=1e18)
        state.declare(f"a{i}", CAPS[i % 3], 0.0)
    policy = WeightedPolicy(None, max_active=5, per_pair=2)
    sig = SIM_SIGNATURE.to_dict()
    now = 0.0
    checked = 0
    for k, (kind, a, b, size) in enumerate(events):
        now += 0.011
        live = sorted(state.active)
        if kind <= 1 and a != b:
            req = TransferRequest(
                transfer_id=f"t{k}",
                src=f"a{a}",
                dst=[f"a{b}"] if size != 3 else [f"a{b}", f"a{(b + 1) % 8}"],
                group="g",
                n_tokens=16,
                nbytes=(64_000, MB, 4 * MB, 16 * MB)[size],
                signature=sig,
                critical=size == 0 and kind == 1,
            )
            deadline = now + 0.05 * (1 + b) if deadlines and size == 1 else None
            p = Pending(req, {rx: SIM_SIGNATURE for rx in req.dst}, arrived=now, deadline_at=deadline)
            state.queue.append(p)
            policy.queued(state, p)
        elif kind == 2 and live:
            p = state.active.pop(live[a % len(live)])
            p.done = True
            policy.released(p)
        elif kind == 3 and live:
            p = state.active[live[a % len(live)]]
            if not p.paused:
                p.paused = True
                policy.changed()
        elif kind == 4 and live:
            p = state.active[live[a % len(live)]]
            if p.paused:  # the sender declined the pause: it runs again
                p.paused = False
                policy.changed()
        elif kind == 5:
            state.declare(f"a{a}", CAPS[b % 4], 0.0)
        elif kind == 6:
            state.bandwidth_bps = (0, 20 * MB, 200 * MB, 35 * MB)[b % 4]
        _apply(policy, state, policy.decide(state, now), now)
        before = policy.reallocations
        policy.adjust(state, now)
        if policy.reallocations == before:
            continue
        checked += 1
        ref = _reference(policy, state)
        for tid, rate in ref.items():
            got = policy._runs[tid].pending.rate_bps
            assert got == rate or abs(got - rate) <= policy.rate_epsilon * got * (1 + 1e-9), (tid, got, rate)


def test_a_slice_recomputes_what_changed_not_the_group() -> None:
    """The bench's groups (n/2 running, one end and one arrival per step): the max-min
    recomputes a handful of transfers per slice, as many at 1024 agents as at 64."""
    counts = {n: decision_cost(n, 400, FixedSelector(), seed=3)["recomputed_per_slice"] for n in (64, 1024)}
    assert counts[1024] <= 2 * counts[64] + 2, counts
    assert counts[1024] < 16, counts
