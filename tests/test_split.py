"""The ``split`` medium: the receiver prefills a prefix from its ids while the rest streams as KV,
and the scheduler sizes the prefix where the prefill and the stream meet."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvbus.app.models import random_model
from kvbus.bus import Bus
from kvbus.codecs import Encoded, get_codec
from kvbus.codecs.errors import CodecError, DecodeError, RecomputeUnavailable
from kvbus.codecs.split import MAX_PREFIX_IDS, META_KEY, prefix_length
from kvbus.group_scheduler import GroupScheduler
from kvbus.group_scheduler.cost_model import FALLBACK_FIGURES, CostModel, Endpoint, Link, ModelCosts, split_loss_scale
from kvbus.kvcache import KVCache
from tests.conftest import FAST
from tests.test_codecs_media import kv_caches

RUNNER = random_model(n_layers=2, n_kv_heads=2, head_dim=16, n_heads=4, vocab_size=256, seed=5)


def context(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_the_spec_names_the_prefix_and_composes_with_kv_media_only() -> None:
    assert get_codec("split").name == "split+full"
    assert get_codec("split(0.65)+int4").name == "split(0.65)+int4"
    assert get_codec("split(prefix=0.5)+int8").name == "split+int8"  # the default is omitted
    assert get_codec("split+topk+int8").name == "split+topk+int8"
    for bad in ("split+tokens", "split+summary", "split(1.5)+int4", "split(-0.1)", "delta+split+int4", "int4+split"):
        with pytest.raises(ValueError):
            get_codec(bad)
    codec = get_codec("split(0.3)+int8")
    assert codec.recomputes and codec.needs_kv and not codec.is_lossless
    assert get_codec("split+full").is_lossless


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kv=kv_caches(sparse=False),
    fraction=st.floats(0.0, 1.0),
    inner=st.sampled_from(["full", "int8", "int4"]),
)
def test_a_split_context_decodes_to_the_whole_context(kv: KVCache, fraction: float, inner: str) -> None:
    """Against a base that holds the prefix (the sender's own cache here) the rest joins it: the
    whole context, exact with a lossless inner medium, within the inner medium's bounds else."""
    assume(kv.has_kv and kv.seq_len == kv.n_tokens)
    codec = get_codec(f"split({fraction})+{inner}")
    enc = codec.encode(kv)
    k = prefix_length(fraction, kv.n_tokens, kv.batch)
    assert enc.meta[META_KEY]["prefix"] == k and len(enc.meta[META_KEY]["ids"]) == 4 * k * kv.batch
    again = Encoded.from_payload(
        enc.codec, enc.meta, b"".join(bytes(b) for b in enc.buffers), [len(b) for b in enc.buffers]
    )
    out = get_codec(enc.codec).decode(again, base=kv)
    assert torch.equal(out.tokens, kv.tokens) and out.seq_len == kv.seq_len
    for got, want in zip([*out.keys, *out.values], [*kv.keys, *kv.values]):
        assert got.shape == want.shape and got.dtype == want.dtype
        if inner == "full":
            assert torch.equal(got, want)
        else:
            assert torch.equal(got[:, :, :k], want[:, :, :k])  # the prefix is the base's, untouched
    if k and kv.n_tokens:
        with pytest.raises(RecomputeUnavailable):  # no base holds the prefix, no model to rebuild it
            get_codec(enc.codec).decode(again)


def test_the_receiver_recomputes_the_prefix_with_its_model() -> None:
    kv = RUNNER.prefill(context(48, 1))
    codec = get_codec("split(0.6)+full")
    enc = codec.encode(kv)
    work = codec.prepare(enc.meta, RUNNER)
    assert work is not None
    prefix = work()
    assert prefix.n_tokens == prefix_length(0.6, 48) == 29
    out = codec.decode(enc, base=prefix, runner=RUNNER)
    # The prefix's KV depends on the prefix alone: recomputed, it is the sender's (float rounding apart).
    assert torch.equal(out.tokens, kv.tokens)
    for got, want in zip(out.keys, kv.keys):
        assert torch.allclose(got, want, atol=1e-5)
    # Without the prepared prefix the decode prefills it itself; a base of other tokens is not used.
    other = RUNNER.prefill(context(48, 2))
    again = codec.decode(enc, base=other, runner=RUNNER)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(again.keys, kv.keys))
    assert codec.prepare(enc.meta, None) is None


_META = st.one_of(
    st.none(),
    st.integers(-(2**40), 2**40),
    st.binary(max_size=64),
    st.text(max_size=8),
    st.lists(st.integers(-5, 300), max_size=8),
)


@settings(max_examples=300, deadline=None)
@given(
    prefix=_META,
    batch=_META,
    ids=_META,
    drop=st.sampled_from([None, "prefix", "batch", "ids"]),
    own=st.sampled_from(["map", "missing", "list"]),
)
def test_hostile_split_metadata_is_refused_with_a_codec_error(
    prefix: Any, batch: Any, ids: Any, drop: str | None, own: str
) -> None:
    """Whatever the ``split`` field holds, `prepare` and `decode` raise a `CodecError` or accept a
    consistent prefix (never read past ``ids``, never allocate from a size they were told)."""
    kv = RUNNER.prefill(context(12, 3))
    codec = get_codec("split(0.5)+full")
    enc = codec.encode(kv)
    field = {"prefix": prefix, "batch": batch, "ids": ids}
    if drop:
        del field[drop]
    meta = dict(enc.meta)
    if own == "map":
        meta[META_KEY] = field
    elif own == "missing":
        del meta[META_KEY]
    else:
        meta[META_KEY] = list(field.values())
    try:
        work = codec.prepare(meta, RUNNER)
    except CodecError:
        work = None
    else:
        if work is not None:
            got = work()
            assert got.n_tokens <= MAX_PREFIX_IDS
    try:
        out = codec.decode(Encoded(codec=enc.codec, meta=meta, buffers=enc.buffers), runner=RUNNER)
    except CodecError:
        return
    out.validate()
    assert out.n_tokens == out.seq_len <= 12 + MAX_PREFIX_IDS


def test_prefix_ids_outside_the_vocabulary_or_of_the_wrong_size_are_refused() -> None:
    codec = get_codec("split+full")
    enc = codec.encode(RUNNER.prefill(context(10, 4)))
    meta = dict(enc.meta)
    bad = torch.full((1, 5), 9999, dtype=torch.int32).numpy().tobytes()
    meta[META_KEY] = {"prefix": 5, "batch": 1, "ids": bad}
    with pytest.raises(DecodeError, match="vocab|range|token"):
        codec.prepare(meta, RUNNER)
    meta[META_KEY] = {"prefix": 5, "batch": 1, "ids": b"\x00" * 19}
    with pytest.raises(DecodeError, match="19 bytes"):
        codec.prepare(meta, RUNNER)
    meta[META_KEY] = {"prefix": MAX_PREFIX_IDS, "batch": 2, "ids": b""}
    with pytest.raises(DecodeError, match="over the limit"):
        codec.prepare(meta, RUNNER)


# -- the cost model sizes the prefix -------------------------------------------------------------------------


SIG = RUNNER.signature
COSTS = ModelCosts(prefill_tokens_per_s=500.0, decode_token_s=0.03)


def _choose(bandwidth_bps: float, candidates: tuple[str, ...], n: int = 400) -> Any:
    model = CostModel()
    ep = Endpoint(SIG, model=COSTS)
    kv_bytes = n * 400_000 // 10  # 40 KB per token: a large model's KV
    return model.choose(
        candidates, n_tokens=n, kv_bytes=kv_bytes, link=Link(bandwidth_bps, rtt_s=0.01), sender=ep, receiver=ep
    )


def test_where_prefill_and_link_take_alike_split_beats_both_by_overlapping_them() -> None:
    # 400 tokens: 0.8 s of prefill, or 16 MB of KV at 20 MB/s (0.8 s). About half and half overlap.
    choice = _choose(2e7, ("tokens", "full", "split+full"))
    by = {e.medium.split("(")[0].split("+")[0]: e for e in choice.candidates}
    split = by["split"]
    assert choice.medium == split.medium
    assert split.total_s < 0.7 * min(by["tokens"].total_s, by["full"].total_s)
    # The prefix is sized where its prefill meets the rest's stream.
    fraction = float(split.medium[len("split(") : split.medium.index(")")]) if "(" in split.medium else 0.5
    assert 0.3 < fraction < 0.7
    assert split.recompute_s <= 0.15 * split.total_s  # the prefill hides behind the stream
    assert get_codec(split.medium).name == split.medium  # a medium the sender can encode as named
    # On a ten times slower link most of the context is recomputed, and split still wins.
    slow = _choose(2e6, ("tokens", "full", "split+full"))
    assert slow.medium.startswith("split(0.9") and slow.estimate.total_s < min(
        e.total_s for e in slow.candidates if not e.medium.startswith("split")
    )


def test_a_split_measured_not_to_hide_its_prefill_is_priced_at_what_it_took() -> None:
    # bench select (testbed, 2048 tokens at 10 Mbit/s): split(0.75)+int4 was predicted to hide
    # its prefill behind the stream (3.5 s) and took prefill + stream (7.2 s) five times in a
    # row, where tokens took 4.4 s. The learned bias multiplied only the prefill's exposed part,
    # zero when the model thinks it hidden: nothing was ever learned.
    model = CostModel()
    ep = Endpoint(SIG, model=COSTS)
    kw: dict[str, Any] = dict(n_tokens=400, kv_bytes=16_000_000, link=Link(1e7, rtt_s=0.01), sender=ep, receiver=ep)
    media = ("tokens", "full", "split+full")

    def took(e: Any) -> float:
        """What a transfer in ``e``'s medium takes here: a split's prefill does not overlap at all."""
        return e.comm_s + e.comp_s - e.recompute_s + e.split_prefill_s if e.medium.startswith("split") else e.total_s

    first = model.choose(media, **kw)
    est = first.estimate
    assert first.medium.startswith("split") and est.recompute_s < 0.2 * est.split_prefill_s  # mostly hidden
    assert est.total_s < 0.75 * took(est)
    best_other = min(e.total_s for e in first.candidates if not e.medium.startswith("split"))
    current = first.medium
    for _ in range(4):
        choice = model.choose(media, **kw, current=current)
        e = choice.estimate
        if e.medium.startswith("split"):
            model.observe_split(
                e.medium,
                prefill_s=e.split_prefill_s,
                stream_s=e.split_stream_s,
                base_s=e.comm_s + e.comp_s - e.recompute_s,
                observed_s=took(e),
            )
        current = choice.medium
    assert model.bias["split+full"] > 1.5
    again = model.estimate(est.medium, **kw)  # the first split, priced again
    assert again.total_s >= 0.85 * took(again)
    assert took(model.choose(media, **kw, current=current).estimate) <= 1.1 * best_other
    # A split that took what it was predicted to take teaches nothing.
    fresh = CostModel()
    est = fresh.choose(media, **kw).estimate
    base = est.comm_s + est.comp_s - est.recompute_s
    fresh.observe_split(
        est.medium,
        prefill_s=est.split_prefill_s,
        stream_s=est.split_stream_s,
        base_s=base,
        observed_s=est.comm_s + est.comp_s,
    )
    assert fresh.bias["split+full"] == pytest.approx(1.0)


def test_a_splits_fidelity_is_the_one_its_decode_stamps_so_the_refresh_keeps_the_lineage() -> None:
    # bench select's relay: the estimate prorated a split's fidelity by its lossy share while the
    # decode stamps the inner medium's whole factor, and the lineage ended at 0.895 (threshold 0.9).
    model = CostModel()
    ep = Endpoint(SIG, model=COSTS)
    kw: dict[str, Any] = dict(n_tokens=400, kv_bytes=16_000_000, link=Link(1e7, rtt_s=0.01), sender=ep, receiver=ep)
    est = model.estimate("split(0.5)+int8", **kw)
    kv = RUNNER.prefill(context(40, 9))
    codec = get_codec("split(0.5)+int8")
    got = codec.decode(codec.encode(kv), runner=RUNNER)
    assert got.fidelity == pytest.approx(codec.inner.fidelity)  # the inner medium's whole factor
    assert est.fidelity == model.estimate("int8", **kw).fidelity  # and so is the estimate's
    threshold = model.config.refresh_threshold
    assert not model.refresh_allows(est, threshold / est.fidelity * 0.999)
    assert model.refresh_allows(est, threshold / est.fidelity * 1.001)


def test_on_a_fast_link_the_whole_kv_beats_a_split() -> None:
    choice = _choose(5e9, ("tokens", "full", "split+full"))
    assert choice.medium == "full"
    # full arrives before even 5 % of the context is prefilled: the split is not weighed further
    # (a decision prices it for every split candidate; here it costs no second estimate).
    split = next(e for e in choice.candidates if e.medium.startswith("split"))
    assert not split.usable and "alone is faster" in split.why_not
    # Without full among the candidates the split is priced all the same (it may be the best left).
    alone = _choose(5e9, ("tokens", "split+full"))
    assert all(e.usable for e in alone.candidates)


def test_a_lossy_split_takes_the_prefix_whose_saved_loss_outweighs_its_prefill() -> None:
    # Only the prefix where the prefill meets the stream and the next step were compared: a lossy
    # inner medium kept that short prefix however much of the rest's loss a longer one saved.
    model = CostModel()
    ep = Endpoint(SIG, model=ModelCosts(prefill_tokens_per_s=2000.0, decode_token_s=1.0))  # loss weighs much
    kw: dict[str, Any] = dict(n_tokens=400, kv_bytes=16_000_000, link=Link(1e8, rtt_s=0.01), sender=ep, receiver=ep)
    chosen = model.estimate("split+int4", **kw)
    grid = {f: model.estimate(f"split({f})+int4", **kw) for f in (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95)}
    assert chosen.medium == "split(0.95)+int4", chosen.medium
    assert chosen.total_s <= min(e.total_s for e in grid.values()) + 1e-9
    assert chosen.total_s < 0.5 * grid[0.25].total_s  # where the two-step search stopped
    # With nothing to save (a lossless rest) the prefix stays where the prefill meets the stream.
    assert model.estimate("split+full", **kw).medium != "split(0.95)+full"


def test_a_calibrated_split_loses_what_calibration_measured_behind_the_prefix() -> None:
    # The loss of split(f)+X was X's times the share sent in X, a prior: `bench select` measured
    # split+int8 at a fidelity of 0.998 where int8 alone had 0.990, and calibration finds most of
    # a quantised cache's error in its first tokens, which a split recomputes exact.
    assert split_loss_scale(0.99, None, 0.05) == 1.0  # not measured: the prior
    assert split_loss_scale(0.99, 0.995, 0.05) == pytest.approx(0.5 / 0.95)
    assert split_loss_scale(0.99, 0.98, 0.05) == 1.0  # a prefix recomputed exact adds no error
    ep = Endpoint(SIG, model=ModelCosts(prefill_tokens_per_s=2000.0, decode_token_s=1.0))
    kw: dict[str, Any] = dict(n_tokens=400, kv_bytes=16_000_000, link=Link(1e8, rtt_s=0.01), sender=ep, receiver=ep)
    prior = CostModel()
    scale = 0.3
    calibrated = CostModel(
        {**FALLBACK_FIGURES, "split+int8": dataclasses.replace(FALLBACK_FIGURES["int8"], split_loss_scale=scale)}
    )
    whole = prior.estimate("int8", **kw).loss_s
    assert prior.estimate("split(0.5)+int8", **kw).loss_s == pytest.approx(whole * 0.5)
    assert calibrated.estimate("split(0.5)+int8", **kw).loss_s == pytest.approx(whole * 0.5 * scale)
    assert calibrated.estimate("split(0.05)+int8", **kw).loss_s == pytest.approx(whole * 0.95 * scale)


def test_a_profile_with_split_fidelity_gives_split_media_their_scale() -> None:
    from kvbus.codecs.calibration import SPLIT_PROBE, load_profile

    profile = dataclasses.replace(load_profile(), split_fidelity={"int8": 0.995})
    model = CostModel.from_profile(profile)
    int8 = model.figures["int8"].fidelity
    assert model.figures["split+int8"].split_loss_scale == pytest.approx(0.005 / (1 - int8) / (1 - SPLIT_PROBE))
    assert model.figures["split+int4"].split_loss_scale == 1.0  # not measured in this profile
    assert model.figures["int8"].split_loss_scale == 1.0


def test_a_lossy_split_with_an_exposed_prefill_is_offered_when_its_saved_loss_pays() -> None:
    # Found in `bench select` (128 tokens at 100 Mbit/s): the smallest prefix's prefill took longer
    # than int8's rest took to arrive, so split+int8 was declared unusable ("int8 alone is
    # faster") and int8 chosen, at an objective of 0.198 s; split+int8 measured 0.156 s, its exact
    # prefix saving more loss than its prefill cost.
    ep = Endpoint(SIG, model=ModelCosts(prefill_tokens_per_s=400.0, decode_token_s=0.1))
    kw: dict[str, Any] = dict(n_tokens=200, kv_bytes=2_000_000, link=Link(1e9, rtt_s=0.001), sender=ep, receiver=ep)
    model = CostModel(
        {**FALLBACK_FIGURES, "split+int8": dataclasses.replace(FALLBACK_FIGURES["int8"], split_loss_scale=0.2)}
    )
    alone = model.estimate("int8", **kw)
    split = model.estimate("split+int8", **kw, known={"int8": alone})
    assert split.usable, split.why_not
    assert split.total_s < alone.total_s
    # Where the prefix saves only its own share of the loss (the prior), that does not pay: refused.
    prior = CostModel()
    assert not prior.estimate("split+int8", **kw, known={"int8": prior.estimate("int8", **kw)}).usable


def test_a_split_at_a_given_prefix_is_priced_at_that_prefix() -> None:
    model = CostModel()
    ep = Endpoint(SIG, model=COSTS)
    kw: dict[str, Any] = dict(n_tokens=400, kv_bytes=16_000_000, link=Link(2.5e6), sender=ep, receiver=ep)
    low, high = (model.estimate(f"split({f})+full", **kw) for f in (0.1, 0.9))
    assert low.medium == "split(0.1)+full" and high.medium == "split(0.9)+full"
    assert low.nbytes > high.nbytes and low.comm_s > high.comm_s
    no_model = Endpoint(SIG, model=COSTS, recompute=False)
    assert not model.estimate("split+full", **{**kw, "receiver": no_model}).usable


# -- over the bus ----------------------------------------------------------------------------------------------


async def test_a_split_transfer_overlaps_the_prefill_with_the_stream(nats_url: str, scheduler: GroupScheduler) -> None:
    """Streamed (not inline), the receiver starts the prefix's prefill when the Open comes (its
    prefill speed is measured from it) and delivers the sender's context."""
    bus = await Bus.connect(nats_url, config=dataclasses.replace(FAST, inline_limit=0))
    try:
        tx = await bus.agent(f"sp-tx-{time.monotonic_ns()}", signature=SIG, runner=RUNNER)
        rx = await bus.agent(f"sp-rx-{time.monotonic_ns()}", signature=SIG, runner=RUNNER)
        kv = RUNNER.prefill(context(200, 6))
        report = await tx.send(rx.name, kv, medium="split(0.7)+full")
        got = await rx.receive(timeout=30)
        assert report.medium == got.medium == "split(0.7)+full"
        assert torch.equal(got.kv.tokens, kv.tokens)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got.kv.keys, kv.keys))
        assert rx.prefill.tokens_per_s > 0  # the prefill started on the Open measured this agent
        assert report.nbytes < kv.nbytes  # the prefix's KV did not travel
        # A scheduler-sized split: the sender asks for the family, the grant names the prefix.
        report = await tx.send(rx.name, kv, medium="split+int8")
        got = await asyncio.wait_for(rx.receive(timeout=30), 35)
        assert got.medium == "split+int8" or (got.medium.startswith("split(") and got.medium.endswith(")+int8"))
        assert torch.equal(got.kv.tokens, kv.tokens)
    finally:
        await bus.close()


async def test_a_slow_split_transfer_does_not_measure_its_link(scheduler: GroupScheduler) -> None:
    # Found in `bench select` (testbed, 10 Gbit/s, 128 tokens): the receiver prefills a split's
    # prefix while its bytes come and holds the GIL between the model's ops, so 5.6 MB took
    # 133 ms to arrive (full: 12 ms). Counted as a link sample it took the pair's estimate from
    # 2987 to 357 Mbit/s, and the next transfers went in int8 where full was faster.
    from kvbus.group_scheduler.learning import measures_link
    from kvbus.group_scheduler.state import Pending
    from kvbus.protocol import TransferDone, TransferRequest

    assert not measures_link("split(0.95)+full") and not measures_link("split+int8")
    assert measures_link("full") and measures_link("delta+int8") and measures_link("tokens")
    state = scheduler.state
    link = state.link("split-a", "split-b", "tcp")
    now = time.monotonic()
    for i in range(3):
        link.observe(370 << 20, 1.0, now + i)  # ~3 Gbit/s
    before = link.bandwidth_bps
    req = TransferRequest(
        transfer_id="s", src="split-a", dst=["split-b"], group=state.group, n_tokens=128, nbytes=6 << 20, signature={}
    )
    pending = Pending(req, {}, arrived=now)
    pending.decision = {"medium": "split(0.95)+full", "path": "tcp", "candidates": []}
    done = TransferDone(
        "s", "split-a", True, "split(0.95)+full", 5_622_736, 0.14, dst=["split-b"], wire_s=0.133, path="tcp"
    )
    scheduler.loop._learn(done, pending)
    assert link.bandwidth_bps == before
    # Its rate is a lower bound of the link's: one near the estimate is a sample (it keeps the
    # estimate of a pair that sends only splits from expiring; on a 10 Mbit/s link, where the
    # bytes' time is most of a split's, it expired and the next context went in int8: 12.9 s
    # against 2.2 s for tokens), and so is any on a link with no estimate.
    n = len(link.samples)
    scheduler.loop._learn(dataclasses.replace(done, wire_s=5_622_736 / (0.8 * before)), pending)
    assert len(link.samples) == n + 1
    fresh = state.link("split-a", "split-c", "tcp")
    scheduler.loop._learn(dataclasses.replace(done, dst=["split-c"]), pending)
    assert fresh.known
    # The same slow bytes in full are a sample of the link, and move the estimate.
    before = link.bandwidth_bps
    scheduler.loop._learn(dataclasses.replace(done, medium="full"), pending)
    assert link.bandwidth_bps < before
