"""Property tests of the codecs: round trips, error bounds, zero copy, and hostile input."""

from __future__ import annotations

import gc
import math
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvbus.codecs import DecodeError, Encoded, UnknownCodec, available_codecs, get_codec
from kvbus.codecs._tensors import as_bytes, buffer_address, byte_views, tensor_from
from kvbus.errors import KVBusError
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature, dtype_name

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
VOCAB = 1000
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- strategies ---------------------------------------------------------------------------------


@st.composite
def kv_caches(draw: st.DrawFn, *, with_kv: bool = True) -> KVCache:
    """Random KV-caches: batch 1-2, layers 1-3, heads 1-4, seq 0..40, head_dim 1..64."""
    batch = draw(st.integers(1, 2))
    layers = draw(st.integers(1, 3))
    heads = draw(st.integers(1, 4))
    head_dim = draw(st.integers(1, 64))
    seq = draw(st.sampled_from([0, 1]) | st.integers(0, 40))
    n_tokens = seq + draw(st.integers(0, 3))
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(["randn", "zeros", "outliers", "tiny", "wide"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
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
            x[..., 0] *= 50.0  # one outlier channel, as real keys have
        elif kind == "tiny":
            x *= 1e-6
        elif kind == "wide":
            x *= torch.exp(torch.randn(shape, generator=g) * 3).clamp(max=1e3)
        return x.to(dtype)

    keys = [layer() for _ in range(layers)] if with_kv else []
    values = [layer() for _ in range(layers)] if with_kv else []
    positions = None
    if with_kv and draw(st.booleans()) and draw(st.booleans()):
        positions = torch.sort(torch.randperm(seq + 5, generator=g)[:seq]).values
    fidelity = draw(st.sampled_from([1.0, 0.75]))
    return KVCache(tokens=tokens, signature=sig, keys=keys, values=values, positions=positions, fidelity=fidelity)


def wire(encoded: Encoded, *, writable: bool = False) -> Encoded:
    """What a receiver gets: msgpack'd metadata and one contiguous payload split by sizes."""
    payload: bytes | bytearray = b"".join(encoded.buffers)
    if writable:
        payload = bytearray(payload)
    meta = msgpack.unpackb(msgpack.packb(encoded.meta))
    return Encoded.from_payload(encoded.codec, meta, payload, encoded.sizes)


def snapshot(kv: KVCache) -> KVCache:
    return kv.clone()


def assert_unchanged(kv: KVCache, before: KVCache) -> None:
    assert kv.equal(before), "encoding modified its input"
    if before.positions is not None:
        assert kv.positions is not None and torch.equal(kv.positions, before.positions)


# -- full -----------------------------------------------------------------------------------------


@PROPERTY
@given(kv=kv_caches())
def test_full_round_trip_is_bit_exact(kv: KVCache) -> None:
    before = snapshot(kv)
    codec = get_codec("full")
    encoded = codec.encode(kv)
    out = codec.decode(wire(encoded))
    assert out.equal(kv)
    assert out.dtype == kv.dtype and out.signature == kv.signature and out.fidelity == kv.fidelity
    assert (out.positions is None) == (kv.positions is None)
    if kv.positions is not None:
        assert torch.equal(out.positions, kv.positions)
    assert_unchanged(kv, before)
    if kv.positions is None and kv.seq_len == kv.n_tokens:
        assert encoded.nbytes == codec.estimate_nbytes(kv.signature, kv.n_tokens, kv.batch)


@PROPERTY
@given(kv=kv_caches())
def test_full_encode_and_decode_are_zero_copy(kv: KVCache) -> None:
    encoded = get_codec("full").encode(kv)
    tensors = [kv.tokens] if kv.positions is None else [kv.tokens, kv.positions]
    for k, v in zip(kv.keys, kv.values):
        tensors += [k, v]
    assert len(tensors) == len(encoded.buffers)
    for t, buf in zip(tensors, encoded.buffers):
        if t.numel():
            assert buffer_address(buf) == t.data_ptr()
    received = wire(encoded, writable=True)
    payload = received.keepalive[0]
    start = buffer_address(memoryview(payload))
    out = get_codec("full").decode(received)
    for t in [out.tokens, *out.keys, *out.values]:
        if t.numel():
            assert start <= t.data_ptr() < start + len(payload)


def test_full_encodes_non_contiguous_slices() -> None:
    g = torch.Generator().manual_seed(1)
    sig = ModelSignature(model="m", n_layers=2, n_kv_heads=3, head_dim=8, vocab_size=VOCAB)
    kv = KVCache(
        tokens=torch.randint(0, VOCAB, (2, 20), generator=g),
        signature=sig,
        keys=[torch.randn(2, 3, 20, 8, generator=g) for _ in range(2)],
        values=[torch.randn(2, 3, 20, 8, generator=g) for _ in range(2)],
    )
    part = kv.slice(5, 12)
    assert not part.keys[0].is_contiguous()
    out = get_codec("full").decode(wire(get_codec("full").encode(part)))
    assert out.equal(part) and out.n_tokens == 7 and out.seq_len == 7


@given(kv=kv_caches(), medium=st.sampled_from(["full", "int8", "int4", "topk+int8", "delta+full"]))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_payload_viewed_in_bulk_decodes_as_buffer_by_buffer(kv: KVCache, medium: str) -> None:
    """The decoders' bulk view of a received payload (`Encoded.region`) gives the very tensors
    the one-tensor-per-buffer path gives, and tensors that do not share bytes."""
    codec = get_codec(medium)
    base = kv if medium.startswith("delta") else None
    try:
        encoded = codec.encode(kv, base=base)
    except KVBusError:
        assume(False)
    bulk = wire(encoded, writable=True)
    assert bulk.region is not None and len(bulk.offsets) == len(bulk.buffers)
    one_by_one = wire(encoded, writable=True)
    one_by_one.region, one_by_one.offsets = None, ()
    try:
        b = codec.decode(one_by_one, base=base)
    except DecodeError as exc:  # e.g. drawn positions past the tokens: the bulk view refuses it the same way
        with pytest.raises(DecodeError) as info:
            codec.decode(bulk, base=base)
        assert str(info.value) == str(exc)
        return
    a = codec.decode(bulk, base=base)
    assert a.equal(b) and a.dtype == b.dtype
    if a.keys and a.keys[0].numel():
        before = b.values[0].clone()
        a.keys[0][(0,) * a.keys[0].dim()] += 1  # writing one delivered tensor changes no other
        assert torch.equal(a.values[0], before)


@PROPERTY
@given(kv=kv_caches(with_kv=False))
def test_full_round_trips_a_token_only_context(kv: KVCache) -> None:
    out = get_codec("full").decode(wire(get_codec("full").encode(kv)))
    assert not out.has_kv
    assert torch.equal(out.tokens, kv.tokens) and out.signature == kv.signature


# -- int8 -----------------------------------------------------------------------------------------


def _int8_bound(x: torch.Tensor, axis: int) -> torch.Tensor:
    """The largest error the int8 codec may make on ``x`` (in float64): values (axis 3) are
    quantised as they are, keys (axis 2) centred on their channel's midpoint first."""
    finfo = torch.finfo(x.dtype)
    ulp0 = finfo.tiny * finfo.eps  # the smallest subnormal
    x64 = x.double()
    if not x.shape[axis]:
        return torch.zeros((), dtype=torch.float64)
    absmax = x64.abs().amax(dim=axis, keepdim=True)
    if axis == 3:
        scale = absmax / 127 * (1 + finfo.eps) + ulp0  # absmax / 127, rounded up to the KV dtype
        # half a quantisation step, plus one rounding of q * scale in the KV dtype
        return scale / 2 + finfo.eps * absmax + ulp0
    lo, hi = x64.amin(dim=axis, keepdim=True), x64.amax(dim=axis, keepdim=True)
    half, mid = (hi - lo) / 2, ((hi + lo) / 2).abs()
    # The centred values: at most half the channel's range, off by the midpoint's rounding and
    # their own; half a step of their absmax / 127, one rounding of the code times the scale
    # and one of adding the offset back.
    centred = half + 2 * finfo.eps * (mid + half)
    scale = centred / 127 * (1 + finfo.eps) + ulp0
    return scale / 2 + finfo.eps * (centred + 2 * absmax) + 2 * ulp0


@PROPERTY
@given(kv=kv_caches())
def test_int8_error_is_within_half_a_step(kv: KVCache) -> None:
    before = snapshot(kv)
    codec = get_codec("int8")
    encoded = codec.encode(kv)
    out = codec.decode(wire(encoded))
    assert_unchanged(kv, before)
    assert torch.equal(out.tokens, kv.tokens) and out.signature == kv.signature
    assert out.dtype == kv.dtype and out.fidelity == pytest.approx(kv.fidelity * codec.fidelity)
    for x, y, axis in [
        *((k, o, 2) for k, o in zip(kv.keys, out.keys)),
        *((v, o, 3) for v, o in zip(kv.values, out.values)),
    ]:
        assert y.shape == x.shape and y.dtype == x.dtype
        err = (x.double() - y.double()).abs()
        assert bool((err <= _int8_bound(x, axis)).all()), float((err - _int8_bound(x, axis)).max())
        if x.numel() and float(x.double().norm()) > 0:
            assert float(err.norm() / x.double().norm()) < 0.05
    if kv.positions is None and kv.seq_len == kv.n_tokens:
        assert encoded.nbytes == codec.estimate_nbytes(kv.signature, kv.n_tokens, kv.batch)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_spends_its_levels_on_a_key_channels_band_not_on_zero(dtype: torch.dtype) -> None:
    """Key channels that sit in a band away from zero (as RoPE'd keys do) come back within half a
    step of the band's half-width / 127, not of the channel's largest magnitude / 127."""
    g = torch.Generator().manual_seed(8)
    sig = ModelSignature(model="m", n_layers=1, n_kv_heads=2, head_dim=16, dtype=dtype_name(dtype), vocab_size=VOCAB)
    offset = torch.linspace(-12.0, 12.0, 16).view(1, 1, 1, 16)
    keys = (offset + torch.rand(1, 2, 64, 16, generator=g) * 2 - 1).to(dtype)  # each channel in offset +- 1
    kv = KVCache(
        tokens=torch.zeros(1, 64, dtype=torch.int64), signature=sig, keys=[keys], values=[torch.ones_like(keys)]
    )
    out = get_codec("int8").decode(wire(get_codec("int8").encode(kv)))
    err = float((out.keys[0].double() - keys.double()).abs().max())
    band_step = 1.0 / 127  # half-width 1
    assert err <= band_step / 2 + 2 * torch.finfo(dtype).eps * 13, err
    assert err < 13.0 / 127 / 2 / 5  # symmetric absmax codes (13 / 127 a step) err five times more


def test_an_int8_payload_of_the_earlier_layout_is_refused_saying_so() -> None:
    sig = ModelSignature(model="m", n_layers=2, n_kv_heads=2, head_dim=8, vocab_size=VOCAB)
    x = torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(3))
    kv = KVCache(tokens=torch.zeros(1, 8, dtype=torch.int64), signature=sig, keys=[x, x], values=[x, x])
    encoded = get_codec("int8").encode(kv)
    del encoded.meta["layout"]
    with pytest.raises(DecodeError, match="layout 1"):
        get_codec("int8").decode(wire(encoded))
    encoded.meta["layout"] = 3
    with pytest.raises(DecodeError, match="layout"):
        get_codec("int8").decode(wire(encoded))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("magnitude", [1e-6, 1e-30, 1e-39, 1.0, 1e3])
def test_int8_handles_tiny_and_subnormal_magnitudes(dtype: torch.dtype, magnitude: float) -> None:
    g = torch.Generator().manual_seed(4)
    sig = ModelSignature(model="m", n_layers=1, n_kv_heads=2, head_dim=16, dtype=dtype_name(dtype), vocab_size=VOCAB)
    kv = KVCache(
        tokens=torch.zeros(1, 9, dtype=torch.int64),
        signature=sig,
        keys=[(torch.randn(1, 2, 9, 16, generator=g) * magnitude).to(dtype)],
        values=[(torch.randn(1, 2, 9, 16, generator=g) * magnitude).to(dtype)],
    )
    out = get_codec("int8").decode(wire(get_codec("int8").encode(kv)))
    for x, y, axis in [(kv.keys[0], out.keys[0], 2), (kv.values[0], out.values[0], 3)]:
        assert bool(torch.isfinite(y).all())
        assert bool(((x.double() - y.double()).abs() <= _int8_bound(x, axis)).all())


def test_int8_is_smaller_and_accurate_on_gaussian_kv() -> None:
    g = torch.Generator().manual_seed(2)
    sig = ModelSignature(model="m", n_layers=2, n_kv_heads=4, head_dim=64, vocab_size=VOCAB)
    kv = KVCache(
        tokens=torch.randint(0, VOCAB, (1, 128), generator=g),
        signature=sig,
        keys=[torch.randn(1, 4, 128, 64, generator=g) for _ in range(2)],
        values=[torch.randn(1, 4, 128, 64, generator=g) for _ in range(2)],
    )
    full, int8 = get_codec("full").encode(kv), get_codec("int8").encode(kv)
    assert int8.nbytes < full.nbytes / 3
    out = get_codec("int8").decode(wire(int8))
    for x, y in zip(kv.keys + kv.values, out.keys + out.values):
        assert float((x - y).norm() / x.norm()) < 0.02


# -- tokens ---------------------------------------------------------------------------------------


@PROPERTY
@given(kv=kv_caches())
def test_tokens_round_trip_without_runner_is_token_only(kv: KVCache) -> None:
    before = snapshot(kv)
    codec = get_codec("tokens")
    encoded = codec.encode(kv)
    assert encoded.nbytes == codec.estimate_nbytes(kv.signature, kv.n_tokens, kv.batch) == kv.tokens.numel() * 8
    out = codec.decode(wire(encoded))
    assert_unchanged(kv, before)
    assert not out.has_kv and out.positions is None
    assert torch.equal(out.tokens, kv.tokens) and out.signature == kv.signature and out.fidelity == kv.fidelity


def test_codec_flags() -> None:
    assert get_codec("full").lossless and get_codec("tokens").lossless and not get_codec("int8").lossless
    assert not get_codec("tokens").needs_kv and get_codec("full").needs_kv
    assert 0 < get_codec("int8").fidelity < 1


# -- registry and helpers -------------------------------------------------------------------------


def test_unknown_codec_lists_the_known_names() -> None:
    with pytest.raises(ValueError, match="full.*int8.*tokens") as info:
        get_codec("zstd-9000")
    assert isinstance(info.value, UnknownCodec) and isinstance(info.value, KVBusError)
    assert {"full", "int8", "tokens"} <= set(available_codecs())


@pytest.mark.parametrize("dtype", DTYPES)
def test_as_bytes_and_tensor_from_share_memory(dtype: torch.dtype) -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(dtype)
    buf = as_bytes(t)
    assert buf.nbytes == 12 * dtype.itemsize and buffer_address(buf) == t.data_ptr()
    back = tensor_from(memoryview(bytearray(buf)), dtype, (3, 4), "test")
    assert torch.equal(back, t)
    store = bytearray(buf)
    view = tensor_from(memoryview(store), dtype, [3, 4], "test")
    assert view.data_ptr() == buffer_address(memoryview(store))
    assert torch.equal(tensor_from(bytes(buf), dtype, (3, 4), "test"), t)  # read-only: copied


AS_BYTES_DTYPES = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(AS_BYTES_DTYPES),
    dims=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    transpose=st.booleans(),
    grad=st.booleans(),
)
def test_as_bytes_is_the_tensors_memory_byte_for_byte(
    dtype: torch.dtype, dims: list[int], transpose: bool, grad: bool
) -> None:
    """The fast path (a ctypes array over a contiguous tensor's bytes) gives exactly
    the bytes the generic path does, for every dtype, an empty or transposed tensor, or one that
    requires grad."""
    t = (torch.arange(math.prod(dims), dtype=torch.float64).reshape(dims) * 1.5 - 3).to(dtype)
    if transpose and t.dim() > 1:
        t = t.transpose(0, -1)
    if grad and dtype.is_floating_point:
        t.requires_grad_(True)
    want = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    got = as_bytes(t)
    assert got.format == "B" and got.ndim == 1 and bytes(got) == want
    if t.is_contiguous() and t.numel():
        assert buffer_address(got) == t.data_ptr()  # a view, not a copy


def test_as_bytes_keeps_the_tensors_memory_alive() -> None:
    """The view holds the tensor: its bytes stay valid after the caller dropped every reference."""
    t = torch.arange(4096, dtype=torch.float32).to(torch.bfloat16)
    want = t.view(torch.uint8).numpy().tobytes()
    view = as_bytes(t)
    del t
    gc.collect()
    junk = [torch.full((4096,), 7, dtype=torch.bfloat16) for _ in range(64)]  # reuse of freed memory
    assert bytes(view) == want and len(junk) == 64


@settings(max_examples=150, deadline=None)
@given(
    layouts=st.lists(
        st.tuples(st.sampled_from(AS_BYTES_DTYPES), st.lists(st.integers(0, 5), min_size=1, max_size=3), st.booleans()),
        min_size=0,
        max_size=8,
    )
)
def test_byte_views_are_each_tensors_bytes(layouts: list[tuple[torch.dtype, list[int], bool]]) -> None:
    """`byte_views` (slices of one view over the tensors' span) gives each tensor exactly the bytes
    `as_bytes` gives it, contiguous, empty or transposed, and views the contiguous ones in place."""
    tensors = []
    for dtype, dims, transpose in layouts:
        t = (torch.arange(math.prod(dims), dtype=torch.float64).reshape(dims) * 1.5 - 3).to(dtype)
        tensors.append(t.transpose(0, -1) if transpose and t.dim() > 1 else t)
    views = byte_views(tensors)
    assert len(views) == len(tensors)
    for t, view in zip(tensors, views):
        assert view.format == "B" and view.ndim == 1 and bytes(view) == bytes(as_bytes(t))
        if t.is_contiguous() and t.numel():
            assert buffer_address(view) == t.data_ptr()


def test_byte_views_keep_every_tensor_alive() -> None:
    """Each view holds all the tensors it was cut from: their bytes stay valid after the caller
    dropped every reference (a transfer's buffers outlive the cache they were encoded from)."""
    tensors = [torch.full((1024,), i, dtype=torch.float32) for i in range(8)]
    views = byte_views(tensors)
    del tensors
    gc.collect()
    junk = [torch.full((1024,), -1, dtype=torch.float32) for _ in range(64)]  # reuse of freed memory
    for i in (0, 7):
        assert torch.equal(torch.frombuffer(bytearray(views[i]), dtype=torch.float32), torch.full((1024,), float(i)))
    assert len(junk) == 64


def test_decoding_read_only_buffers_swaps_the_warning_filters_at_most_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch warns about a read-only buffer once per process: after that first (silenced) time,
    decoding never enters ``warnings.catch_warnings`` (per tensor it cost 2 us, and it swaps the
    process-wide filter list, which races between threads)."""
    import kvbus.codecs._tensors as tensors

    tensor_from(bytes(16), torch.float32, (4,), "test")  # the process's first, if no test came before
    entered = []

    class Counting:
        def __enter__(self) -> None:
            entered.append(1)

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(tensors.warnings, "catch_warnings", Counting)
    sig = ModelSignature("ro", n_layers=4, n_kv_heads=2, head_dim=8, dtype="float32", vocab_size=VOCAB)
    shape = (1, 2, 6, 8)
    kv = KVCache(
        torch.arange(6).view(1, 6), sig, [torch.randn(shape) for _ in range(4)], [torch.randn(shape) for _ in range(4)]
    )
    received = wire(get_codec("full").encode(kv))  # read-only bytes, as the bus hands them over
    assert all(memoryview(b).readonly for b in received.buffers)
    assert get_codec("full").decode(received).equal(kv) and not entered


@pytest.mark.parametrize("shape", [(-1, 4), (3, 5), (3,), [True, 4], "34", (2**41, 0), (1,) * 9, (3, 4.0)])
def test_tensor_from_rejects_bad_shapes(shape: Any) -> None:
    buf = as_bytes(torch.zeros(3, 4))
    with pytest.raises(DecodeError):
        tensor_from(buf, torch.float32, shape, "test")


# -- hostile input --------------------------------------------------------------------------------

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
CODECS = st.sampled_from(["full", "int8", "tokens"])


def _decode_or_reject(codec: str, meta: Any, payload: bytes, sizes: Any) -> KVCache | None:
    """Decode hostile input: it must either give a valid cache or raise a `KVBusError`."""
    try:
        encoded = Encoded.from_payload(codec, meta, payload, sizes)
        out = get_codec(codec).decode(encoded)
    except KVBusError:
        return None
    out.validate()
    assert out.nbytes <= 4 * len(payload) + 64, "decoded far more than was received"
    return out


@FUZZ
@given(codec=CODECS, meta=VALUES, payload=st.binary(max_size=256), sizes=st.lists(st.integers(0, 64), max_size=6))
def test_random_metadata_is_rejected(codec: str, meta: Any, payload: bytes, sizes: list[int]) -> None:
    _decode_or_reject(codec, meta, payload, sizes)


def _mutate(meta: dict[str, Any], path: tuple[str, ...], value: Any, delete: bool) -> dict[str, Any]:
    meta = msgpack.unpackb(msgpack.packb(meta))
    target = meta
    for key in path[:-1]:
        target = target[key]
    if delete:
        target.pop(path[-1], None)
    else:
        target[path[-1]] = value
    return meta


FIELDS = [
    ("batch",),
    ("n_tokens",),
    ("seq_len",),
    ("layers",),
    ("dtype",),
    ("fidelity",),
    ("positions",),
    ("signature",),
    ("signature", "n_layers"),
    ("signature", "n_kv_heads"),
    ("signature", "head_dim"),
    ("signature", "dtype"),
    ("signature", "vocab_size"),
    ("signature", "model"),
    ("signature", "rope_theta"),
]


@FUZZ
@given(
    kv=kv_caches(),
    codec=CODECS,
    path=st.sampled_from(FIELDS),
    delete=st.booleans(),
    value=VALUES | st.integers(-2, 100) | st.sampled_from([2**15, 2**16, 2**24, 2**31, 2**40, 2**63]),
    data=st.data(),
)
def test_mutated_metadata_is_rejected_or_consistent(
    kv: KVCache, codec: str, path: tuple[str, ...], delete: bool, value: Any, data: st.DataObject
) -> None:
    encoded = get_codec(codec).encode(kv)
    meta = _mutate(encoded.meta, path, value, delete)
    payload = b"".join(encoded.buffers)
    sizes = encoded.sizes
    if data.draw(st.booleans()) and sizes:
        # move some bytes from one buffer to another: same total, wrong split
        i, j = data.draw(st.integers(0, len(sizes) - 1)), data.draw(st.integers(0, len(sizes) - 1))
        n = data.draw(st.integers(0, sizes[i]))
        sizes = list(sizes)
        sizes[i] -= n
        sizes[j] += n
    _decode_or_reject(codec, meta, payload, sizes)


@PROPERTY
@given(kv=kv_caches(), codec=CODECS, data=st.data())
def test_truncated_payloads_are_rejected(kv: KVCache, codec: str, data: st.DataObject) -> None:
    encoded = get_codec(codec).encode(kv)
    payload = b"".join(encoded.buffers)
    assume(len(payload) > 0)
    cut = data.draw(st.integers(1, len(payload)))
    sizes = list(encoded.sizes)
    # truncated payload with honest sizes for what is left: the split no longer fits the shapes
    remaining, short = len(payload) - cut, []
    for n in sizes:
        short.append(min(n, remaining))
        remaining -= short[-1]
    with pytest.raises(DecodeError):
        get_codec(codec).decode(Encoded.from_payload(codec, encoded.meta, payload[:-cut], short))
    with pytest.raises(DecodeError):  # sizes that claim more than was received
        Encoded.from_payload(codec, encoded.meta, payload[:-cut], sizes)
    # a buffer list that is one short
    if len(encoded.buffers) > 1:
        with pytest.raises(DecodeError):
            get_codec(codec).decode(Encoded(codec, encoded.meta, encoded.buffers[:-1]))


@pytest.mark.parametrize("codec", ["full", "int8", "tokens"])
@pytest.mark.parametrize(
    "field,value",
    [
        ("batch", 2**16),
        ("n_tokens", 2**24),
        ("batch", -1),
        ("n_tokens", -5),
        ("seq_len", 2**24),
        ("layers", 2**16),
        ("fidelity", math.nan),
        ("fidelity", 2.0),
        ("dtype", "float64"),
        ("positions", 1),
    ],
)
def test_huge_or_negative_claims_are_rejected_without_allocating(codec: str, field: str, value: Any) -> None:
    sig = ModelSignature(model="m", n_layers=2, n_kv_heads=2, head_dim=4, vocab_size=VOCAB)
    kv = KVCache(
        tokens=torch.arange(6).reshape(1, 6),
        signature=sig,
        keys=[torch.randn(1, 2, 6, 4) for _ in range(2)],
        values=[torch.randn(1, 2, 6, 4) for _ in range(2)],
    )
    encoded = get_codec(codec).encode(kv)
    meta = dict(encoded.meta, **{field: value})
    if field == "seq_len" or (field == "batch" and value > 0):
        meta["n_tokens"] = 2**24  # every count as large as allowed: 2**16 * 2**24 int64 tokens is 8 TiB
    with pytest.raises(DecodeError):
        get_codec(codec).decode(wire(Encoded(codec, meta, encoded.buffers)))


def test_huge_signature_claims_are_rejected() -> None:
    sig = ModelSignature(model="m", n_layers=1, n_kv_heads=1, head_dim=1, vocab_size=VOCAB)
    kv = KVCache(
        tokens=torch.zeros(1, 1, dtype=torch.int64),
        signature=sig,
        keys=[torch.ones(1, 1, 1, 1)],
        values=[torch.ones(1, 1, 1, 1)],
    )
    encoded = get_codec("full").encode(kv)
    for field, value in [
        ("n_layers", 2**16),
        ("n_kv_heads", 2**16),
        ("head_dim", 2**16),
        ("n_layers", 0),
        ("head_dim", -1),
        ("vocab_size", 2**40),
        ("model", 7),
        ("dtype", "int8"),
    ]:
        meta = dict(encoded.meta, signature=dict(encoded.meta["signature"], **{field: value}))
        if field == "n_layers" and value > 0:
            meta["layers"] = value
        with pytest.raises(DecodeError):
            get_codec("full").decode(Encoded("full", meta, encoded.buffers))


def test_out_of_vocabulary_tokens_are_rejected() -> None:
    sig = ModelSignature(model="m", n_layers=1, n_kv_heads=1, head_dim=2, vocab_size=10)
    kv = KVCache(tokens=torch.tensor([[1, 2, 3]]), signature=sig)
    encoded = get_codec("tokens").encode(kv)
    bad = bytearray(b"".join(encoded.buffers))
    bad[8:16] = (10).to_bytes(8, "little")
    with pytest.raises(DecodeError, match="token ids"):
        get_codec("tokens").decode(Encoded.from_payload("tokens", encoded.meta, bytes(bad), encoded.sizes))
    bad[8:16] = (-1).to_bytes(8, "little", signed=True)
    with pytest.raises(DecodeError, match="token ids"):
        get_codec("full").decode(Encoded.from_payload("full", encoded.meta, bytes(bad), encoded.sizes))


def test_decode_errors_are_kvbus_and_value_errors() -> None:
    with pytest.raises(DecodeError) as info:
        get_codec("full").decode(Encoded("full", "not a map", []))  # type: ignore[arg-type]
    assert isinstance(info.value, KVBusError) and isinstance(info.value, ValueError)
