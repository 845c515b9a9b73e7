"""Output arenas (codecs/_arena.py): a result still referenced is never handed out again."""

from __future__ import annotations

import gc

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from kvbus.codecs import Encoded, _arena, get_codec
from kvbus.codecs._arena import ArenaPool, carve, shared_pool
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

SIG = ModelSignature(
    "arena-test", n_layers=3, n_kv_heads=2, head_dim=16, dtype="bfloat16", vocab_size=1000, rope_theta=10000.0
)


def make_kv(seed: int, n_tokens: int = 40) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    shape = (1, SIG.n_kv_heads, n_tokens, SIG.head_dim)
    keys = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(SIG.n_layers)]
    values = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(SIG.n_layers)]
    return KVCache(torch.randint(0, 1000, (1, n_tokens), generator=g), SIG, keys, values)


def wire(encoded: Encoded) -> Encoded:
    return Encoded.from_payload(encoded.codec, dict(encoded.meta), b"".join(encoded.buffers), encoded.sizes)


def snapshot(kv: KVCache) -> list[torch.Tensor]:
    return [t.clone() for t in kv.keys + kv.values]


def test_views_are_aligned_and_disjoint() -> None:
    pool = ArenaPool()
    a, b, c = carve([(torch.bfloat16, (3, 5)), (torch.int8, (7,)), (torch.float32, (2, 2))], pool)
    assert [t.data_ptr() % 64 for t in (a, b, c)] == [0, 0, 0]
    assert a.data_ptr() + 30 <= b.data_ptr() and b.data_ptr() + 7 <= c.data_ptr()
    assert (a.shape, b.dtype, c.shape) == (torch.Size([3, 5]), torch.int8, torch.Size([2, 2]))


def test_views_are_aligned_where_numpy_aligns_less(monkeypatch: pytest.MonkeyPatch) -> None:
    # numpy only promises 16-byte alignment; CI's image handed out blocks at 32 mod 64.
    real_empty = np.empty

    def misaligned_empty(n: int, dtype: object = None) -> np.ndarray:
        raw = real_empty(n + 96, dtype=np.uint8)
        start = (32 - raw.ctypes.data) % 64
        return raw[start : start + n]

    monkeypatch.setattr(_arena.np, "empty", misaligned_empty)
    a, b = carve([(torch.float32, (100,)), (torch.int8, (3,))], ArenaPool())
    assert [t.data_ptr() % 64 for t in (a, b)] == [0, 0]


def test_an_arena_returns_only_when_its_last_view_is_gone() -> None:
    pool = ArenaPool()
    a, b = carve([(torch.float32, (1000,)), (torch.float32, (1000,))], pool)
    part = b[10:20]
    storage = a.untyped_storage()
    del a, b
    gc.collect()
    assert pool.free_bytes == 0  # a slice of one view and a storage still hold it
    del part
    assert pool.free_bytes == 0
    del storage
    assert pool.free_bytes > 0
    (again,) = carve([(torch.float32, (2000,))], pool)
    assert (pool.allocated, pool.reused) == (1, 1)
    assert pool.free_bytes == 0
    del again


def test_a_memoryview_of_an_arena_holds_it() -> None:
    from kvbus.codecs._tensors import as_bytes

    pool = ArenaPool()
    (t,) = carve([(torch.int8, (4096,))], pool)
    t.fill_(7)
    view = as_bytes(t)
    del t
    (other,) = carve([(torch.int8, (4096,))], pool)
    other.fill_(1)
    assert bytes(view) == b"\x07" * 4096
    assert pool.allocated == 2


def test_pool_limit_drops_old_blocks() -> None:
    pool = ArenaPool(max_bytes=1 << 17)
    views = [carve([(torch.uint8, (1 << 16,))], pool)[0] for _ in range(3)]
    del views
    assert pool.free_bytes <= 1 << 17
    pool.clear()
    assert pool.free_bytes == 0
    with pytest.raises(ValueError):
        ArenaPool(max_bytes=-1)


@pytest.mark.parametrize("spec", ["int8", "int4", "lowrank(4)", "topk+int8"])
def test_held_decodes_are_never_overwritten(spec: str) -> None:
    """Decoded caches kept by the receiver keep their values while later decodes of the same size reuse memory."""
    codec = get_codec(spec)
    held = [(codec.decode(wire(codec.encode(make_kv(i)))), i) for i in range(3)]
    expected = [snapshot(kv) for kv, _ in held]
    before = shared_pool().reused
    for j in range(10, 20):
        codec.decode(wire(codec.encode(make_kv(j))))  # dropped at once: its arena is reused
    assert shared_pool().reused > before
    for (kv, _), want in zip(held, expected):
        for got, w in zip(kv.keys + kv.values, want):
            assert torch.equal(got, w)


@pytest.mark.parametrize("spec", ["int8", "int4", "lowrank(4)"])
def test_held_encodings_are_never_overwritten(spec: str) -> None:
    """A buffer of an encoding kept (alone, its Encoded dropped) keeps its bytes while later encodes reuse memory."""
    codec = get_codec(spec)
    enc = codec.encode(make_kv(0))
    kept = enc.buffers[3]
    want = bytes(kept)
    del enc
    for j in range(1, 8):
        codec.encode(make_kv(j))
    assert bytes(kept) == want


@given(ops=st.lists(st.tuples(st.sampled_from(["int8", "int4"]), st.integers(0, 50), st.booleans()), max_size=12))
@settings(max_examples=25, deadline=None)
def test_any_sequence_of_kept_and_dropped_results(ops: list[tuple[str, int, bool]]) -> None:
    held: list[tuple[KVCache, list[torch.Tensor], Encoded, bytes]] = []
    for spec, seed, keep in ops:
        codec = get_codec(spec)
        enc = codec.encode(make_kv(seed))
        dec = codec.decode(wire(enc))
        if keep:
            held.append((dec, snapshot(dec), enc, b"".join(enc.buffers)))
        for kv, want, e, payload in held:
            assert all(torch.equal(a, b) for a, b in zip(kv.keys + kv.values, want))
            assert b"".join(e.buffers) == payload


def test_wire_bytes_do_not_depend_on_the_arena() -> None:
    kv = make_kv(5)
    for spec in ("int8", "int4", "lowrank(4)"):
        codec = get_codec(spec)
        cls = type(codec)
        with_arena = b"".join(codec.encode(kv).buffers)
        cls.encode_arena = False  # type: ignore[misc]
        try:
            without = b"".join(codec.encode(kv).buffers)
        finally:
            del cls.encode_arena  # type: ignore[misc]
        assert with_arena == without
        dec_on = codec.decode(wire(codec.encode(kv)))
        cls.decode_arena = False  # type: ignore[misc]
        try:
            dec_off = codec.decode(wire(codec.encode(kv)))
        finally:
            del cls.decode_arena  # type: ignore[misc]
        assert all(torch.equal(a, b) for a, b in zip(dec_on.keys + dec_on.values, dec_off.keys + dec_off.values))
