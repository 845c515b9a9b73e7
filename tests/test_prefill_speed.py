"""The cost model's recompute term follows the prefill speed the receiver measured on its own
recomputes (issue 22): an agent that recomputes slowly under load stops being sent ``tokens``
where the calibrated, idle figure would have chosen them."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from kvbus.app.models import random_model
from kvbus.bus import Bus
from kvbus.bus.endpoint import PrefillSpeed
from kvbus.group_scheduler import GroupScheduler
from kvbus.group_scheduler.cost_model import Endpoint, Link
from kvbus.group_scheduler.selection import AdaptiveSelector
from kvbus.group_scheduler.state import GroupState, Pending
from kvbus.protocol import Probe, TransferRequest
from tests.conftest import FAST
from tests.test_selection import COSTS, MEDIA, SMOL, model


def test_prefill_speed_is_a_weighted_mean_of_real_recomputes() -> None:
    speed = PrefillSpeed()
    speed.observe(8, 0.001)  # too short to say anything
    speed.observe(1000, 0.0)  # no time measured
    speed.observe(1000, math.inf)
    assert speed.tokens_per_s == 0.0
    speed.observe(1000, 1.0)
    assert speed.tokens_per_s == pytest.approx(1000.0)
    speed.observe(1000, 0.5)  # 2000 tokens/s, weighted by ALPHA
    assert speed.tokens_per_s == pytest.approx(1000.0 + PrefillSpeed.ALPHA * 1000.0)


def test_a_measured_prefill_speed_is_not_scaled_by_the_load_again() -> None:
    m = model()
    n = 512
    kw = dict(n_tokens=n, kv_bytes=n * SMOL.kv_bytes_per_token(), link=Link(1e9), sender=Endpoint(SMOL, model=COSTS))
    calibrated = Endpoint(SMOL, compute_load=1.0, model=COSTS)
    measured = Endpoint(SMOL, compute_load=1.0, model=COSTS, prefill_measured=True)
    by_calibrated = {e.medium: e for e in m.choose(["tokens"], receiver=calibrated, **kw).candidates}
    by_measured = {e.medium: e for e in m.choose(["tokens"], receiver=measured, **kw).candidates}
    assert by_calibrated["tokens"].comp_s == pytest.approx(2 * n / COSTS.prefill_tokens_per_s, rel=0.05)
    assert by_measured["tokens"].comp_s == pytest.approx(n / COSTS.prefill_tokens_per_s, rel=0.05)


def _decide(prefill_tps: float) -> str:
    """The medium the scheduler's selector picks for a short context on a slow link, with the
    receiver's probe carrying ``prefill_tps`` (0: not measured)."""
    selector = AdaptiveSelector(model(), candidates=tuple(MEDIA))
    state = GroupState("g")
    state.on_probe(Probe(agent="a", group="g", queue_size=0, cache_bytes=0, compute_load=0.0, role_priority=1.0))
    state.on_probe(
        Probe(
            agent="b",
            group="g",
            queue_size=0,
            cache_bytes=0,
            compute_load=0.0,
            role_priority=1.0,
            prefill_tps=prefill_tps,
        )
    )
    state.declare("a", 1.25e6, 0.0)
    state.declare("b", 1.25e6, 0.0)
    n = 128
    req = TransferRequest(
        transfer_id="t",
        src="a",
        dst=["b"],
        group="g",
        n_tokens=n,
        nbytes=n * SMOL.kv_bytes_per_token(),
        signature=SMOL.to_dict(),
    )
    medium, _ = selector.choose(state, Pending(req, {"b": SMOL}, arrived=time.monotonic()))
    return medium


def test_a_receiver_that_measured_a_slow_prefill_gets_kv_instead_of_tokens() -> None:
    # 128 tokens on a 10 Mbit/s link: with the calibrated 2000 tokens/s, recomputing is cheapest.
    assert _decide(0.0) == "tokens"
    # The same receiver reports it really prefills 20 tokens/s (busy): 6.4 s of recompute loses.
    assert _decide(20.0) != "tokens"


async def test_an_agent_reports_the_prefill_speed_of_its_recomputes(nats_url: str, scheduler: GroupScheduler) -> None:
    """A ``tokens`` delivery is decoded by prefilling; the receiver's next probe carries the speed
    and its scheduler keeps it for the cost model."""
    runner = random_model(n_layers=2, n_kv_heads=2, head_dim=16, n_heads=4, vocab_size=256, seed=11)
    bus = await Bus.connect(nats_url, config=FAST)
    try:
        tx = await bus.agent("pf-tx", signature=runner.signature, runner=runner)
        rx = await bus.agent("pf-rx", signature=runner.signature, runner=runner)
        kv = runner.prefill(torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(3)))
        await tx.send(rx.name, kv, medium="tokens")
        await rx.receive(timeout=30)
        assert rx.prefill.tokens_per_s > 0
        await rx._probes.publish()  # type: ignore[attr-defined]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            agent = scheduler.state.agents.get(rx.name)
            if agent is not None and agent.prefill_tps > 0:
                break
            await asyncio.sleep(0.05)
        assert scheduler.state.agents[rx.name].prefill_tps > 0
    finally:
        await bus.close()
