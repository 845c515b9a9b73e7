"""Property tests of every medium: round trips, error bounds, composition, delta bases, hostile input."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvbus.codecs import (
    Codec,
    DecodeError,
    DeltaBaseMismatch,
    Encoded,
    SpecError,
    SummaryCodec,
    SummaryUnavailable,
    TailSummarizer,
    UnknownCodec,
    available_codecs,
    canonical_spec,
    get_codec,
    prefix_version,
)
from kvbus.codecs._select import coverage, kv_positions
from kvbus.codecs.spec import medium_spec
from kvbus.codecs.topk import choose_entries
from kvbus.errors import KVBusError
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature, dtype_name

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
VOCAB = 1000
PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: Every KV medium and composition the round-trip properties run over.
KV_SPECS = [
    "full",
    "int8",
    "int4",
    "int4(4)",
    "topk",
    "topk(0.5,sink=2,window=3)+int8",
    "topk+int4",
    "lowrank",
    "lowrank(3)",
    "delta+full",
    "delta+int8",
    "delta+topk+int4",
]
ALL_SPECS = [*KV_SPECS, "tokens", "delta+tokens", "summary"]


# -- strategies ---------------------------------------------------------------------------------


@st.composite
def kv_caches(
    draw: st.DrawFn, *, max_seq: int = 40, with_kv: bool = True, sparse: bool = True, dtypes: list[torch.dtype] = DTYPES
) -> KVCache:
    """Random caches: batch 1-2, layers 1-2, heads 1-3, seq 0..max_seq, head_dim 1..48, a dtype of ``dtypes``."""
    batch = draw(st.integers(1, 2))
    layers = draw(st.integers(1, 2))
    heads = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([1, 2, 5, 16, 32, 48]))
    seq = draw(st.sampled_from([0, 1]) | st.integers(0, max_seq))
    n_tokens = seq + draw(st.integers(0, 3))
    dtype = draw(st.sampled_from(dtypes))
    kind = draw(st.sampled_from(["randn", "zeros", "outliers", "tiny", "const"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    sig = ModelSignature(
        model="test-model",
        n_layers=layers,
        n_kv_heads=heads,
        head_dim=head_dim,
        dtype=dtype_name(dtype),
        vocab_size=VOCAB,
    )
    tokens = torch.randint(0, VOCAB, (batch, n_tokens), generator=g)

    def layer() -> torch.Tensor:
        shape = (batch, heads, seq, head_dim)
        x = torch.randn(shape, generator=g)
        if kind == "zeros":
            x = torch.zeros(shape)
        elif kind == "outliers":
            x[..., 0] *= 50.0
        elif kind == "tiny":
            x *= 1e-6
        elif kind == "const":
            x = torch.full(shape, 0.375)
        return x.to(dtype)

    keys = [layer() for _ in range(layers)] if with_kv else []
    values = [layer() for _ in range(layers)] if with_kv else []
    positions = None
    if with_kv and sparse and draw(st.booleans()):
        positions = torch.sort(torch.randperm(n_tokens, generator=g)[:seq]).values if n_tokens else None
    fidelity = draw(st.sampled_from([1.0, 0.75]))
    return KVCache(tokens=tokens, signature=sig, keys=keys, values=values, positions=positions, fidelity=fidelity)


def wire(encoded: Encoded) -> Encoded:
    """What a receiver gets: msgpack'd metadata and one contiguous payload split by sizes."""
    meta = msgpack.unpackb(msgpack.packb(encoded.meta))
    return Encoded.from_payload(encoded.codec, meta, b"".join(encoded.buffers), encoded.sizes)


def dense(kv: KVCache, like: KVCache) -> list[torch.Tensor]:
    """``kv``'s tensors scattered to ``like``'s positions (zeros where ``kv`` dropped an entry), float64."""
    src = kv_positions(kv)
    where = {int(p): i for i, p in enumerate(kv_positions(like))}
    idx = torch.tensor([where[int(p)] for p in src], dtype=torch.int64)
    out = []
    for t, ref in zip(kv.keys + kv.values, like.keys + like.values):
        full = torch.zeros(ref.shape, dtype=torch.float64)
        full[:, :, idx] = t.double()
        out.append(full)
    return out


# -- registry and spec language -------------------------------------------------------------------


def test_every_medium_is_registered() -> None:
    assert set(available_codecs()) == {"full", "int8", "int4", "topk", "lowrank", "delta", "split", "tokens", "summary"}


@pytest.mark.parametrize(
    "spec,canonical",
    [
        ("int4", "int4"),
        ("int4(g=32)", "int4"),
        ("int4(64)", "int4(64)"),
        (" INT4 ( g = 64 ) ", "int4(64)"),
        ("topk", "topk+full"),
        ("topk(0.25)+int8", "topk+int8"),
        ("topk(keep=0.5, sink=8)+int4", "topk(0.5,sink=8)+int4"),
        ("topk(window=16)", "topk(window=16)+full"),
        ("lowrank(64)", "lowrank"),
        ("lowrank(rank=32)", "lowrank(32)"),
        ("delta", "delta+full"),
        ("delta+full", "delta+full"),
        ("delta+int8", "delta+int8"),
        ("delta+topk(0.25)+int8", "delta+topk+int8"),
        ("delta+tokens", "delta+tokens"),
        ("summary(128)", "summary(128)"),
        ("topk(1)", "topk(1.0)+full"),
        ("topk(.5)", "topk(0.5)+full"),
    ],
)
def test_specs_canonicalise_and_round_trip(spec: str, canonical: str) -> None:
    codec = get_codec(spec)
    assert codec.name == canonical == canonical_spec(spec)
    again = get_codec(codec.name)
    assert again.name == codec.name and again == codec and type(again) is type(codec)


@pytest.mark.parametrize(
    "spec,match",
    [
        ("", "empty"),
        ("int8(", "unbalanced"),
        ("int8)", "unbalanced"),
        ("topk((1))", "nested"),
        ("int8+full", "must come last"),
        ("summary+int8", "must come last"),
        ("delta+summary", "cannot wrap"),
        ("topk+tokens", "cannot wrap"),
        ("topk+delta+int8", "cannot wrap"),
        ("delta+delta", "cannot wrap"),
        ("topk+topk", "cannot wrap"),
        ("topk(0)", "> 0"),
        ("topk(1.5)", "<= 1"),
        ("topk(nan)", "not one of|number"),
        ("int4(g=1)", ">= 2"),
        ("int4(2.5)", "integer"),
        ("int4(g=32,g=64)", "twice"),
        ("int8(1)", "no parameters"),
        ("topk(0.2,0.3)", "one positional"),
        ("topk(keep=0.2,0.3)", "positional argument after"),
        ("topk(bogus=1)", "no parameter"),
        ("lowrank(rank=x)", "number"),
        ("int4(g=)", "not a number"),
        ("full+full+full+full+full", "stages"),
        ("int8" * 100, "longer"),
        ("full+", "empty stage"),
    ],
)
def test_bad_specs_raise_clear_value_errors(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        get_codec(spec)
    assert isinstance(info.value, (SpecError, UnknownCodec)) and isinstance(info.value, KVBusError)


@pytest.mark.parametrize("spec", ["zstd", "zstd(3)", "int8+zstd", "delta+gzip"])
def test_unknown_media_list_the_known(spec: str) -> None:
    with pytest.raises(UnknownCodec, match="delta.*full.*int4.*int8.*lowrank.*summary.*tokens.*topk"):
        get_codec(spec)


@pytest.mark.parametrize("spec", [None, 7, b"int8", ["int8"]])
def test_non_string_specs_are_rejected(spec: Any) -> None:
    with pytest.raises(ValueError):
        get_codec(spec)


@given(st.text(max_size=40))
@settings(max_examples=200, deadline=None)
def test_any_text_either_parses_or_raises_a_value_error(text: str) -> None:
    try:
        codec = get_codec(text)
    except ValueError as exc:
        assert isinstance(exc, KVBusError)
        return
    assert get_codec(codec.name).name == codec.name


def test_composition_flags() -> None:
    assert get_codec("delta+full").lossless and get_codec("delta+tokens").lossless
    assert not get_codec("delta+int8").lossless and not get_codec("topk+full").lossless
    assert not get_codec("delta+tokens").needs_kv and get_codec("delta+int8").needs_kv
    assert not get_codec("summary").needs_kv and not get_codec("summary").lossless
    fids = {s: get_codec(s).fidelity for s in ["int8", "int4", "topk", "lowrank", "summary"]}
    assert all(0 < f < 1 for f in fids.values())
    assert fids["summary"] == min(fids.values()), "summary must be the most lossy medium"
    assert get_codec("full").fidelity == get_codec("delta+full").fidelity == get_codec("tokens").fidelity == 1.0


@pytest.mark.parametrize(
    ("spec", "delta", "inner", "outer", "kind"),
    [
        ("delta+int8", True, "int8", "delta", "int8"),
        ("delta", True, "full", "delta", "delta"),
        ("Delta + TopK(0.25) + int8", True, "topk(0.25)+int8", "delta", "int8"),
        ("int4(64)", False, "int4(64)", "int4", "int4"),
        ("summary", False, "summary", "summary", "summary"),
        ("delta+tokens", True, "tokens", "delta", "tokens"),
    ],
)
def test_medium_spec_says_what_a_spec_is_made_of(spec: str, delta: bool, inner: str, outer: str, kind: str) -> None:
    parsed = medium_spec(spec)
    assert (parsed.delta, parsed.inner, parsed.outer, parsed.kind) == (delta, inner, outer, kind)
    assert get_codec(parsed.name).name == get_codec(spec).name
    if delta:
        assert get_codec(parsed.inner).name == get_codec(spec).inner.name  # type: ignore[union-attr]
    assert parsed.with_delta().delta and medium_spec(parsed.with_delta().name) == parsed.with_delta()


@given(st.text(max_size=40))
@settings(max_examples=200, deadline=None)
def test_medium_spec_agrees_with_the_codec_it_names(text: str) -> None:
    try:
        codec = get_codec(text)
    except ValueError:
        return
    parsed = medium_spec(text)
    assert parsed.delta == (codec.stage == "delta")
    assert get_codec(parsed.name).name == codec.name


# -- round trips ----------------------------------------------------------------------------------


def _encode(spec: str, kv: KVCache) -> tuple[Codec, Encoded]:
    codec = get_codec(spec)
    return codec, codec.encode(kv)


@PROPERTY
@given(kv=kv_caches(), spec=st.sampled_from(KV_SPECS))
def test_kv_media_round_trip_within_their_bounds(kv: KVCache, spec: str) -> None:
    before = kv.clone()
    codec, encoded = _encode(spec, kv)
    assert encoded.codec == codec.name
    out = get_codec(encoded.codec).decode(wire(encoded))
    assert kv.equal(before), "encoding modified its input"
    out.validate()
    assert torch.equal(out.tokens, kv.tokens) and out.signature == kv.signature
    assert out.dtype == kv.dtype and out.has_kv == kv.has_kv
    if kv.has_kv:
        assert out.fidelity == pytest.approx(kv.fidelity * codec.fidelity)
    else:
        assert out.fidelity == pytest.approx(kv.fidelity)
    kept = kv_positions(out)
    assert set(kept.tolist()) <= set(kv_positions(kv).tolist())
    if "topk" not in spec:
        assert out.seq_len == kv.seq_len
    if not kv.has_kv or not kv.seq_len:
        return
    ref = [t.double() for t in kv.keys + kv.values]
    got = dense(out, kv)
    for y in got:
        assert bool(torch.isfinite(y).all())
    if codec.lossless:
        assert out.equal(kv) or all(torch.equal(a, b) for a, b in zip(ref, got))
    total = math.sqrt(sum(float(x.square().sum()) for x in ref))
    err = math.sqrt(sum(float((x - y).square().sum()) for x, y in zip(ref, got)))
    if total > 0 and "topk" not in spec:
        bound = {"int8": 0.03, "int4": 0.3}
        for name, b in bound.items():
            if name in spec:
                assert err / total <= b, (spec, err / total)
    if spec.startswith("int4"):  # element-wise: within half a step of its group (plus dtype rounding)
        for x, y in zip(ref, got):
            span = float(x.max() - x.min())
            assert float((x - y).abs().max()) <= span / 15 / 2 * 1.05 + 1e-2 * float(x.abs().max()) + 1e-30


@PROPERTY
@given(kv=kv_caches(sparse=False, dtypes=[torch.float32]), rank=st.integers(1, 8))
def test_lowrank_is_exact_at_full_rank_and_optimal_below(kv: KVCache, rank: int) -> None:
    assume(kv.has_kv and kv.seq_len)
    full_rank = kv.signature.n_kv_heads * kv.signature.head_dim
    out = get_codec(f"lowrank({full_rank})").decode(wire(get_codec(f"lowrank({full_rank})").encode(kv)))
    for x, y in zip(kv.keys + kv.values, out.keys + out.values):
        assert torch.allclose(x, y, atol=1e-4 * (1 + float(x.abs().max())))
    low = get_codec(f"lowrank({rank})").decode(wire(get_codec(f"lowrank({rank})").encode(kv)))
    for x, y in zip(kv.keys + kv.values, low.keys + low.values):
        rows = x.permute(0, 2, 1, 3).reshape(-1, x.shape[1] * x.shape[3]).double()
        sv = torch.linalg.svdvals(rows)
        optimal = float(sv[rank:].square().sum().sqrt())  # Eckart-Young: no rank-r approximation does better
        assert float((x.double() - y.double()).norm()) <= optimal * 1.01 + 1e-5 * (1 + float(rows.norm()))


def test_int4_beats_per_token_on_outlier_channels_and_packs_two_per_byte() -> None:
    g = torch.Generator().manual_seed(5)
    sig = ModelSignature(model="m", n_layers=1, n_kv_heads=2, head_dim=64, vocab_size=VOCAB)
    k = torch.randn(1, 2, 128, 64, generator=g)
    k[..., :3] *= 40.0  # outlier key channels
    kv = KVCache(
        tokens=torch.randint(0, VOCAB, (1, 128), generator=g),
        signature=sig,
        keys=[k],
        values=[torch.randn(1, 2, 128, 64, generator=g)],
    )
    enc = get_codec("int4").encode(kv)
    codes = 2 * 128 * 64 // 2
    assert enc.sizes[-2:] == [codes, codes]
    assert enc.nbytes < get_codec("full").encode(kv).nbytes / 5
    out = get_codec("int4").decode(wire(enc))
    err_kivi = float((out.keys[0] - k).norm() / k.norm())
    from kvbus.codecs._kernels import int4_decode, int4_encode

    p, s, lo = int4_encode(k.transpose(2, 3).contiguous(), 3, 64)  # per-token-style groups over the channels
    per_token = int4_decode(p, s, lo, (1, 2, 64, 128), 3, 64).transpose(2, 3)
    assert err_kivi < float((per_token - k).norm() / k.norm())
    assert err_kivi < 0.1


# -- topk --------------------------------------------------------------------------------------------


@given(n=st.integers(0, 300), keep=st.integers(0, 300), sink=st.integers(0, 10), recent=st.integers(0, 40))
@settings(max_examples=100, deadline=None)
def test_choose_entries_keeps_recent_then_sinks_within_the_budget(n: int, keep: int, sink: int, recent: int) -> None:
    scores = torch.rand(n)
    idx = choose_entries(scores, keep, sink, recent)
    k = min(keep, n)
    assert idx.numel() == k
    assert k < 2 or bool((idx.diff() > 0).all())
    chosen = set(idx.tolist())
    r = min(recent, k)
    assert set(range(n - r, n)) <= chosen
    assert set(range(min(sink, k - r, n - r))) <= chosen


def test_topk_keeps_the_attended_entries_and_positions_travel() -> None:
    g = torch.Generator().manual_seed(3)
    sig = ModelSignature(model="m", n_layers=2, n_kv_heads=2, head_dim=16, vocab_size=VOCAB)
    n = 64
    keys = [torch.randn(1, 2, n, 16, generator=g) * 0.1 for _ in range(2)]
    for k in keys:
        k[:, :, 20] = k[:, :, -8:].mean(dim=2) * 40  # entry 20 aligns with the recent keys: it gets the attention
    kv = KVCache(
        tokens=torch.randint(0, VOCAB, (1, n), generator=g),
        signature=sig,
        keys=keys,
        values=[torch.randn(1, 2, n, 16, generator=g) for _ in range(2)],
    )
    codec = get_codec("topk(0.25,sink=2,window=8)")
    out = codec.decode(wire(codec.encode(kv)))
    pos = out.positions.tolist()
    assert len(pos) == 16 and 20 in pos and pos[:2] == [0, 1] and pos[-8:] == list(range(56, 64))
    for i, p in enumerate(pos):
        assert torch.equal(out.keys[0][:, :, i], kv.keys[0][:, :, p])
    assert coverage(out) == n


def test_topk_positions_must_increase_and_stay_in_range() -> None:
    sig = ModelSignature(model="m", n_layers=1, n_kv_heads=1, head_dim=2, vocab_size=VOCAB)
    kv = KVCache(
        tokens=torch.arange(10).view(1, -1),
        signature=sig,
        keys=[torch.randn(1, 1, 10, 2)],
        values=[torch.randn(1, 1, 10, 2)],
    )
    enc = get_codec("topk(0.5,window=2)").encode(kv)
    payload = bytearray(b"".join(enc.buffers))
    for bad in ([7, 7, 8, 9, 9], [1, 2, 3, 4, 12], [5, 4, 3, 2, 1]):
        payload[80:120] = torch.tensor(bad, dtype=torch.int64).numpy().tobytes()
        with pytest.raises(DecodeError, match="positions"):
            get_codec(enc.codec).decode(Encoded.from_payload(enc.codec, enc.meta, bytes(payload), enc.sizes))


# -- delta -----------------------------------------------------------------------------------------


def _kv(n: int, *, seed: int = 0, batch: int = 1, tokens: torch.Tensor | None = None) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    sig = ModelSignature(model="m", n_layers=2, n_kv_heads=2, head_dim=8, vocab_size=VOCAB)
    t = tokens if tokens is not None else torch.randint(0, VOCAB, (batch, n), generator=g)
    return KVCache(
        tokens=t,
        signature=sig,
        keys=[torch.randn(t.shape[0], 2, n, 8, generator=g) for _ in range(2)],
        values=[torch.randn(t.shape[0], 2, n, 8, generator=g) for _ in range(2)],
    )


@PROPERTY
@given(
    n=st.integers(1, 60),
    shared=st.integers(0, 60),
    extra=st.integers(0, 5),
    batch=st.integers(1, 2),
    inner=st.sampled_from(["full", "int8", "topk(0.5)+full"]),
)
def test_delta_sends_only_the_new_part_and_rebuilds_the_whole_context(
    n: int, shared: int, extra: int, batch: int, inner: str
) -> None:
    shared = min(shared, n)
    kv = _kv(n, batch=batch)
    base_tokens = torch.cat([kv.tokens[:, :shared], torch.randint(0, VOCAB, (batch, extra)) + VOCAB], dim=1) % VOCAB
    if extra and shared < n:
        base_tokens[:, shared] = (kv.tokens[:, shared] + 1) % VOCAB  # diverge right after the shared prefix
    held = kv.slice(0, shared)
    tail = base_tokens.shape[1] - shared
    receiver = KVCache(
        tokens=base_tokens,
        signature=kv.signature,
        keys=[torch.cat([k, torch.randn(batch, 2, tail, 8)], 2) for k in held.keys],
        values=[torch.cat([v, torch.randn(batch, 2, tail, 8)], 2) for v in held.values],
        fidelity=0.9,
    )
    codec = get_codec(f"delta+{inner}")
    enc = codec.encode(kv, base=receiver.token_only())
    p = enc.meta["delta"]["prefix"]
    assert p <= shared and (p == shared or extra == 0 or shared == n)
    full_new = get_codec(inner).encode(kv.slice(p))
    assert enc.nbytes == full_new.nbytes if "topk" not in inner else enc.nbytes <= full_new.nbytes
    out = get_codec(enc.codec).decode(wire(enc), base=receiver)
    out.validate()
    assert torch.equal(out.tokens, kv.tokens)
    assert out.fidelity == pytest.approx(min(receiver.fidelity, codec.fidelity) if p else codec.fidelity)
    if inner == "full":
        assert out.positions is None and out.equal(kv)
    elif inner == "int8":
        for a, b in zip(kv.keys + kv.values, out.keys + out.values):
            assert torch.allclose(a, b, atol=0.05 * float(a.abs().max()))


def test_delta_without_base_or_shared_prefix_sends_everything() -> None:
    kv = _kv(20)
    for base in (None, _kv(10, seed=9)):
        enc = get_codec("delta+full").encode(kv, base=base)
        assert enc.meta["delta"]["prefix"] == 0
        out = get_codec("delta+full").decode(wire(enc), base=None)
        assert out.equal(kv)


def test_delta_against_a_wrong_or_stale_base_fails_loudly() -> None:
    kv = _kv(30)
    held = kv.slice(0, 20)
    enc = wire(get_codec("delta+int8").encode(kv, base=held.token_only()))
    assert enc.meta["delta"]["prefix"] == 20
    codec = get_codec("delta+int8")
    other = _kv(20, seed=4)
    stale = kv.slice(0, 12)
    changed = held.clone()
    changed.tokens[0, 5] = (changed.tokens[0, 5] + 1) % VOCAB
    no_kv = held.token_only()
    other_model = KVCache(
        tokens=held.tokens,
        signature=ModelSignature(model="x", n_layers=2, n_kv_heads=2, head_dim=8, vocab_size=VOCAB),
        keys=held.keys,
        values=held.values,
    )
    batch2 = _kv(20, batch=2)
    for base, match in [
        (None, "no base"),
        (other, "differ"),
        (stale, "stale"),
        (changed, "differ"),
        (no_kv, "KV for 0"),
        (other_model, "context"),
        (batch2, "batch"),
    ]:
        with pytest.raises(DeltaBaseMismatch, match=match) as info:
            codec.decode(enc, base=base)
        assert isinstance(info.value, KVBusError)
    forged = dict(enc.meta, delta={"prefix": 20, "version": "0" * 32})
    with pytest.raises(DeltaBaseMismatch):
        codec.decode(Encoded(enc.codec, forged, enc.buffers), base=held)
    assert torch.equal(codec.decode(enc, base=held).tokens, kv.tokens)


def test_delta_tokens_extends_the_base_kv_with_an_uncovered_tail() -> None:
    kv = _kv(30)
    held = kv.slice(0, 24)
    enc = wire(get_codec("delta+tokens").encode(kv, base=held.token_only()))
    assert enc.nbytes == 6 * 8
    out = get_codec("delta+tokens").decode(enc, base=held)
    assert torch.equal(out.tokens, kv.tokens) and out.seq_len == 24 and coverage(out) == 24
    assert all(torch.equal(a, b[:, :, :24]) for a, b in zip(out.keys, kv.keys))
    token_only = get_codec("delta+tokens").decode(enc, base=held.token_only())
    assert not token_only.has_kv and torch.equal(token_only.tokens, kv.tokens)


def test_prefix_version_is_a_stable_chain() -> None:
    t = torch.arange(3000).view(1, -1) % VOCAB
    assert prefix_version(t, 2500) == prefix_version(t.clone(), 2500) == prefix_version(t[:, :2500])
    assert prefix_version(t, 2500) != prefix_version(t, 2499)
    u = t.clone()
    u[0, 1500] += 1
    assert prefix_version(u, 1500) == prefix_version(t, 1500) and prefix_version(u, 1501) != prefix_version(t, 1501)
    assert prefix_version(t.to(torch.int32), 100) == prefix_version(t, 100)
    # pinned: versions must never change between releases (receivers compare them across versions)
    assert prefix_version(torch.zeros(1, 0, dtype=torch.int64)) == "1e308a9b6040f55f1aebb74b1d1cbda4"
    assert prefix_version(torch.arange(10).view(1, -1)) == "a742551abf10a716a471a03808862f72"


# -- summary ----------------------------------------------------------------------------------------


def test_summary_needs_a_sender_model_and_carries_only_the_summary() -> None:
    kv = _kv(50)
    with pytest.raises(SummaryUnavailable):
        get_codec("summary").encode(kv)
    codec = SummaryCodec(summarizer=TailSummarizer(), tokens=16)
    enc = wire(codec.encode(kv))
    assert enc.codec == "summary(16)" and enc.nbytes == 16 * 8
    out = get_codec(enc.codec).decode(enc)
    assert not out.has_kv and torch.equal(out.tokens, kv.tokens[:, -16:])
    assert out.fidelity == pytest.approx(kv.fidelity * get_codec("summary").fidelity)
    assert get_codec("summary(16)").fidelity == get_codec("summary").fidelity  # unmeasured parameters: the default's


# -- hostile input ----------------------------------------------------------------------------------

MSGPACK_INTS = st.integers(-(2**63), 2**64 - 1)
SCALARS = (
    st.none()
    | st.booleans()
    | MSGPACK_INTS
    | st.integers(-3, 70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


def _codec_for(spec: str) -> Codec:
    return SummaryCodec(summarizer=TailSummarizer()) if spec == "summary" else get_codec(spec)


def _decode_or_reject(spec: str, meta: Any, payload: bytes, sizes: Any, base: KVCache | None = None) -> None:
    """Hostile input must give a valid cache of bounded size or raise a `KVBusError`."""
    try:
        encoded = Encoded.from_payload(spec, meta, payload, sizes)
        out = get_codec(spec).decode(encoded, base=base)
    except KVBusError:
        return
    out.validate()
    limit = 8 * len(payload) + 64 + (base.nbytes if base is not None else 0)
    assert out.nbytes <= limit, "decoded far more than was received"


@FUZZ
@given(
    spec=st.sampled_from(ALL_SPECS),
    meta=VALUES,
    payload=st.binary(max_size=256),
    sizes=st.lists(st.integers(0, 64), max_size=8),
)
def test_random_metadata_is_rejected(spec: str, meta: Any, payload: bytes, sizes: list[int]) -> None:
    _decode_or_reject(spec, meta, payload, sizes)


FIELDS = [
    ("batch",),
    ("n_tokens",),
    ("seq_len",),
    ("layers",),
    ("dtype",),
    ("fidelity",),
    ("positions",),
    ("signature", "n_layers"),
    ("signature", "n_kv_heads"),
    ("signature", "head_dim"),
    ("signature", "dtype"),
    ("delta",),
    ("delta", "prefix"),
    ("delta", "version"),
    ("topk",),
    ("topk", "of"),
    ("summary",),
    ("summary", "source_tokens"),
]


@FUZZ
@given(
    kv=kv_caches(max_seq=12),
    spec=st.sampled_from(ALL_SPECS),
    path=st.sampled_from(FIELDS),
    delete=st.booleans(),
    value=VALUES | st.integers(-2, 100) | st.sampled_from([2**16, 2**24, 2**40, 2**63]),
    data=st.data(),
)
def test_mutated_metadata_is_rejected_or_consistent(
    kv: KVCache, spec: str, path: tuple[str, ...], delete: bool, value: Any, data: st.DataObject
) -> None:
    encoded = _codec_for(spec).encode(kv)
    meta = msgpack.unpackb(msgpack.packb(encoded.meta))
    target = meta
    for key in path[:-1]:
        target = target.get(key) if isinstance(target, dict) else None
    if isinstance(target, dict):
        if delete:
            target.pop(path[-1], None)
        else:
            target[path[-1]] = value
    payload = b"".join(encoded.buffers)
    sizes = list(encoded.sizes)
    if data.draw(st.booleans()) and sizes:
        i, j = data.draw(st.integers(0, len(sizes) - 1)), data.draw(st.integers(0, len(sizes) - 1))
        n = data.draw(st.integers(0, sizes[i]))
        sizes[i] -= n
        sizes[j] += n
    base = kv if data.draw(st.booleans()) else None
    _decode_or_reject(spec, meta, payload, sizes, base)


@PROPERTY
@given(kv=kv_caches(max_seq=12), spec=st.sampled_from(ALL_SPECS), data=st.data())
def test_truncated_and_corrupted_payloads_are_rejected_or_valid(kv: KVCache, spec: str, data: st.DataObject) -> None:
    encoded = _codec_for(spec).encode(kv)
    payload = b"".join(encoded.buffers)
    assume(len(payload) > 0)
    cut = data.draw(st.integers(1, len(payload)))
    remaining, short = len(payload) - cut, []
    for n in encoded.sizes:
        short.append(min(n, remaining))
        remaining -= short[-1]
    with pytest.raises(KVBusError):
        get_codec(spec).decode(Encoded.from_payload(spec, encoded.meta, payload[:-cut], short))
    with pytest.raises(KVBusError):
        Encoded.from_payload(spec, encoded.meta, payload[:-cut], encoded.sizes)
    if len(encoded.buffers) > 1:
        with pytest.raises(KVBusError):
            get_codec(spec).decode(Encoded(spec, encoded.meta, encoded.buffers[:-1]))
    flipped = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 8))):
        flipped[data.draw(st.integers(0, len(payload) - 1))] ^= 0xFF
    _decode_or_reject(spec, msgpack.unpackb(msgpack.packb(encoded.meta)), bytes(flipped), encoded.sizes, kv)


@pytest.mark.parametrize("spec", ["int4", "int4(4096)", "lowrank", "lowrank(1)", "topk+int8", "delta+int8", "summary"])
@pytest.mark.parametrize(
    "field,value",
    [
        ("batch", 2**16),
        ("n_tokens", 2**24),
        ("seq_len", 2**24),
        ("layers", 2**16),
        ("batch", -1),
        ("fidelity", math.nan),
    ],
)
def test_huge_claims_are_rejected_without_allocating(spec: str, field: str, value: Any) -> None:
    sig = ModelSignature(model="m", n_layers=2, n_kv_heads=2, head_dim=4, vocab_size=VOCAB)
    kv = KVCache(
        tokens=torch.arange(6).reshape(1, 6),
        signature=sig,
        keys=[torch.randn(1, 2, 6, 4) for _ in range(2)],
        values=[torch.randn(1, 2, 6, 4) for _ in range(2)],
    )
    encoded = _codec_for(spec).encode(kv)
    meta = dict(encoded.meta, **{field: value})
    if field in ("seq_len", "batch") and value > 0:
        meta["n_tokens"] = 2**24
    with pytest.raises(KVBusError):
        get_codec(spec).decode(wire(Encoded(spec, meta, encoded.buffers)))


def test_lowrank_refuses_to_expand_a_tiny_payload_into_a_huge_cache() -> None:
    sig = ModelSignature(model="m", n_layers=1, n_kv_heads=64, head_dim=64, vocab_size=VOCAB)
    kv = KVCache(
        tokens=torch.zeros(1, 4096, dtype=torch.int64),
        signature=sig,
        keys=[torch.zeros(1, 64, 4096, 64)],
        values=[torch.zeros(1, 64, 4096, 64)],
    )
    enc = get_codec("lowrank(1)").encode(kv)
    assert enc.nbytes < kv.nbytes / 500
    with pytest.raises(DecodeError, match="more than"):
        get_codec("lowrank(1)").decode(wire(enc))
