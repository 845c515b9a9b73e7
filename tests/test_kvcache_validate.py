"""`KVCache.validate`: its one-set check of a uniform cache accepts only what the check per tensor
accepts, and a cache that fails is still refused naming the first tensor that does not fit."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbus.errors import SignatureMismatch
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

#: How one tensor may be spoilt: a wrong head count, head dim, batch or length, dtype, an integer dtype.
SPOIL = ("heads", "head_dim", "batch", "seq", "dtype", "int")


def _kv(layers: int, heads: int, head_dim: int, seq: int, dtype: torch.dtype = torch.bfloat16) -> KVCache:
    sig = ModelSignature("m", n_layers=layers, n_kv_heads=heads, head_dim=head_dim, dtype="bfloat16", vocab_size=64)
    shape = (1, heads, seq, head_dim)
    return KVCache(
        torch.zeros(1, seq, dtype=torch.int64),
        sig,
        [torch.zeros(shape, dtype=dtype) for _ in range(layers)],
        [torch.zeros(shape, dtype=dtype) for _ in range(layers)],
    )


def _spoilt(t: torch.Tensor, how: str) -> torch.Tensor:
    b, h, s, d = t.shape
    if how == "dtype":
        return t.to(torch.float32)
    if how == "int":
        return t.to(torch.int16)
    shape = {
        "heads": (b, h + 1, s, d),
        "head_dim": (b, h, s, d + 1),
        "batch": (b + 1, h, s, d),
        "seq": (b, h, s + 1, d),
    }
    return torch.zeros(shape[how], dtype=t.dtype)


@settings(max_examples=150, deadline=None)
@given(
    layers=st.integers(1, 6),
    heads=st.integers(1, 4),
    head_dim=st.integers(1, 8),
    seq=st.integers(1, 5),
    values=st.booleans(),
    layer=st.integers(0, 5),
    how=st.sampled_from(SPOIL),
)
def test_one_spoilt_tensor_anywhere_is_refused_and_named(
    layers: int, heads: int, head_dim: int, seq: int, values: bool, layer: int, how: str
) -> None:
    kv = _kv(layers, heads, head_dim, seq)
    kv.validate(dtype=True)  # the uniform cache passes
    layer %= layers
    kind = "values" if values else "keys"
    tensors = list(getattr(kv, kind))
    tensors[layer] = _spoilt(tensors[layer], how)
    bad = dataclasses.replace(kv, **{kind: tensors})
    # The first key sets the length every other tensor must have: the same layer's values are
    # then the first that do not fit.
    named = "values[0]" if how == "seq" and layer == 0 and not values else f"{kind}[{layer}]"
    with pytest.raises(SignatureMismatch, match=re.escape(named)):
        bad.validate(dtype=True)


def test_a_cache_all_in_another_dtype_than_its_signature_fails_only_the_dtype_check() -> None:
    kv = _kv(3, 2, 4, 2, dtype=torch.float32)
    kv.validate()  # consistent in itself
    with pytest.raises(SignatureMismatch, match=r"keys\[0\] in bfloat16"):
        kv.validate(dtype=True)


def test_more_kv_positions_than_tokens_is_refused_on_the_uniform_path() -> None:
    kv = _kv(2, 2, 4, 3)
    short = dataclasses.replace(kv, tokens=torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(SignatureMismatch, match="at most 2 KV positions"):
        short.validate()
