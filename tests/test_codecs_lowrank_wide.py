"""The `lowrank` medium on wide layers (``heads x head_dim > EXACT_MAX_DIM``, Llama-like), where the
basis comes from the randomised range finder (`randomized_bases`) and Cholesky QR instead of an
exact eigendecomposition: exact where the data has no more than the rank, near-optimal below it,
orthonormal bases for degenerate layers, deterministic, and NaN/inf refused with the tensor named."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbus.codecs import Encoded, get_codec
from kvbus.codecs.errors import NonFiniteValues
from kvbus.codecs.lowrank import EXACT_MAX_DIM, _orthonormal
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature, dtype_name
from tests.test_codecs_media import wire

PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HEADS, HEAD_DIM = 5, 128  # 640 features: past EXACT_MAX_DIM
assert HEADS * HEAD_DIM > EXACT_MAX_DIM  # every cache here takes the wide path


def tensor(rows: torch.Tensor, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """``[batch * seq, heads * head_dim]`` rows as a ``[batch, heads, seq, head_dim]`` tensor."""
    seq = rows.shape[0] // batch
    return rows.view(batch, seq, HEADS, HEAD_DIM).permute(0, 2, 1, 3).contiguous().to(dtype)


def cache(keys: list[torch.Tensor], values: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> KVCache:
    batch, _, seq, _ = keys[0].shape
    sig = ModelSignature(
        model="wide", n_layers=len(keys), n_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=dtype_name(dtype), vocab_size=1000
    )
    tokens = torch.arange(batch * seq, dtype=torch.int64).view(batch, seq) % 1000
    return KVCache(tokens=tokens, signature=sig, keys=keys, values=values)


def low_rank_rows(n: int, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, rank, generator=g) @ torch.randn(rank, HEADS * HEAD_DIM, generator=g)


def roundtrip(kv: KVCache, spec: str) -> KVCache:
    return get_codec(spec).decode(wire(get_codec(spec).encode(kv)))


@PROPERTY
@given(
    data_rank=st.integers(1, 6),
    extra=st.integers(0, 6),
    seq=st.integers(8, 24),
    batch=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_data_of_no_more_than_the_rank_comes_back_exact(
    data_rank: int, extra: int, seq: int, batch: int, seed: int
) -> None:
    n = batch * seq
    keys = [tensor(low_rank_rows(n, data_rank, seed), batch, torch.float32)]
    values = [tensor(low_rank_rows(n, data_rank, seed + 1), batch, torch.float32)]
    out = roundtrip(cache(keys, values), f"lowrank({data_rank + extra})")
    for x, y in zip(keys + values, out.keys + out.values):
        assert y.shape == x.shape and y.dtype == x.dtype
        assert float((x - y).norm()) <= 1e-4 * float(x.norm())


@PROPERTY
@given(rank=st.integers(1, 12), seq=st.integers(12, 40), seed=st.integers(0, 2**16), decay=st.floats(0.3, 2.0))
def test_below_the_rank_it_is_near_the_best_approximation(rank: int, seq: int, seed: int, decay: float) -> None:
    """Within 25 % of Eckart-Young's optimum on a decaying spectrum, and never worse than sending zeros."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(seq, seq, generator=g)).Q
    v = torch.linalg.qr(torch.randn(HEADS * HEAD_DIM, seq, generator=g)).Q
    s = torch.arange(1, seq + 1, dtype=torch.float32) ** -decay
    rows = (u * s) @ v.T
    x = tensor(rows, 1, torch.float32)
    out = roundtrip(cache([x], [x.clone()]), f"lowrank({rank})")
    optimal = float(s[rank:].square().sum().sqrt())
    for y in (out.keys[0], out.values[0]):
        err = float((x - y).norm())
        assert err <= optimal * 1.25 + 1e-5
        assert err <= float(x.norm()) * (1 + 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_layer_of_zeros_gets_an_orthonormal_basis_and_decodes_to_zeros(dtype: torch.dtype) -> None:
    zeros = torch.zeros(1, HEADS, 16, HEAD_DIM, dtype=dtype)
    some = tensor(low_rank_rows(16, 3, 7), 1, dtype)
    enc = get_codec("lowrank(8)").encode(cache([zeros, some], [some.clone(), zeros.clone()], dtype))
    basis = torch.frombuffer(bytearray(enc.buffers[enc_index(enc, "kbasis", 0)]), dtype=dtype).view(8, -1).float()
    assert torch.allclose(basis @ basis.T, torch.eye(8), atol=2e-2 if dtype != torch.float32 else 1e-5)
    out = get_codec("lowrank(8)").decode(wire(enc))
    assert not out.keys[0].any() and not out.values[1].any()


def enc_index(enc: Encoded, what: str, layer: int) -> int:
    """The buffer of layer ``layer``'s ``kcoef``/``kbasis``/``vcoef``/``vbasis`` (after the tokens)."""
    return 1 + 4 * layer + ("kcoef", "kbasis", "vcoef", "vbasis").index(what)


def test_encoding_is_deterministic_and_leaves_the_global_rng_alone() -> None:
    x = tensor(torch.randn(32, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(3)), 1, torch.bfloat16)
    kv = cache([x], [x.flip(2).contiguous()], torch.bfloat16)
    torch.manual_seed(11)
    before = torch.random.get_rng_state()
    a = get_codec("lowrank(16)").encode(kv)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = get_codec("lowrank(16)").encode(kv)
    assert [bytes(m) for m in a.buffers] == [bytes(m) for m in b.buffers]


@pytest.mark.parametrize(("tensor_name", "bad"), [("keys", math.nan), ("values", math.inf), ("values", -math.inf)])
def test_nan_or_inf_is_refused_naming_the_tensor(tensor_name: str, bad: float) -> None:
    good = [tensor(low_rank_rows(16, 4, i), 1, torch.float32) for i in range(4)]
    keys, values = good[:2], good[2:]
    spoiled = (keys if tensor_name == "keys" else values)[1]
    spoiled[0, 2, 5, 7] = bad
    with pytest.raises(NonFiniteValues) as caught:
        get_codec("lowrank(8)").encode(cache(keys, values))
    assert caught.value.what == f"{tensor_name}[1]"


def test_cholesky_qr_falls_back_to_householder_on_rank_deficient_blocks() -> None:
    g = torch.Generator().manual_seed(0)
    full = torch.randn(1, 64, 8, generator=g)
    deficient = torch.cat([full[:, :, :3], full[:, :, :3] * 2, torch.zeros(1, 64, 2)], dim=2)
    for w in (full, deficient, torch.zeros(1, 64, 8)):
        q = _orthonormal(w)
        assert torch.allclose(q[0].T @ q[0], torch.eye(8), atol=1e-4)
        # the columns of w lie in the span of q
        assert torch.allclose(q[0] @ (q[0].T @ w[0]), w[0], atol=1e-4)
