"""`WeightedRates.allocate` rebuilds the per-resource load sums in the same pass that collects the
flows: after every reallocation the sums (and the rates) equal a from-scratch recomputation over
the running transfers, whatever sequence of arrivals, grants, pauses and ends led there."""

from __future__ import annotations

from collections.abc import Hashable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbus.fairness import Flow, weighted_max_min
from kvbus.group_scheduler import WeightedPolicy
from kvbus.group_scheduler.rates import MIN_RATE_BPS
from kvbus.group_scheduler.simulate import SIM_SIGNATURE
from kvbus.group_scheduler.state import AgentState, GroupState, Pending
from kvbus.protocol import TransferRequest

MB = 1_000_000

#: One event: (kind, a, b, size index); kind 0 arrival a -> b, 1 end of a running transfer, 2 pause.
EVENTS = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 7), st.integers(0, 7), st.integers(0, 3)), min_size=1, max_size=60
)


def _from_scratch(policy: WeightedPolicy, state: GroupState) -> tuple[dict[Hashable, float], dict[str, float]]:
    load: dict[Hashable, float] = {}
    flows: list[Flow[str]] = []
    caps: dict[Hashable, float] = {}
    for run in policy._runs.values():
        f = run.pending
        if f.paused or f.done:
            continue
        flows.append(Flow(f.transfer_id, run.weight, run.resources))
        for r in run.resources:
            load[r] = load.get(r, 0.0) + run.weight
            cap = policy._capacity(state, r)
            if cap > 0:
                caps[r] = cap
    rates = {k: v if v <= 0 else max(v, MIN_RATE_BPS) for k, v in weighted_max_min(flows, caps).items()}
    return load, rates


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=EVENTS, budget=st.sampled_from([0, 20 * MB, 200 * MB]), critical=st.booleans())
def test_allocate_loads_and_rates_equal_a_from_scratch_recomputation(
    events: list[tuple[int, int, int, int]], budget: int, critical: bool
) -> None:
    state = GroupState("g", bandwidth_bps=budget)
    for i in range(8):
        state.agents[f"a{i}"] = AgentState(f"a{i}", role_priority=(0.5, 1.0, 2.0)[i % 3], last_seen=1e18)
        state.declare(f"a{i}", (10 * MB, 25 * MB, 100 * MB)[i % 3], 0.0)
    policy = WeightedPolicy(None, max_active=4)
    sig = SIM_SIGNATURE.to_dict()
    now = 0.0
    for k, (kind, a, b, size) in enumerate(events):
        now += 0.011
        if kind == 0 and a != b:
            req = TransferRequest(
                transfer_id=f"t{k}",
                src=f"a{a}",
                dst=[f"a{b}"],
                group="g",
                n_tokens=16,
                nbytes=(64_000, MB, 4 * MB, 16 * MB)[size],
                signature=sig,
                critical=critical and size == 0,
            )
            p = Pending(req, {f"a{b}": SIM_SIGNATURE}, arrived=now)
            state.queue.append(p)
            policy.queued(state, p)
        elif kind == 1 and state.active:
            p = state.active.pop(sorted(state.active)[a % len(state.active)])
            p.done = True
            policy.released(p)
        elif kind == 2 and state.active:
            p = state.active[sorted(state.active)[a % len(state.active)]]
            if not p.paused:  # a pause declined by its sender comes back through `changed`
                p.paused = not p.paused
                policy.changed()
        for d in policy.decide(state, now):
            state.queue.remove(d.pending)
            if not d.refused:
                d.pending.granted_at, d.pending.rate_bps = now, d.rate_bps
                state.active[d.pending.transfer_id] = d.pending
                policy.started(state, d.pending)
        before = policy.reallocations
        policy.adjust(state, now)
        if policy.reallocations != before:
            load, rates = _from_scratch(policy, state)
            assert {r: v for r, v in policy._load.items() if v != 0.0} == {r: v for r, v in load.items() if v != 0.0}
            for tid, rate in rates.items():
                assert (
                    policy._runs[tid].pending.rate_bps == rate
                    or abs(policy._runs[tid].pending.rate_bps - rate)
                    <= policy.rate_epsilon * policy._runs[tid].pending.rate_bps
                )
            for run in policy._runs.values():
                assert run.loaded == (not run.pending.paused and not run.pending.done and run.weight > 0)
