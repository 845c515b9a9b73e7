"""Never slower than prefilling (issue 35, item 2): the pull gate's decision, alone and in a real lookup."""

from __future__ import annotations

import asyncio

import pytest

from kvbus.errors import ConfigError
from kvbus.integrations.vllm.config import ConnectorConfig
from kvbus.integrations.vllm.protocol import LookupReply
from kvbus.integrations.vllm.worth import MIN_STEP_TOKENS, PullGate
from tests.test_vllm_parts import _client, _context


def test_without_a_measured_prefill_every_pull_is_allowed() -> None:
    gate = PullGate(prior_s=0.3)
    d = gate.decide(224)
    assert d.pull and d.prefill_s is None and d.load_s == 0.3 and "not measured" in d.reason
    assert not gate.decide(0).pull  # nothing to load


def test_a_pull_that_costs_more_than_its_prefill_is_not_made() -> None:
    """The figures of issue 35 on this machine: prefill ~2.7 ms/token, a measured pull of 992 tokens 0.9 s."""
    gate = PullGate(prior_s=0.3)
    gate.record_step(1024, 2.8)  # 2.73 ms per token
    gate.record_step(8, 1.0)  # a decode step: ignored (fixed costs dominate it)
    assert gate.snapshot()["prefill_samples"] == 1
    # Before a pull was measured: the prior (0.3 s) against 224 tokens' prefill (0.61 s): pull.
    assert gate.decide(224).pull
    gate.record_load(992, 0.9)
    short = gate.decide(224)  # a pull of fewer tokens is priced at least as the measured one
    assert not short.pull and short.load_s == pytest.approx(0.9) and short.prefill_s == pytest.approx(0.6125)
    assert "load 0.900 s >= prefill 0.612 s" in short.reason
    long = gate.decide(2016)  # of more tokens: linearly from the measured one
    assert long.pull and long.load_s == pytest.approx(0.9 * 2016 / 992)
    # The break-even lies between: the gate never predicts a pull cheaper than a measured larger one.
    assert not gate.decide(320).pull and gate.decide(352).pull


def test_the_estimates_follow_the_recent_samples() -> None:
    gate = PullGate(prior_s=0.0, window=3)
    for _ in range(3):
        gate.record_step(MIN_STEP_TOKENS, MIN_STEP_TOKENS * 0.001)
    gate.record_load(1000, 5.0)  # one slow outlier among fast pulls does not decide alone
    gate.record_load(1000, 0.2)
    gate.record_load(1000, 0.3)
    assert gate.load_s(1000) == pytest.approx(0.3) and gate.decide(1000).pull
    for _ in range(3):
        gate.record_step(1000, 0.1)  # the engine became 10x faster: the old samples are gone
    assert gate.prefill_s(1000) == pytest.approx(0.1) and not gate.decide(1000).pull


def test_bad_gate_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="prior_s"):
        PullGate(prior_s=-1.0)
    with pytest.raises(ValueError, match="window"):
        PullGate(window=0)
    with pytest.raises(ConfigError, match=r"\['pull_gate'\] must be true or false"):
        ConnectorConfig.from_extra({"agent": "a", "pull_gate": "maybe"}, environ={})
    with pytest.raises(ConfigError, match="pull_overhead_s"):
        ConnectorConfig.from_extra({"agent": "a", "pull_overhead_s": -0.1}, environ={})
    reply = LookupReply(local=8, declined=40)
    assert LookupReply.decode(reply.encode()) == reply


async def test_a_lookup_declines_a_pull_slower_than_the_prefill(nats_url: str, scheduler: object) -> None:
    """Real agents on a real NATS: B measured a fast prefill and a slow pull, so its lookup offers nothing."""
    a = await _client("vworth-a", nats_url)
    b = await _client("vworth-b", nats_url)
    ungated = await _client("vworth-c", nats_url, pull_gate=False)
    try:
        kv = _context(45, seed=21)
        a.save(kv, "r1")
        await a.settled()
        ids = kv.tokens[0].tolist()
        # Nothing measured yet: the hit is offered.
        assert (await b.lookup(ids, 45)).remote == 40
        b.gate.record_step(1024, 0.1)  # ~0.1 ms per token: 40 tokens prefill in 4 ms
        b.gate.record_load(40, 0.5)
        events: list[bytes] = []
        assert b.bus is not None

        async def on_event(msg: object) -> None:
            events.append(msg.data)  # type: ignore[attr-defined]

        sub = await b.bus.transport.subscribe("kvbus.vllm.events.vworth-b", on_event)
        await b.bus.transport.flush()
        reply = await b.lookup(ids, 45)
        assert (reply.local, reply.remote, reply.holder, reply.tier, reply.declined) == (0, 0, "", 0, 40)
        for _ in range(50):
            if events:
                break
            await asyncio.sleep(0.02)
        from kvbus.integrations.vllm.protocol import Event

        ev = Event.decode(events[0])
        assert ev.kind == "decline" and ev.tokens == 40 and ev.peer == "vworth-a" and ev.seconds == pytest.approx(0.5)
        await sub.unsubscribe()
        # The same measurements with the gate off: the pull is offered.
        ungated.gate.record_step(1024, 0.1)
        ungated.gate.record_load(40, 0.5)
        assert (await ungated.lookup(ids, 45)).remote == 40
        # A long prefix still pays: B's lookup of 40 tokens becomes worth it when its prefill slows.
        for _ in range(16):
            b.gate.record_step(1024, 100.0)
        assert (await b.lookup(ids, 45)).remote == 40
    finally:
        for c in (a, b, ungated):
            await c.close()


def test_the_prefill_sample_spans_the_forward_in_vllms_call_order() -> None:
    """vLLM binds the step's metadata, runs the forward, and only then calls start_load_kv when
    every load is asynchronous, right before wait_for_save. Timed from start_load_kv, a forward
    measured ~0 s and the gate declined every pull (bench vllm: 992 of 992 tokens at 1024)."""
    import time

    import torch

    from kvbus.integrations.vllm.client import KVBusClient
    from kvbus.integrations.vllm.metadata import KVBusConnectorMetadata
    from kvbus.integrations.vllm.worker_side import WorkerSide
    from kvbus.signature import ModelSignature

    config = ConnectorConfig.from_extra({"agent": "vworth-w"}, environ={})
    signature = ModelSignature("worth", n_layers=2, n_kv_heads=1, head_dim=8)
    side = WorkerSide(config, signature, block_size=16)
    side.client = KVBusClient(config, signature, block_size=16, dtype=torch.float32)
    meta = KVBusConnectorMetadata(step_tokens=512)
    side.forward_starts(meta)  # bind_connector_metadata, just before the forward
    time.sleep(0.05)  # the forward
    side.start_load_kv(meta)  # asynchronous loads only: after the forward
    side.wait_for_save(meta)
    prefill = side.client.gate.prefill_s(512)
    assert prefill is not None and prefill >= 0.05
