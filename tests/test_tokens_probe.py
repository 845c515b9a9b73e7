"""``tokens(pad)``: the ids and padding, the scheduler's cheap probe of a link it has only sent ids
over since the link slowed down (issue 32). In `bench select`'s fluctuating trace the probes
were the context in int4: a probe that fell in a 10 Mbit/s phase cost seconds. The padded ids
cost the padding's bytes, and are delivered as ``tokens`` are."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbus.app.models import random_model
from kvbus.bus import Bus
from kvbus.codecs import get_codec
from kvbus.codecs.base import Encoded
from kvbus.codecs.errors import DecodeError, SpecError
from kvbus.group_scheduler import GroupScheduler
from kvbus.group_scheduler.learning import SMALL_PAYLOAD_BYTES
from kvbus.group_scheduler.selection import PROBE_PAD_BYTES
from tests.conftest import FAST

RUNNER = random_model(n_layers=2, n_kv_heads=2, head_dim=16, n_heads=4, vocab_size=256, seed=5)


def _context(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _wire(e: Encoded) -> Encoded:
    """What the receiver's decoder gets: the buffers as bytes."""
    return Encoded(codec=e.codec, meta=e.meta, buffers=[bytes(b) for b in e.buffers])


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 48), st.integers(0, 1 << 16))
def test_padded_ids_decode_to_the_ids_and_the_padding_is_checked(n: int, pad: int) -> None:
    codec = get_codec(f"tokens(pad={pad})")
    assert codec.name == ("tokens" if pad == 0 else f"tokens({pad})") and get_codec(codec.name).name == codec.name
    kv = RUNNER.prefill(_context(n))
    encoded = codec.encode(kv)
    assert encoded.nbytes == 8 * n + pad == codec.estimate_nbytes(RUNNER.signature, n)
    out = codec.decode(_wire(encoded), runner=RUNNER)
    assert torch.equal(out.tokens, kv.tokens) and out.fidelity == 1.0
    if pad:
        short = _wire(encoded)
        short.buffers[-1] = short.buffers[-1][:-1]
        with pytest.raises(DecodeError, match="padding"):
            codec.decode(short, runner=RUNNER)
        missing = Encoded(codec=encoded.codec, meta=encoded.meta, buffers=_wire(encoded).buffers[:-1])
        with pytest.raises(DecodeError, match="buffers"):
            codec.decode(missing, runner=RUNNER)
    # Unpadded ids under a padded name, and the other way round, are refused too.
    other = get_codec(f"tokens(pad={pad + 1})")
    with pytest.raises(DecodeError):
        other.decode(_wire(encoded), runner=RUNNER)


def test_an_absurd_padding_is_not_a_medium() -> None:
    for spec in ("tokens(pad=-1)", "tokens(pad=1e12)", f"tokens(pad={(16 << 20) + 1})", "tokens(pad=x)"):
        with pytest.raises(SpecError):
            get_codec(spec)


async def test_a_padded_probe_is_delivered_once_and_measures_the_link(nats_url: str, scheduler: GroupScheduler) -> None:
    bus = await Bus.connect(nats_url, config=FAST)
    try:
        tx = await bus.agent("tp-tx", signature=RUNNER.signature, runner=RUNNER)
        rx = await bus.agent("tp-rx", signature=RUNNER.signature, runner=RUNNER)
        kv = RUNNER.prefill(_context(64, seed=9))
        report = await tx.send(rx.name, kv, medium=f"tokens({PROBE_PAD_BYTES})")
        got = await rx.receive(timeout=30)
        assert report.medium == f"tokens({PROBE_PAD_BYTES})" and report.nbytes >= SMALL_PAYLOAD_BYTES
        assert torch.equal(got.kv.tokens, kv.tokens) and got.kv.n_layers == RUNNER.signature.n_layers
        with pytest.raises(asyncio.TimeoutError):
            await rx.receive(timeout=0.3)  # once
        assert rx.prefill.tokens == 64.0  # a recompute like any tokens delivery
        deadline = time.monotonic() + 10
        path = report.path
        while time.monotonic() < deadline and not scheduler.state.link(tx.name, rx.name, path).known:
            await asyncio.sleep(0.05)
        assert scheduler.state.link(tx.name, rx.name, path).known  # its bytes were a link sample
    finally:
        await bus.close()


async def test_a_probe_that_went_inline_through_nats_moves_the_estimate_of_the_path_it_probed(
    nats_url: str, scheduler: GroupScheduler
) -> None:
    """The padded ids fit in the `Open` and cross NATS, while the pair's KV goes on ``tcp``: in
    bench select's fluctuating trace every probe measured NATS and the tcp estimate stayed at the
    slow phase's 24 Mbit/s through the 800 Mbit/s phase after it."""
    from kvbus.group_scheduler.state import Pending
    from kvbus.protocol import TransferDone, TransferRequest

    state = scheduler.state
    tcp = state.link("a", "b", "tcp")
    now = time.monotonic()
    for i in range(3):
        tcp.observe(100 << 20, 1.0, now + i)
    tcp.observe(3 << 20, 1.0, now + 3)  # the link dropped to 3 MB/s
    slow = tcp.bandwidth_bps
    nbytes = PROBE_PAD_BYTES + 8 * 256
    req = TransferRequest(
        transfer_id="p", src="a", dst=["b"], group=state.group, n_tokens=256, nbytes=11 << 20, signature={}
    )
    pending = Pending(req, {}, arrived=now)
    pending.decision = {"medium": f"tokens({PROBE_PAD_BYTES})", "explored_link": True, "path": "tcp", "candidates": []}
    done = TransferDone("p", "a", True, f"tokens({PROBE_PAD_BYTES})", nbytes, 0.5, dst=["b"], wire_s=0.001, path="nats")
    scheduler.loop._learn(done, pending)
    assert state.link("a", "b", "nats").known
    assert tcp.bandwidth_bps > 10 * slow  # the probe saw ~66 MB/s: the tcp estimate follows at once
    # An ordinary transfer on NATS teaches NATS only.
    pending.decision = {**pending.decision, "explored_link": False}
    tcp_before = tcp.bandwidth_bps
    scheduler.loop._learn(dataclasses.replace(done, wire_s=0.1), pending)
    assert tcp.bandwidth_bps == tcp_before
