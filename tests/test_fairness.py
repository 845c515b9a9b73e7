"""The one weighted max-min (`kvbus.fairness`): the coordinator's split through the resource
allocation equals the water-filling it replaced, and the old public names still answer."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kvbus.fairness as fairness
from kvbus.coordinator import weighted_max_min as coordinator_split
from kvbus.fairness import Flow, fair_shares, weighted_max_min
from kvbus.group_scheduler import Flow as SchedulerFlow
from kvbus.group_scheduler import weighted_max_min as scheduler_max_min

CI = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def water_filling(
    capacity: float, demands: Mapping[str, float], weights: Mapping[str, float] | None = None
) -> dict[str, float]:
    """The coordinator's own split before there was one weighted max-min (kept here as the oracle)."""
    w = {k: float((weights or {}).get(k, 1.0)) for k in demands}
    shares = {k: 0.0 for k in demands}
    active = {k for k, d in demands.items() if d > 0}
    left = float(capacity)
    while active and left > 1e-12:
        total_w = sum(w[k] for k in active)
        step = min((demands[k] - shares[k]) / w[k] for k in active)
        if step * total_w >= left:
            for k in active:
                shares[k] += left * w[k] / total_w
            left = 0.0
            break
        for k in active:
            shares[k] += step * w[k]
        left -= step * total_w
        active = {k for k in active if demands[k] - shares[k] > 1e-9}
    return shares


def test_the_old_names_are_the_one_implementation() -> None:
    assert scheduler_max_min is weighted_max_min and SchedulerFlow is Flow
    assert coordinator_split(10, {"a": 2, "b": 8}) == fair_shares(10, {"a": 2, "b": 8})
    # Ground floor: pure arithmetic that imports no part of kvbus.
    tree = ast.parse(Path(fairness.__file__).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.split(".")[0] == "kvbus"]


@CI
@given(
    cap=st.floats(0, 1e6),
    demands=st.dictionaries(st.sampled_from("abcdefgh"), st.one_of(st.just(0.0), st.floats(0, 1e6)), min_size=1),
    weights=st.dictionaries(st.sampled_from("abcdefgh"), st.floats(0.01, 100)),
)
@example(cap=10.0, demands={"a": 2.0, "b": 8.0, "c": 8.0}, weights={"c": 2.0})
@example(cap=0.0, demands={"a": 2.0}, weights={})
@example(cap=5.0, demands={"a": 0.0, "b": 0.0}, weights={})
@example(cap=1e6, demands={"a": 1.0, "b": 2.0}, weights={"a": 0.01, "b": 100.0})
def test_the_coordinator_split_equals_water_filling(
    cap: float, demands: dict[str, float], weights: dict[str, float]
) -> None:
    new = coordinator_split(cap, demands, weights)
    old = water_filling(cap, demands, weights)
    assert new.keys() == old.keys()
    for k in old:
        assert new[k] == pytest.approx(old[k], rel=1e-9, abs=1e-6)


def test_the_split_refuses_what_it_always_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        fair_shares(-1, {"a": 1})
    with pytest.raises(ValueError, match="weight"):
        fair_shares(1, {"a": 1}, {"a": 0})
    with pytest.raises(ValueError, match="demand"):
        fair_shares(1, {"a": -1})


def test_resource_allocation_is_the_one_the_scheduler_used() -> None:
    flows = [Flow(0, 1.0, ("link", "out0")), Flow(1, 1.0, ("link",)), Flow(2, 3.0, ("link",))]
    assert weighted_max_min(flows, {"link": 90.0, "out0": 10.0}) == pytest.approx({0: 10.0, 1: 20.0, 2: 60.0})
