"""The loss term at the transfer's context length: a medium's fidelity is charged from the
calibrated curve (fidelity per context length), not one figure measured at 512 tokens."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from kvbus.codecs.calibration import CalibrationProfile, CodecFigures
from kvbus.group_scheduler.cost_model import CostModel, Endpoint, Link, MediumFigures, ModelCosts
from kvbus.signature import ModelSignature

SMOL = ModelSignature("SmolLM2-135M-Instruct", 30, 3, 64, "float32", 49152)
COSTS = ModelCosts(prefill_tokens_per_s=2000.0, decode_token_s=0.02)
INT8 = MediumFigures(3.9, 3.0, 6.0, 0.98, True, False, fidelity_by_tokens=((128, 0.999), (512, 0.99), (2048, 0.95)))


def test_the_curve_is_read_at_the_length_and_flat_past_its_ends() -> None:
    assert INT8.fidelity_at(64) == 0.999 and INT8.fidelity_at(128) == 0.999
    assert INT8.fidelity_at(512) == 0.99 and INT8.fidelity_at(4096) == 0.95
    # linear in log(tokens): 256 is half way from 128 to 512
    assert math.isclose(INT8.fidelity_at(256), (0.999 + 0.99) / 2)
    assert replace(INT8, fidelity_by_tokens=()).fidelity_at(256) == 0.98
    lossless = MediumFigures(1.0, 1e6, 1e6, 1.0, True, True, fidelity_by_tokens=((128, 0.5),))
    assert lossless.fidelity_at(128) == 1.0


@given(
    st.lists(
        st.tuples(st.integers(1, 1 << 20), st.floats(1e-3, 1.0)), min_size=1, max_size=6, unique_by=lambda p: p[0]
    ),
    st.integers(1, 1 << 22),
)
def test_the_curve_stays_between_its_points(points: list[tuple[int, float]], n: int) -> None:
    figs = MediumFigures(3.9, 3.0, 6.0, 0.9, True, False, fidelity_by_tokens=tuple(sorted(points)))
    f = figs.fidelity_at(n)
    values = [v for _, v in points]
    assert min(values) - 1e-12 <= f <= max(values) + 1e-12


def test_the_loss_term_charges_the_fidelity_at_the_transfers_length() -> None:
    m = CostModel({"int8": INT8})
    a, b = Endpoint(SMOL, model=COSTS), Endpoint(SMOL, model=COSTS)

    def loss(n: int) -> float:
        e = m.estimate("int8", n_tokens=n, kv_bytes=n * SMOL.kv_bytes_per_token(), link=Link(1e8), sender=a, receiver=b)
        return e.loss_s

    cfg = m.config
    assert math.isclose(loss(128), cfg.loss_weight * cfg.output_tokens * 0.001 * COSTS.decode_token_s)
    assert math.isclose(loss(2048), cfg.loss_weight * cfg.output_tokens * 0.05 * COSTS.decode_token_s)


def test_a_profiles_curve_reaches_the_cost_model() -> None:
    figs = CodecFigures(3.0, 6.0, 3.9, 0.005, 1e-4, 0.99, 0.0, 0.99)
    profile = CalibrationProfile(
        1,
        {},
        {},
        "2026-01-01T00:00:00+00:00",
        {"int8": figs},
        800.0,
        0.03,
        512,
        fidelity_by_tokens={"int8": {1024: 0.97, 128: 0.999}},
    )
    m = CostModel.from_profile(profile)
    assert m.figures["int8"].fidelity_by_tokens == ((128, 0.999), (1024, 0.97))
    assert m.figures["delta+int8"].fidelity_at(1024) == 0.97
    assert m.figures["int8"].fidelity == 0.99
