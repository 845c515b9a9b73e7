"""The fused C kernels (codecs/_native.c): the same wire bytes and decoded caches as the torch kernels.

tests/test_kernels.py holds every kernel against its definition (with the C kernels on, as they
are by default); here whole payloads are compared with the C kernels on and off, for every
medium they serve, with the rare products that the reciprocal
path rounds the other way, and the build's cache and fallbacks.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbus.codecs import Encoded, _kernels, _native, get_codec
from kvbus.codecs.errors import NonFiniteValues
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the C kernels cannot be built")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@pytest.fixture(autouse=True)
def _native_ready() -> Iterator[None]:
    assert _native.prepare(), _native.why_not()  # built (or loaded) before the test, not during it
    yield
    _native.set_enabled(None)


def wire(encoded: Encoded) -> Encoded:
    return Encoded.from_payload(encoded.codec, dict(encoded.meta), b"".join(encoded.buffers), encoded.sizes)


@st.composite
def caches(draw: st.DrawFn) -> KVCache:
    """A small cache of a KV dtype, of head dims the C kernels take (even and odd, up to 256)."""
    dtype = draw(st.sampled_from(tuple(DTYPES)))
    layers, heads = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from((2, 6, 16, 24, 33, 64, 128, 256)))
    seq = draw(st.integers(1, 70))
    sig = ModelSignature(
        "native-test", n_layers=layers, n_kv_heads=heads, head_dim=head_dim, dtype=dtype, vocab_size=1000
    )
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shape = (1, heads, seq, head_dim)
    scale = draw(st.sampled_from((1e-3, 1.0, 30.0)))
    keys = [(torch.randn(shape, generator=g) * scale).to(DTYPES[dtype]) for _ in range(layers)]
    values = [(torch.randn(shape, generator=g) * scale).to(DTYPES[dtype]) for _ in range(layers)]
    for t in keys + values:
        flat = t.view(-1)
        for value in draw(st.lists(st.sampled_from((0.0, -0.0, 1e4, -1e4, 1e-6)), max_size=3)):
            flat[draw(st.integers(0, flat.numel() - 1))] = value
    return KVCache(torch.randint(0, 1000, (1, seq), generator=g), sig, keys, values)


def encode_decode(spec: str, kv: KVCache, native: bool) -> tuple[list[bytes], KVCache]:
    _native.set_enabled(native)
    codec = get_codec(spec)
    encoded = codec.encode(kv)
    return [bytes(b) for b in encoded.buffers], codec.decode(wire(encoded))


@given(kv=caches(), spec=st.sampled_from(("int8", "int4", "int4(8)", "int4(6)", "int4(g=64)", "topk+int8")))
@settings(max_examples=120, deadline=None)
def test_the_c_kernels_send_and_decode_what_the_torch_kernels_do(kv: KVCache, spec: str) -> None:
    fast_bytes, fast = encode_decode(spec, kv, True)
    slow_bytes, slow = encode_decode(spec, kv, False)
    assert fast_bytes == slow_bytes
    for a, b in zip(fast.keys + fast.values, slow.keys + slow.values, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_the_c_kernels_are_built_and_used_here() -> None:
    """With a compiler, the default path is the C one (else the figures of the bench are the torch ones)."""
    assert _native.available(), _native.why_not()
    kv = KVCache(
        torch.zeros(1, 4, dtype=torch.int64),
        ModelSignature("n", n_layers=2, n_kv_heads=1, head_dim=8, dtype="bfloat16", vocab_size=10),
        [torch.randn(1, 1, 4, 8).bfloat16() for _ in range(2)],
        [torch.randn(1, 1, 4, 8).bfloat16() for _ in range(2)],
    )
    assert _kernels.int8_encode_layer(kv.keys[0], kv.values[0]) is not None


#: Per dtype, rows ``[absmax, x, ...]`` whose scale ``s`` has an inexact reciprocal, with elements
#: at exactly ``(k + 0.5) * s``: the quotient is a tie (rounded to even), while ``x * fl(1 / s)``
#: lands just above it and would round up (found by a search over bfloat16 absmaxes).
HALFWAY = {
    torch.bfloat16: [(476.0, 9.375, 24.375, -9.375, -24.375), (121.0, 1.4296875, -1.4296875)],
    torch.float32: [(476.25, 9.375, 24.375, -9.375, -24.375)],  # scale exactly 3.75
}


def halfway_rows(dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """The `HALFWAY` rows as ``[rows, width]`` (padded with zeros), and how many elements the
    product alone rounds unlike the quotient (with the scales the torch kernels compute)."""
    width = max(len(r) for r in HALFWAY[dtype])
    x = torch.zeros(len(HALFWAY[dtype]), width, dtype=torch.float64)
    for i, row in enumerate(HALFWAY[dtype]):
        x[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
    x = x.to(dtype)
    _native.set_enabled(False)
    _, scale = _kernels.int8_encode(x.view(1, 1, *x.shape), 3)
    _native.set_enabled(None)
    f, s = x.float().numpy(), scale.float().view(-1, 1).numpy()
    wrong = int((np.rint(f * (np.float32(1) / s)) != np.rint(f / s)).sum())
    return x, wrong


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_next_to_a_tie_are_recomputed_by_division(dtype: torch.dtype) -> None:
    x, wrong = halfway_rows(dtype)
    assert wrong > 0, "the cases must be ones the reciprocal alone gets wrong"
    for t, axis in ((x.view(1, 1, *x.shape), 3), (x.T.contiguous().view(1, 1, *x.T.shape), 2)):
        _native.set_enabled(None)
        assert _kernels._int8_encode_native(t, axis, None) is not None  # the C path is the one tested
        q, scale = _kernels.int8_encode(t, axis)
        _native.set_enabled(False)
        q_ref, scale_ref = _kernels.int8_encode(t, axis)
        assert torch.equal(scale, scale_ref) and torch.equal(q, q_ref)


def test_the_first_bad_layer_is_named() -> None:
    """Layers big enough to be split over the OpenMP threads: a NaN in the second thread's heads counts."""
    sig = ModelSignature("n", n_layers=8, n_kv_heads=8, head_dim=64, dtype="bfloat16", vocab_size=10)
    keys = [torch.randn(1, 8, 64, 64).bfloat16() for _ in range(8)]
    values = [torch.randn(1, 8, 64, 64).bfloat16() for _ in range(8)]
    assert keys[0].numel() >= 1 << 15  # PARALLEL_MIN in _native.c
    values[6][0, 7, 3, 2] = math.nan
    keys[5][0, 7, 60, 0] = math.inf
    values[2][0, 6, 63, 7] = -math.inf  # the first: the one named
    kv = KVCache(torch.zeros(1, 64, dtype=torch.int64), sig, keys, values)
    for spec in ("int8", "int4"):
        with pytest.raises(NonFiniteValues) as caught:
            get_codec(spec).encode(kv)
        assert caught.value.what == "values[2]"
    values[2][0, 6, 63, 7] = 0.0
    with pytest.raises(NonFiniteValues) as caught:
        get_codec("int8").encode(kv)
    assert caught.value.what == "keys[5]"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_a_layer_split_over_threads_sends_what_the_torch_kernels_do(spec: str, dtype: str) -> None:
    sig = ModelSignature("n", n_layers=2, n_kv_heads=8, head_dim=128, dtype=dtype, vocab_size=10)
    g = torch.Generator().manual_seed(7)
    keys = [(torch.randn(1, 8, 100, 128, generator=g) * 3).to(DTYPES[dtype]) for _ in range(2)]
    values = [torch.randn(1, 8, 100, 128, generator=g).to(DTYPES[dtype]) for _ in range(2)]
    kv = KVCache(torch.zeros(1, 100, dtype=torch.int64), sig, keys, values)
    assert torch.get_num_threads() < 2 or keys[0].numel() >= 1 << 15
    fast_bytes, fast = encode_decode(spec, kv, True)
    slow_bytes, slow = encode_decode(spec, kv, False)
    assert fast_bytes == slow_bytes
    for a, b in zip(fast.keys + fast.values, slow.keys + slow.values, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_the_build_is_cached_and_a_missing_compiler_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_native.CACHE_ENV, str(tmp_path))
    _native.reset()
    assert not _native.available()  # nothing cached: the build runs in the background, torch serves
    assert _native.prepare()
    built = list(_native.cache_dir().glob("_native-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    _native.reset()
    assert _native.available()  # cached: loaded at once
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    monkeypatch.setenv(_native.CACHE_ENV, str(tmp_path) + "/other")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    _native.reset()
    assert not _native.prepare()
    assert "compiler" in (_native.why_not() or "")
    kv_layer = torch.randn(1, 2, 5, 8).bfloat16()
    q, _ = _kernels.int8_encode(kv_layer, 3)  # the torch kernels still encode
    assert q.shape == kv_layer.shape
    monkeypatch.undo()
    _native.reset()


def test_a_cache_folder_others_can_write_to_is_not_loaded_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(_native.CACHE_ENV, str(shared))
    _native.reset()
    try:
        assert not _native.prepare()
        assert "writable by its group or others" in (_native.why_not() or "")
        assert not list(shared.iterdir())  # nothing built there either
    finally:
        monkeypatch.undo()
        _native.reset()
