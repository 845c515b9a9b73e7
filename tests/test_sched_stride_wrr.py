"""`StrideWRR`, the weighted policy's default round robin (a heap by virtual time, O(log n) per
pick): picks in proportion to the weights among the ready slots, whatever the readiness changes;
a slot that was not ready saves no turns; and the policy's grants under it are as fair as under
smooth WRR when the grant order decides the shares (fewer slots than pairs)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbus.group_scheduler import SmoothWRR, StrideWRR, WeightedPolicy
from kvbus.group_scheduler.simulate import FixedSelector, Simulation
from kvbus.group_scheduler.wrr import PairPicker

MB = 1_000_000


def _serve(picker: StrideWRR, weights: dict[int, float], picks: int) -> list[int]:
    out = []
    for _ in range(picks):
        slot = picker.pick_ready()
        assert slot is not None
        picker.served(slot, weights[slot])
        out.append(slot)
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(weights=st.lists(st.floats(0.5, 60.0), min_size=1, max_size=12))
def test_picks_are_in_proportion_to_the_weights(weights: list[float]) -> None:
    picker = StrideWRR()
    w = dict(enumerate(weights))
    for slot in w:
        picker.reset(slot)
        picker.ready(slot)
    picks = _serve(picker, w, 200 * len(w))
    counts = Counter(picks)
    total = sum(weights)
    for slot, ws in w.items():
        # Stride scheduling's lag bound: each slot's pass is within one stride of the virtual
        # time V, so its count is within one turn of V * w; the exact share N * w / W is within
        # k * w / W of V * w (k slots).
        bound = 1 + len(w) * ws / total + 1e-9 * len(picks)
        assert abs(counts[slot] - len(picks) * ws / total) <= bound, (slot, counts, w)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 2)), min_size=1, max_size=200))
def test_only_ready_slots_are_picked_and_the_heap_matches_a_scan(events: list[tuple[int, int]]) -> None:
    """Against a scan of every slot: the pick is the ready slot with the smallest pass (oldest on a tie)."""
    picker = StrideWRR()
    weights = {s: 1.0 + s for s in range(8)}
    ready: dict[int, int] = {}
    seq = 0
    for slot, kind in events:
        if kind == 0:
            if slot not in ready:
                seq += 1
                ready[slot] = seq
            picker.ready(slot)
        elif kind == 1:
            ready.pop(slot, None)
            picker.unready(slot)
        got = picker.pick_ready()
        if not ready:
            assert got is None
            continue
        passes = {s: max(picker._pass.get(s, picker.vtime), picker.vtime) for s in ready}
        low = min(passes.values())
        assert got in ready and math.isclose(passes[got], low, rel_tol=0, abs_tol=1e-12)
        if kind == 2:
            assert got is not None
            picker.served(got, weights[got])
            del ready[got]
            picker.unready(got)


def test_a_slot_that_was_not_ready_saves_no_turns() -> None:
    picker = StrideWRR()
    w = {0: 1.0, 1: 1.0}
    for s in w:
        picker.reset(s)
    picker.ready(0)
    _serve(picker, w, 50)  # slot 1 sits out 50 turns
    picker.ready(1)
    picks = _serve(picker, w, 10)
    assert Counter(picks) == {0: 5, 1: 5}  # it takes turns from now on, no burst of 50


def test_a_non_finite_weight_counts_as_the_heaviest_finite_one() -> None:
    picker = StrideWRR()
    w = {0: 2.0, 1: math.inf, 2: math.nan}
    for s in w:
        picker.reset(s)
        picker.ready(s)
    counts = Counter(_serve(picker, w, 600))
    assert counts[0] == counts[1] == counts[2] == 200


def test_the_array_form_agrees_with_the_index() -> None:
    picker: PairPicker = StrideWRR()
    w = np.array([1.0, 3.0, 2.0])
    e = np.array([True, True, False])
    counts = Counter(picker.pick(w, e) for _ in range(400))
    assert counts == {1: 300, 0: 100}


def _jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def _shares(picker: PairPicker, seed: int, *, max_active: int, one_receiver: bool) -> list[float]:
    """Senders of role priorities 0/1/2/4 keep transfers queued (to one receiver with a 30 MB/s
    link, or each to its own under a 40 MB/s budget); throughput per weight W over a window."""
    budget = 0 if one_receiver else 40 * MB
    sim = Simulation(WeightedPolicy(FixedSelector(), picker=picker, max_active=max_active), bandwidth_bps=budget)
    prios = [0.0, 1.0, 2.0, 4.0] * (1 if one_receiver else 2)
    if one_receiver:
        sim.agent("rx", priority=0.0, link_bps=30 * MB)
    for i, p in enumerate(prios):
        sim.agent(f"s{i}", priority=p)
        rx = "rx" if one_receiver else f"r{i}"
        if not one_receiver:
            sim.agent(rx, priority=0.0)
        sim.backlog(f"s{i}", rx, (2 if one_receiver else 1) * MB + seed * 100_000, depth=2)
    sim.run(1.0)
    sim.reset_counters()
    sim.run(21.0)
    got = {src: b for (src, _), b in sim.pair_bytes.items()}
    return [got.get(f"s{i}", 0.0) / (p + 2.0) for i, p in enumerate(prios)]


def test_jain_fairness_with_priorities_0_1_2_4() -> None:
    """The bench's fairness arm in process: four senders to one receiver, the defaults."""
    for seed in range(3):
        assert _jain(_shares(StrideWRR(), seed, max_active=8, one_receiver=True)) >= 0.95


def test_grant_order_is_as_fair_as_smooth_wrr_where_it_sets_the_shares() -> None:
    """Eight senders, two slots: who sends is the round robin's (and aging's) choice."""
    for seed in range(3):
        stride = _jain(_shares(StrideWRR(), seed, max_active=2, one_receiver=False))
        smooth = _jain(_shares(SmoothWRR(), seed, max_active=2, one_receiver=False))
        assert stride >= 0.95 and stride >= smooth - 0.03, (seed, stride, smooth)
