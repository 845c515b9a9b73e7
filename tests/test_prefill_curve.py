"""The cost model's prefill follows the calibrated curve of prefill time against length (issue 32).

Per token a long prefill is slower than a short one (attention over the context), so a speed
measured at one length is not the speed at another. Before the curve, a receiver that had
prefilled 2048-token contexts reported a speed that the scheduler took for the speed at the
calibrated 512 tokens: it predicted a 128-token recompute too slow, and its loss term (the
receiver's decode time, scaled by how much slower than calibrated its prefill ran) charged
int8 about three times what a measurement of the same fidelity costs.
"""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbus.bus.endpoint import PrefillSpeed
from kvbus.codecs.calibration import CalibrationProfile, fit_prefill_shape
from kvbus.codecs.errors import CalibrationError
from kvbus.group_scheduler.cost_model import CostModel, Endpoint, Link, ModelCosts
from kvbus.group_scheduler.learning import LearnedCosts
from kvbus.group_scheduler.selection import AdaptiveSelector
from kvbus.group_scheduler.state import GroupState, Pending
from kvbus.protocol import Probe, TransferRequest
from tests.test_selection import FIGS, MEDIA, SMOL

REF = 512


def timing(n: int) -> float:
    """A prefill of ``n`` tokens on a made-up machine: a fixed cost, per-token work, attention."""
    return 0.02 + n / 1000 + n * n / 2e6


TIMINGS = {n: timing(n) for n in (128, 256, 512, 1024, 2048)}
SHAPE = fit_prefill_shape(TIMINGS, REF)
CURVED = ModelCosts(prefill_tokens_per_s=REF / timing(REF), decode_token_s=0.02, prefill_shape=SHAPE)


def test_the_fit_recovers_a_fixed_cost_linear_and_quadratic_curve() -> None:
    assert SHAPE is not None
    for n, t in TIMINGS.items():
        assert CURVED.prefill_s(n) == pytest.approx(t, rel=1e-6)
    # after a held prefix the attention covers it too: the difference of two prefills from nothing
    held = 1024
    assert CURVED.prefill_s(512, held) == pytest.approx(timing(held + 512) - timing(held) + 0.02, rel=1e-6)
    assert CURVED.prefill_s(0) == 0.0


@given(
    st.floats(0.0, 1.0),
    st.floats(1e-6, 1e-2),
    st.floats(0.0, 1e-5),
    st.integers(1, 100_000),
    st.floats(1e-3, 100.0),
)
def test_a_speed_carried_to_the_reference_predicts_the_timing_back(
    c0: float, c1: float, c2: float, tokens: int, seconds: float
) -> None:
    shape = fit_prefill_shape({n: c0 + c1 * n + c2 * n * n for n in (128, 512, 2048, 4096)}, REF)
    assert shape is not None and all(c >= 0 for c in shape)
    costs = ModelCosts(1000.0, 0.02, prefill_shape=shape)
    tps = costs.reference_tps(tokens, seconds)
    assert math.isfinite(tps) and tps > 0
    assert ModelCosts(tps, 0.02, prefill_shape=shape).prefill_s(tokens) == pytest.approx(seconds, rel=1e-6)


def test_a_curve_that_fits_a_negative_term_drops_it_and_too_few_points_fit_none() -> None:
    concave = {128: 0.2, 512: 0.6, 2048: 1.8}  # sublinear: a quadratic fit would be negative
    shape = fit_prefill_shape(concave, REF)
    assert shape is not None and all(c >= 0 for c in shape)
    assert fit_prefill_shape({128: 0.1, 512: 0.4}, REF) is None
    assert ModelCosts(1000.0, 0.02).prefill_s(2048) == pytest.approx(2.048)  # no curve: linear


def _profile(**extra: object) -> dict[str, object]:
    return {
        "version": 1,
        "model": SMOL.to_dict(),
        "machine": {},
        "created": "2026-12-04T00:00:00+00:00",
        "codecs": {},
        "prefill_tokens_per_s": 1000.0,
        "decode_token_s": 0.02,
        "context_tokens": REF,
        **extra,
    }


def test_the_profile_keeps_its_prefill_timings_and_refuses_bad_ones() -> None:
    timings = {str(n): t for n, t in TIMINGS.items()}
    profile = CalibrationProfile.from_dict(
        _profile(prefill_s_by_tokens=timings, prefill_tokens_per_s=REF / timing(REF))
    )
    assert profile.prefill_s_by_tokens == TIMINGS
    again = CalibrationProfile.from_dict(profile.to_dict())
    assert again.prefill_shape() == pytest.approx(SHAPE)
    model = CostModel.from_profile(again)
    assert model.default_model_costs.prefill_s(2048) == pytest.approx(timing(2048), rel=1e-6)
    assert CalibrationProfile.from_dict(_profile()).prefill_shape() is None  # an older profile: linear
    for bad in ({"512": -1.0}, {"512": math.inf}, {"x": 1.0}, {"0": 1.0}, {"512": True}, [1.0]):
        with pytest.raises(CalibrationError):
            CalibrationProfile.from_dict(_profile(prefill_s_by_tokens=bad))


def test_tokens_at_2048_are_predicted_on_the_curve() -> None:
    m = CostModel(FIGS)
    m.default_model_costs = CURVED
    n = 2048
    a, b = Endpoint(SMOL, model=CURVED), Endpoint(SMOL, model=CURVED)
    kw = dict(n_tokens=n, kv_bytes=n * SMOL.kv_bytes_per_token(), link=Link(1e9), sender=a, receiver=b)
    tokens = next(e for e in m.choose(["tokens"], **kw).candidates if e.medium == "tokens")
    assert tokens.recompute_s == pytest.approx(timing(n), rel=1e-6)  # linear from 512 said 0.54 of it


def _selector_state(prefill_tps: float, prefill_tokens: float) -> tuple[AdaptiveSelector, GroupState]:
    m = CostModel(FIGS)
    m.default_model_costs = CURVED
    state = GroupState("g")
    for name, tps, n in (("a", 0.0, 0.0), ("b", prefill_tps, prefill_tokens)):
        probe = Probe(
            agent=name,
            group="g",
            queue_size=0,
            cache_bytes=0,
            compute_load=0.0,
            role_priority=1.0,
            prefill_tps=tps,
            prefill_tokens=n,
        )
        state.on_probe(probe)
        state.declare(name, 1.25e9, 0.0)
    return AdaptiveSelector(m, candidates=tuple(MEDIA)), state


def test_a_receiver_that_prefilled_long_contexts_at_the_calibrated_curve_is_not_slowed() -> None:
    """Its probe says 2048 tokens at the curve's speed there: the loss term and the recompute of a
    128-token context are the calibrated ones (before: both scaled by 512's speed over 2048's)."""
    n = 2048
    selector, state = _selector_state(n / timing(n), n)
    rx = selector.endpoint(state, "b", SMOL)
    assert rx.model.prefill_tokens_per_s == pytest.approx(CURVED.prefill_tokens_per_s, rel=1e-6)
    assert rx.model.decode_token_s == pytest.approx(CURVED.decode_token_s, rel=1e-6)
    assert rx.model.prefill_s(128) == pytest.approx(timing(128), rel=1e-6)
    # a receiver twice as slow on the same lengths is twice as slow everywhere
    slow = selector.endpoint(_selector_state(n / timing(n) / 2, n)[1], "b", SMOL)
    assert slow.model.decode_token_s == pytest.approx(2 * CURVED.decode_token_s, rel=1e-6)
    # a probe that says no length (an older agent): its speed is taken as the reference speed
    old = selector.endpoint(_selector_state(500.0, 0.0)[1], "b", SMOL)
    assert old.model.prefill_tokens_per_s == pytest.approx(500.0)


def test_the_loss_term_at_2048_tokens_follows_the_curve() -> None:
    n = 2048
    selector, state = _selector_state(n / timing(n), n)
    req = TransferRequest(
        transfer_id="t",
        src="a",
        dst=["b"],
        group="g",
        n_tokens=n,
        nbytes=n * SMOL.kv_bytes_per_token(),
        signature=SMOL.to_dict(),
    )
    pending = Pending(req, {"b": SMOL}, arrived=time.monotonic())
    selector.choose(state, pending)
    loss = {c["medium"]: c["loss_s"] for c in pending.decision["candidates"]}
    cfg = selector.model.config
    expected = cfg.loss_weight * cfg.output_tokens * (1 - FIGS["int8"].fidelity_at(n)) * CURVED.decode_token_s
    assert loss["int8"] == pytest.approx(expected, rel=1e-3)


def test_a_learned_prefill_is_carried_to_the_reference_length() -> None:
    learned = LearnedCosts()
    n = 2048
    learned.observe_prefill("b", n, timing(n), speed=CURVED.reference_tps)
    assert learned.prefill("b") == pytest.approx(CURVED.prefill_tokens_per_s, rel=1e-6)
    plain = LearnedCosts()
    plain.observe_prefill("b", n, timing(n))
    assert plain.prefill("b") == pytest.approx(n / timing(n))


def test_the_agent_reports_the_lengths_its_speed_was_measured_on() -> None:
    speed = PrefillSpeed()
    speed.observe(2048, 4.0, held=0)
    assert (speed.tokens, speed.held) == (2048.0, 0.0)
    speed.observe(1024, 1.0, held=1024)
    a = PrefillSpeed.ALPHA
    assert speed.tokens == pytest.approx(2048 + a * (1024 - 2048))
    assert speed.held == pytest.approx(a * 1024)
    decoded = Probe.decode(
        Probe(
            agent="b",
            group="g",
            queue_size=0,
            cache_bytes=0,
            compute_load=0.0,
            role_priority=1.0,
            prefill_tps=512.0,
            prefill_tokens=speed.tokens,
            prefill_held=speed.held,
        ).encode()
    )
    assert (decoded.prefill_tokens, decoded.prefill_held) == (speed.tokens, speed.held)
