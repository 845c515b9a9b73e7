"""Rate budgets are kept inside the group budget (issue 33 item 2): the max-min shares out the
budget less what the budgets' transfers used lately (`kvbus.group_scheduler.rates.LeaseUse`),
so the bulk leaves room for the small critical messages that start without a request. On the
testbed the bulk took the whole budget (0.94 of the link, 0.98 with the headers) and the
budgets' messages came on top: the link ran at 100 % and a 64 KB critical message queued behind
the ones before it. Deterministic: the weighted policy on a hand-driven state."""

from __future__ import annotations

from kvbus.group_scheduler import GroupState, WeightedPolicy
from kvbus.group_scheduler.rates import LEASE_HEADROOM, LEASE_MAX_SHARE, LEASE_WINDOW_S, LeaseUse
from kvbus.group_scheduler.simulate import FixedSelector
from kvbus.group_scheduler.state import AgentState
from tests.test_sched_at_once import Driver
from tests.test_sched_baselines import MB, _pending

TICK = 0.010
BUDGET = 40 * MB


def _group() -> tuple[Driver, GroupState]:
    state = GroupState("g", bandwidth_bps=BUDGET)
    for name in ("rx", "c", "b0", "b1"):
        state.agents[name] = AgentState(name, last_seen=1e18)
    state.declare("rx", BUDGET, 0.0)
    return Driver(WeightedPolicy(FixedSelector(), tick_s=TICK), state), state


def _bulk_rates(state: GroupState) -> float:
    return sum(p.rate_bps for t, p in state.active.items() if t.startswith("bulk"))


def test_a_rate_budget_holds_twice_what_its_transfers_used_out_of_the_bulk_share() -> None:
    drv, state = _group()
    drv.arrive(_pending("bulk0", "b0"), 0.0)
    drv.arrive(_pending("bulk1", "b1"), 0.0)
    drv.pass_(TICK)
    assert abs(_bulk_rates(state) - BUDGET) < 0.001 * BUDGET
    # A critical message granted with a rate budget, done; the budget goes on.
    drv.arrive(_pending("crit", "c", critical=True, nbytes=64 * 1024), 2 * TICK)
    crit = state.active["crit"]
    crit.done = True
    drv.policy.budget_only(crit)
    drv.policy.leased(crit, 64 * 1024, 2 * TICK)
    for i in range(1, 31):  # 30 more under the budget over 0.3 s: 2 MB/s in the window
        drv.policy.leased(crit, 64 * 1024, 2 * TICK + 0.01 * i)
    drv.pass_(0.4)
    used = 31 * 64 * 1024 / LEASE_WINDOW_S
    assert abs(_bulk_rates(state) - (BUDGET - LEASE_HEADROOM * used)) < 0.001 * BUDGET
    # A new bulk grant's share leaves the room too.
    drv.done("bulk1", 0.41)
    drv.arrive(_pending("bulk2", "b1"), 0.42)
    assert _bulk_rates(state) <= BUDGET - LEASE_HEADROOM * used + 0.001 * BUDGET
    # Once the window has passed with nothing more under the budget, the bulk has it all back.
    drv.pass_(2 * TICK + 0.3 + LEASE_WINDOW_S + 0.1)
    assert abs(_bulk_rates(state) - BUDGET) < 0.001 * BUDGET


def test_rate_budgets_never_hold_more_than_their_cap_of_the_budget() -> None:
    drv, state = _group()
    drv.arrive(_pending("bulk0", "b0"), 0.0)
    drv.pass_(TICK)
    drv.policy.leased(state.active["bulk0"], 100 * BUDGET, 2 * TICK)  # a report far above the budget
    drv.pass_(3 * TICK)
    assert abs(_bulk_rates(state) - (1 - LEASE_MAX_SHARE) * BUDGET) < 0.001 * BUDGET


def test_lease_use_is_the_bytes_of_the_last_window() -> None:
    use = LeaseUse(1.0)
    assert not use and use.rate(0.0) == 0.0
    use.add(0.0, 1000)
    use.add(0.5, 3000)
    assert use.rate(0.9) == 4000.0
    assert use.rate(1.2) == 3000.0  # the first fell out of the window
    assert use.rate(2.0) == 0.0 and not use
