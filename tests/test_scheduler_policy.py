"""The weighted policy's parts on a simulated clock: smooth WRR, max-min rates, shares under
saturation, the starvation bound, preemption, reservations and their admission. Deterministic:
no servers, no wall-clock timing."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvbus.errors import ConfigError, KVBusError, WireFormatError
from kvbus.group_scheduler import (
    FifoPolicy,
    Flow,
    GroupState,
    LocalAdmission,
    Pending,
    Reservation,
    ReservationTable,
    SchedulerConfig,
    UrgencyModel,
    WeightedPolicy,
    make_policy,
    weighted_max_min,
)
from kvbus.group_scheduler.pairs import PairQueues
from kvbus.group_scheduler.policy import Decision, Selection
from kvbus.group_scheduler.simulate import SIM_SIGNATURE, FixedSelector, Simulation
from kvbus.group_scheduler.weights import MAX_URGENCY
from kvbus.group_scheduler.wrr import MAX_WEIGHT, SmoothWRR, smooth_wrr_order
from kvbus.protocol import (
    PATH_NAMES,
    Control,
    ControlAction,
    ControlReply,
    FlowReservation,
    PathName,
    Probe,
    Reason,
    TransferRequest,
    decode_message,
)

CI = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MB = 1_000_000


# -- smooth weighted round robin -------------------------------------------------------------------


def test_smooth_wrr_picks_in_proportion_and_interleaves() -> None:
    weights = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.5}
    picks = smooth_wrr_order(weights, 10_500)
    counts = Counter(picks)
    total = sum(weights.values())
    for k, w in weights.items():
        assert abs(counts[k] / len(picks) - w / total) <= 0.05 * w / total
    # Smooth: the heaviest key's turns are spread out, never a long burst.
    longest = max(sum(1 for _ in g) for _, g in itertools.groupby(picks))
    assert longest <= math.ceil(weights["d"] / (total - weights["d"])) + 1
    # nginx's classic example: weights 5, 1, 1 give a a b a c a a, not a a a a a b c.
    assert "".join(smooth_wrr_order({"a": 5, "b": 1, "c": 1}, 7)) == "aabacaa"


#: Weights the round robin may be handed by a bug: infinities, NaN, beyond-range and non-positive values.
BAD_WEIGHTS = [math.inf, -math.inf, math.nan, 1e300, 0.0, -3.0]


def _picks(weights: list[float], eligible: list[bool], n: int) -> list[int]:
    picker = SmoothWRR()
    w, e = np.array(weights, dtype=float), np.array(eligible, dtype=bool)
    counts = [0] * len(weights)
    for _ in range(n):
        counts[picker.pick(w, e)] += 1
    return counts


def _counted(weights: list[float], eligible: list[bool]) -> list[float]:
    """What each slot should count with: 0 if not eligible, a finite weight clamped into
    0..MAX_WEIGHT, a non-finite one as the largest finite eligible weight (1.0 if that is 0 or none)."""
    clamped = [min(max(w, 0.0), MAX_WEIGHT) if math.isfinite(w) else math.nan for w in weights]
    top = max((w for w, e in zip(clamped, eligible) if e and math.isfinite(w)), default=0.0) or 1.0
    return [0.0 if not e else (w if math.isfinite(w) else top) for w, e in zip(clamped, eligible)]


def _assert_in_proportion(counts: list[int], counted: list[float]) -> None:
    n, total = sum(counts), sum(counted)
    if total == 0:  # only zero weights: any eligible slot may be served
        return
    for c, w in zip(counts, counted):
        assert abs(c - n * w / total) <= 1.0, (counts, counted)
    served = [w for w in counted if w > 0]
    if len(served) > 1 and max(served) < 10 * min(served):
        assert max(counts) < n, "one slot took every pick"


@CI
@given(
    st.lists(
        st.tuples(st.booleans(), st.one_of(st.floats(0.5, 1000.0), st.sampled_from(BAD_WEIGHTS))),
        min_size=1,
        max_size=8,
    ).filter(lambda slots: any(e for e, _ in slots))
)
@example([(True, 1.0), (True, 2.0), (False, math.inf)])  # an ineligible inf once gave slot 0 every pick
@example([(True, 1.0), (True, 2.0), (True, math.nan)])
@example([(True, 1.0), (True, 2.0), (True, math.inf), (True, 1e300)])
def test_smooth_wrr_stays_in_proportion_whatever_the_weights(slots: list[tuple[bool, float]]) -> None:
    eligible, weights = [e for e, _ in slots], [w for _, w in slots]
    counts = _picks(weights, eligible, 600)
    assert all(c == 0 for c, e in zip(counts, eligible) if not e)
    _assert_in_proportion(counts, _counted(weights, eligible))


def test_smooth_wrr_gives_a_non_finite_weight_no_more_than_the_heaviest_finite_one() -> None:
    # Not eligible: it counts with nothing, and the others share 1:2.
    assert _picks([1.0, 2.0, math.inf], [True, True, False], 300) == [100, 200, 0]
    assert _picks([1.0, 2.0, math.nan], [True, True, False], 300) == [100, 200, 0]
    # Eligible: as the heaviest finite weight (2), never every pick.
    assert _picks([1.0, 2.0, math.inf], [True, True, True], 500) == [100, 200, 200]
    assert _picks([1.0, 2.0, math.nan], [True, True, True], 500) == [100, 200, 200]
    assert _picks([math.nan, math.inf], [True, True], 10) == [5, 5]


#: Times the scheduler's clock or a transfer might carry after a bug: huge, infinite, NaN.
TIMES = st.one_of(
    st.floats(-1e6, 1e7),
    st.sampled_from([1e300, -1e300, math.inf, -math.inf, math.nan, 1e6]),
)


@CI
@given(
    st.lists(
        st.tuples(
            TIMES,
            st.one_of(st.none(), TIMES),
            st.booleans(),
            st.floats(0.0, 1e6),
            st.booleans(),
        ),
        min_size=1,
        max_size=6,
    ),
    TIMES,
    st.sampled_from([UrgencyModel(), UrgencyModel(beta=50.0, max_delay_s=math.inf), UrgencyModel(max_delay_s=1e9)]),
)
def test_weights_from_any_times_are_finite_and_picked_in_proportion(
    slots: list[tuple[float, float | None, bool, float, bool]], now: float, model: UrgencyModel
) -> None:
    pairs = PairQueues()
    for i, (since, deadline_at, critical, rp, busy) in enumerate(slots):
        p = pending(f"s{i}", "rx", arrived=since, critical=critical, deadline_at=deadline_at)
        pairs.push(p, rp, 1 if busy else 0, since)
    weights = pairs.weights(now, model).copy()
    assert all(math.isfinite(w) and 0 < w <= 2e6 + MAX_URGENCY for w in weights), weights
    for slot in range(len(slots)):  # the scalar path agrees with the vector one
        assert pairs.weight(slot, now, model) == pytest.approx(weights[slot], rel=1e-9)
    eligible = pairs.eligible()
    if eligible.any():
        counts = _picks(list(weights), list(eligible), 600)
        _assert_in_proportion(counts, [w if e else 0.0 for w, e in zip(weights, eligible)])


def test_urgency_after_a_very_long_wait_is_finite_and_no_smaller() -> None:
    for model in (UrgencyModel(), UrgencyModel(max_delay_s=1e7), UrgencyModel(beta=50.0, max_delay_s=math.inf)):
        p = pending("a", "b", arrived=0.0)
        waits = [0.0, 1.0, 10.0, 100.0, 1e3, 1e5, 1e6, 1e300, math.inf]
        us = [model.urgency(p, t) for t in waits]
        assert all(math.isfinite(u) and u <= MAX_URGENCY for u in us), us
        assert us == sorted(us)  # ordered: never less urgent for waiting longer
        assert us[waits.index(1e6)] >= us[waits.index(100.0)] > us[0]
        # The vector path of the round robin agrees, and stays finite too.
        pairs = PairQueues()
        pairs.push(p, 2.0, 0, 0.0)
        w = pairs.weights(1e6, model)
        assert math.isfinite(w[0]) and w[0] == pytest.approx(2.0 + us[waits.index(1e6)])
        # NaN times count as no wait; a NaN deadline as a deadline reached.
        assert model.urgency(p, math.nan) == model.urgency(p, 0.0)
        late = pending("a", "b", arrived=0.0, deadline_at=math.nan)
        assert model.urgency(late, 0.0) == pytest.approx(model.base + model.alpha + model.deadline_boost)


@pytest.mark.parametrize(
    "field, value",
    [
        ("base", math.nan),
        ("alpha", math.inf),
        ("alpha", math.nan),
        ("beta", math.inf),
        ("beta", math.nan),
        ("max_delay_s", math.nan),
        ("deadline_horizon_s", math.inf),
        ("critical_boost", math.inf),
        ("deadline_boost", math.nan),
        ("base", 1e300),
    ],
)
def test_urgency_model_refuses_non_finite_parameters(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        UrgencyModel(**{field: value})
    key = f"urgency_{field}" if field in ("base", "alpha", "beta", "max_delay_s") else field
    with pytest.raises(ConfigError, match=field):  # as KVBUS_SCHEDULER_<key> would set it
        WeightedPolicy.from_config(SchedulerConfig(**{key: value}))


# -- weighted max-min --------------------------------------------------------------------------------


def test_max_min_splits_one_bottleneck_by_weight() -> None:
    flows = [Flow(i, w, ("link",)) for i, w in enumerate([1.0, 2.0, 3.0])]
    rates = weighted_max_min(flows, {"link": 60.0})
    assert rates == pytest.approx({0: 10.0, 1: 20.0, 2: 30.0})


def test_max_min_gives_what_one_bottleneck_leaves_to_the_others() -> None:
    # Flow 0 is held to 10 by its own egress; the other two split the rest of the shared link.
    flows = [Flow(0, 1.0, ("link", "out0")), Flow(1, 1.0, ("link",)), Flow(2, 3.0, ("link",))]
    rates = weighted_max_min(flows, {"link": 90.0, "out0": 10.0})
    assert rates == pytest.approx({0: 10.0, 1: 20.0, 2: 60.0})
    assert weighted_max_min([Flow("free", 1.0, ("nowhere",))], {"link": 5.0}) == {"free": 0.0}


@CI
@given(
    st.lists(
        st.tuples(st.floats(0.1, 10), st.sets(st.integers(0, 5), min_size=1, max_size=3)), min_size=1, max_size=12
    ),
    st.lists(st.floats(1.0, 1000.0), min_size=6, max_size=6),
)
def test_max_min_is_feasible_and_every_flow_has_a_bottleneck(flows: list, caps: list) -> None:
    fl = [Flow(i, w, tuple(sorted(res))) for i, (w, res) in enumerate(flows)]
    cap = dict(enumerate(caps))
    rates = weighted_max_min(fl, cap)
    used = Counter()
    for f in fl:
        for r in f.resources:
            used[r] += rates[f.key]
    for r, u in used.items():
        assert u <= cap[r] * (1 + 1e-9) + 1e-9
    # Weighted max-min: each flow crosses a full resource where no flow gets more per unit weight.
    for f in fl:
        ok = False
        for r in f.resources:
            full = used[r] >= cap[r] * (1 - 1e-9)
            mine = rates[f.key] / f.weight
            if full and all(rates[g.key] / g.weight <= mine * (1 + 1e-9) for g in fl if r in g.resources):
                ok = True
        assert ok, (f, rates)


# -- the policy on a simulated clock -------------------------------------------------------------


def saturated(weights: list[float], *, seconds: float = 10.0, **policy: object) -> dict[str, float]:
    """Senders of the given role priorities keep a receiver with a 30 MB/s link saturated."""
    sim = Simulation(WeightedPolicy(FixedSelector(), **policy))  # type: ignore[arg-type]
    sim.agent("rx", priority=0.0, link_bps=30 * MB)
    for i, p in enumerate(weights):
        sim.agent(f"s{i}", priority=p)
        sim.backlog(f"s{i}", "rx", 4 * MB, depth=2)
    sim.run(1.0)
    sim.reset_counters()
    sim.run(1.0 + seconds)
    return {src: b for (src, _), b in sim.pair_bytes.items()}


def test_weighted_shares_within_5_percent_under_saturation() -> None:
    # W = priority_i + priority_rx (0) + urgency (base + alpha = 2): 2, 4, 6, 10.
    got = saturated([0.0, 2.0, 4.0, 8.0])
    w = {"s0": 2.0, "s1": 4.0, "s2": 6.0, "s3": 10.0}
    total = sum(got.values())
    assert total == pytest.approx(10 * 30 * MB, rel=0.01)  # no idle capacity
    for k, wk in w.items():
        share, want = got[k] / total, wk / sum(w.values())
        assert abs(share - want) <= 0.05 * want, (k, share, want)


def test_a_low_priority_pair_never_waits_longer_than_the_derived_bound() -> None:
    # Two high-priority pairs hold both slots with long transfers; the low pair waits behind
    # them. Its urgency grows as base + alpha * exp(beta * wait) until it outranks them.
    policy = WeightedPolicy(FixedSelector(), max_active=2)
    bound = policy.starvation_bound_s()
    u = UrgencyModel()
    assert bound == pytest.approx(math.log((4 * (u.base + u.alpha) - u.base) / u.alpha) / u.beta + 0.010)
    sim = Simulation(policy, bandwidth_bps=30 * MB)
    for name, prio in (("h0", 10.0), ("h1", 10.0), ("low", 0.0), ("x", 1.0), ("y", 1.0), ("z", 1.0)):
        sim.agent(name, priority=prio)
    sim.backlog("h0", "x", 60 * MB, depth=2, tag="high")
    sim.backlog("h1", "y", 60 * MB, depth=2, tag="high")
    sim.run(0.05)
    sim.backlog("low", "z", 2 * MB, depth=1, tag="low")
    sim.run(12.0)
    low = [t for t in sim.transfers if t.tag == "low" and t.granted_at is not None]
    assert len(low) >= 5
    waits = [t.queue_s for t in low]
    assert max(waits) <= bound + sim.step_s + 1e-9, (max(waits), bound)
    assert max(waits) >= 0.5 * bound  # the bound, not luck, is what let it in


def test_preemption_pauses_below_the_threshold_and_resumes_without_loss() -> None:
    sim = Simulation(WeightedPolicy(FixedSelector()), bandwidth_bps=20 * MB)
    for name in ("bulk", "crit", "rx"):
        sim.agent(name)
    bulk = sim.submit("bulk", "rx", 20 * MB)
    urgent = sim.submit("crit", "rx", 4 * MB, at=0.1, critical=True)
    sim.run(2.0)
    assert bulk.pauses == 1 and bulk.declined == 0
    assert urgent.latency_s == pytest.approx(4 / 20, abs=0.02)  # the whole budget while bulk waits
    assert bulk.done_at == pytest.approx(1.0 + urgent.latency_s, abs=0.03)
    assert bulk.sent == bulk.nbytes  # every byte once: it went on from where it stopped


def test_no_preemption_past_the_threshold() -> None:
    sim = Simulation(WeightedPolicy(FixedSelector()), bandwidth_bps=20 * MB)
    for name in ("bulk", "crit", "rx"):
        sim.agent(name)
    bulk = sim.submit("bulk", "rx", 20 * MB)
    urgent = sim.submit("crit", "rx", 4 * MB, at=0.5, critical=True)  # bulk is 50 % through
    sim.run(3.0)
    assert bulk.pauses == 0 and bulk.declined == 1
    assert sim.state.declined_pauses == 1
    # Still first in line by weight: W 54 against 4 of the 20 MB/s.
    assert urgent.latency_s == pytest.approx(4 / (20 * 54 / 58), abs=0.03)
    assert bulk.done_at is not None


def test_reservation_deadlines_all_met_while_bulk_saturates() -> None:
    policy = WeightedPolicy(FixedSelector(), max_active=4)
    sim = Simulation(policy, bandwidth_bps=50 * MB)
    for name in ("rx", "hb", "b0", "b1", "b2", "b3"):
        sim.agent(name)
    table = policy.reservations
    r = Reservation("hb", "hb", ("rx",), period_s=0.1, size_bytes=200_000, deadline_s=0.02)
    verdict = LocalAdmission().check(r, table, sim.state)
    assert verdict.ok, verdict.reason
    r.rate_bps = verdict.rate_bps
    table.add(r)
    for i in range(4):
        sim.backlog(f"b{i}", "rx", 8 * MB, depth=2, tag="bulk")
    sim.periodic("hb", "rx", 200_000, period_s=0.1, start=0.5, until=8.45, tag="hb")
    sim.run(9.0)
    beats = [t for t in sim.transfers if t.tag == "hb"]
    assert len(beats) == 80
    assert all(t.latency_s is not None and t.latency_s <= 0.02 for t in beats), max(t.latency_s or 9 for t in beats)
    bulk = sum(t.sent for t in sim.transfers if t.tag == "bulk")
    # Bandwidth is set aside only around each beat: bulk gets the rest, nothing idles.
    assert bulk / 9.0 >= 0.85 * 50 * MB


def test_fifo_misses_the_same_deadlines() -> None:
    sim = Simulation(FifoPolicy(FixedSelector(), max_active=4), bandwidth_bps=50 * MB)
    for name in ("rx", "hb", "b0", "b1", "b2", "b3"):
        sim.agent(name)
    for i in range(4):
        sim.backlog(f"b{i}", "rx", 8 * MB, depth=2, tag="bulk")
    sim.periodic("hb", "rx", 200_000, period_s=0.1, start=0.5, until=3.5, tag="hb")
    sim.run(4.0)
    beats = [t for t in sim.transfers if t.tag == "hb"]
    assert sum(1 for t in beats if t.latency_s is None or t.latency_s > 0.02) > len(beats) // 2


def test_admission_refuses_what_does_not_fit_and_says_why() -> None:
    state = GroupState("g", bandwidth_bps=10 * MB)
    state.declare("a", 0.0, 0.0)
    table = ReservationTable()
    admit = LocalAdmission(reservable_fraction=0.5, headroom=1.25)
    first = Reservation("r1", "a", ("b",), period_s=1.0, size_bytes=2 * MB, deadline_s=0.5)  # 5 MB/s
    verdict = admit.check(first, table, state)
    assert verdict.ok and verdict.rate_bps == pytest.approx(5 * MB)
    first.rate_bps = verdict.rate_bps
    table.add(first)
    second = Reservation("r2", "c", ("b",), period_s=1.0, size_bytes=MB, deadline_s=1.0)  # 1.25 MB/s more
    refused = admit.check(second, table, state)
    assert not refused.ok
    assert "needs 10.0 Mbit/s" in refused.reason and "only 0.0 Mbit/s of the 40.0 Mbit/s" in refused.reason
    late = admit.check(Reservation("r4", "a", ("b",), period_s=0.1, size_bytes=10, deadline_s=0.5), table, state)
    assert not late.ok and "longer than the period" in late.reason
    nan = admit.check(
        Reservation("r5", "a", ("b",), period_s=float("nan"), size_bytes=10, deadline_s=0.5), table, state
    )
    assert not nan.ok


def test_admission_checks_each_agents_link() -> None:
    state = GroupState("g")
    state.declare("slow", 1 * MB, 0.0)
    verdict = LocalAdmission().check(Reservation("r", "slow", ("b",), 1.0, MB, 1.0), ReservationTable(), state)
    assert not verdict.ok and "slow's egress" in verdict.reason


def pending(src: str, dst: str, *, arrived: float, critical: bool = False, deadline_at: float | None = None) -> Pending:
    req = TransferRequest(
        transfer_id=f"{src}-{dst}",
        src=src,
        dst=[dst],
        group="g",
        n_tokens=1,
        nbytes=MB,
        signature=SIM_SIGNATURE.to_dict(),
        critical=critical,
    )
    return Pending(req, {dst: SIM_SIGNATURE}, arrived=arrived, deadline_at=deadline_at)


def test_urgency_grows_with_waiting_deadline_and_criticality() -> None:
    u = UrgencyModel()
    plain = pending("a", "b", arrived=0.0)
    assert u.urgency(plain, 0.0) == pytest.approx(u.base + u.alpha)
    assert u.urgency(plain, 1.0) == pytest.approx(u.base + u.alpha * math.exp(u.beta))
    assert u.urgency(plain, 1.0, running=True) == pytest.approx(u.base + u.alpha)
    crit = pending("a", "b", arrived=0.0, critical=True)
    assert u.urgency(crit, 0.0) == pytest.approx(u.base + u.alpha + u.critical_boost)
    near = pending("a", "b", arrived=0.0, deadline_at=0.1)
    far = pending("a", "b", arrived=0.0, deadline_at=10.0)
    assert u.urgency(far, 0.0) < u.urgency(near, 0.0) < u.base + u.alpha + u.deadline_boost + 1e-9
    state = GroupState("g")
    assert u.weight(state, plain, 0.0) == pytest.approx(1.0 + 1.0 + u.base + u.alpha)


def test_policies_by_name_and_config_checks() -> None:
    assert isinstance(make_policy(SchedulerConfig(), FixedSelector()), WeightedPolicy)
    assert isinstance(make_policy(SchedulerConfig(policy="fifo"), FixedSelector()), FifoPolicy)
    with pytest.raises(ValueError, match="known policies: fifo, strict, wrr"):
        make_policy(SchedulerConfig(policy="lottery"), FixedSelector())
    with pytest.raises(ConfigError, match="5..20 ms"):
        SchedulerConfig(tick_s=0.05)
    with pytest.raises(ConfigError, match="name=bytes"):
        SchedulerConfig(memory_watermarks="a=1,b")
    assert SchedulerConfig(memory_watermarks="a=1e9, b=5").watermarks() == {"a": 10**9, "b": 5}


# -- the new wire messages ----------------------------------------------------------------------------


@CI
@given(
    body=st.dictionaries(
        st.sampled_from(
            [
                "t",
                "v",
                "transfer_id",
                "action",
                "ok",
                "fraction",
                "reason",
                "rate_bps",
                "max_fraction",
                "nbytes",
                "reservation_id",
                "src",
                "dst",
                "group",
                "period_s",
                "size_bytes",
                "deadline_s",
                "cancel",
                "ts",
            ]
        ),
        st.none()
        | st.booleans()
        | st.integers(-5, 2**40)
        | st.floats()
        | st.text(max_size=8)
        | st.lists(st.text(max_size=4), max_size=3),
        max_size=19,
    ),
    tag=st.sampled_from(["control", "control_reply", "flow_reserve"]),
)
def test_new_control_messages_reject_garbage_cleanly(body: dict, tag: str) -> None:
    body = {**body, "t": tag, "v": 1}
    data = msgpack.packb(body, use_bin_type=True)
    try:
        decode_message(data, Control, ControlReply, FlowReservation)
    except KVBusError:
        pass


def test_new_control_messages_round_trip() -> None:
    for msg in (
        Control("t1", "rate", rate_bps=5e6),
        Control("t1", "pause", max_fraction=0.3),
        Control("", "shed", nbytes=123, reason="over"),
        ControlReply("t1", "pause", False, 0.42, "past"),
        FlowReservation("r1", "a", ["b"], "g", 0.1, 1000, 0.02),
    ):
        assert decode_message(msg.encode(), Control, ControlReply, FlowReservation) == msg


def test_a_control_action_is_an_enum_inside_and_its_string_on_the_wire() -> None:
    for action in ControlAction:
        msg = Control("t1", action)
        assert msgpack.unpackb(msg.encode())["action"] == action.value
        assert msg.encode() == Control("t1", action.value).encode()  # a plain string is taken as the same action
        decoded = Control.decode(msg.encode())
        assert decoded.action is action and decoded == msg
    assert Control.ACTIONS == ("pause", "resume", "cancel", "rate", "shed")
    body = msgpack.packb({"t": "control", "v": 1, "transfer_id": "t1", "action": "explode"})
    with pytest.raises(WireFormatError, match=r"action 'explode' is not one of \('pause', 'resume'"):
        Control.decode(body)


def test_a_refusal_is_a_value_and_path_names_are_an_enum() -> None:
    req = TransferRequest(transfer_id="t", src="a", dst=["b"], group="g", n_tokens=1, nbytes=1, signature={})
    p = Pending(req, {"b": SIM_SIGNATURE})
    refusal = Decision.refusal(p, "no", Reason.INCOMPATIBLE)
    assert refusal.refused and refusal.code is Reason.INCOMPATIBLE and refusal.medium == "" and refusal.rate_bps == 0
    assert not Decision(p, "full", 1e6, "ok").refused
    assert Selection.refusal("no").refused and Selection.refusal("no").code is Reason.REFUSED
    assert not Selection("int8", "ok").refused
    assert PATH_NAMES == ("shm", "tcp", "nats") and tuple(PathName) == PATH_NAMES


def _probe(name: str) -> Probe:
    return Probe(agent=name, group="g", queue_size=0, cache_bytes=0, compute_load=0.0, role_priority=1.0)


@given(st.lists(st.tuples(st.integers(0, 5), st.floats(0.0, 3.0)), min_size=1, max_size=40))
@example([(0, 0.0), (0, 3.0)])  # a probe at the very start, silent past the TTL
@settings(max_examples=500, deadline=None)
def test_liveness_without_scans_matches_a_full_scan(events: list[tuple[int, float]]) -> None:
    """Probes at random times: the lazily scanned liveness (a floor of the oldest probe) marks the
    same agents down at the same moments as checking every agent every time, and the wake-up it
    asks for is never later than the first real expiry."""
    from kvbus.group_scheduler.state import GroupState

    ttl = 2.0
    state = GroupState("g")
    seen: dict[str, float] = {}
    down: set[str] = set()
    now = 1.0  # a monotonic clock: last_seen 0 means "never probed"
    for who, dt in events:
        now += dt
        expiry = state.next_expiry(ttl)
        live = [t + ttl for a, t in seen.items() if a not in down]
        if live:
            assert expiry is not None and expiry <= min(live) + 1e-9
        gone = set(state.expire(now, ttl))
        want = {a for a, t in seen.items() if a not in down and now - t > ttl}
        assert gone == want
        down |= gone
        assert state.n_down == len(down) == sum(a.down for a in state.agents.values())
        name = f"a{who}"
        state.on_probe(_probe(name), now)
        seen[name] = now
        down.discard(name)
        assert state.n_down == len(down)
