"""The eager quantisation kernels against their plain definitions, code for code.

`kvbus.codecs._kernels` computes int8 and int4 in float32 passes over a reused buffer (faster on
CPUs without 16-bit float arithmetic). The wire bytes must be those of the definitions below
(the straightforward torch formulas the media shipped with): same codes, same scales, for every
dtype, shape, axis and group, and for zeros, negative zeros, NaN and inf.
"""

from __future__ import annotations

import math
import threading

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbus.codecs import _native
from kvbus.codecs._kernels import (
    ROUND_MAGIC,
    _step_up,
    int4_decode,
    int4_encode,
    int4_grouped_shape,
    int8_decode,
    int8_encode,
)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The C kernels (codecs/_native.c) serve these calls where they apply, once built: build them
# first, so that the comparisons below hold them, not only the torch kernels, to the definitions.
_native.prepare()


def int8_reference(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    am = x.abs().amax(dim=axis, keepdim=True).double()
    exact = torch.where(am == 0, 1.0, am / 127)
    scale = _step_up(exact.to(x.dtype), exact)
    y = torch.div(x, scale.float())
    y.add_(ROUND_MAGIC)
    return y.view(torch.int32).to(torch.int8), scale


def int4_reference(x: torch.Tensor, axis: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grouped, red = int4_grouped_shape(tuple(x.shape), axis, group)
    s = x.shape[2]
    if axis == 2 and s % group:
        x = x.index_select(2, torch.arange(grouped[2] * group).clamp_(max=max(s - 1, 0)))
    xg = x.reshape(grouped)
    lo, hi = torch.aminmax(xg, dim=red, keepdim=True)
    low = lo.to(x.dtype)
    span = hi.double() - low.double()
    exact = torch.where(span == 0, 1.0, span / 15)
    scale = _step_up(exact.to(x.dtype), exact)
    y = xg.float() - low.float()
    y.div_(scale.float()).add_(ROUND_MAGIC)
    q = y.view(torch.int32).to(torch.uint8).reshape(-1)
    if q.numel() % 2:
        q = torch.cat([q, q.new_zeros(1)])
    pairs = q.view(-1, 2)
    return torch.bitwise_left_shift(pairs[:, 1], 4).bitwise_or_(pairs[:, 0]), scale, low


@st.composite
def layers(draw: st.DrawFn) -> torch.Tensor:
    """A ``[b, h, s, d]`` tensor of a KV dtype, with zeros, -0.0, huge and tiny values sprinkled."""
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 40)), draw(st.integers(1, 24)))
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(shape, generator=g) * draw(st.sampled_from((1e-3, 1.0, 30.0)))
    flat = x.view(-1)
    for value in draw(st.lists(st.sampled_from((0.0, -0.0, 1e4, -1e4, 1e-6)), max_size=4)):
        flat[draw(st.integers(0, flat.numel() - 1))] = value
    if draw(st.booleans()):
        x[:, :, :, 0] = 0.0  # an all-zero channel
    return x.to(dtype)


@given(x=layers(), axis=st.sampled_from((2, 3)))
@settings(max_examples=300, deadline=None)
def test_int8_codes_and_scales_are_those_of_the_definition(x: torch.Tensor, axis: int) -> None:
    q, scale = int8_encode(x, axis)
    q_ref, scale_ref = int8_reference(x, axis)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


@given(x=layers(), axis=st.sampled_from((2, 3)), group=st.sampled_from((1, 4, 5, 8, 32)))
@settings(max_examples=300, deadline=None)
def test_int4_codes_scales_and_lows_are_those_of_the_definition(x: torch.Tensor, axis: int, group: int) -> None:
    got = int4_encode(x, axis, group)
    want = int4_reference(x, axis, group)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def int4_decode_reference(
    packed: torch.Tensor,
    scale: torch.Tensor,
    low: torch.Tensor,
    shape: tuple[int, int, int, int],
    axis: int,
    group: int,
) -> torch.Tensor:
    grouped, _ = int4_grouped_shape(shape, axis, group)
    q = torch.stack([packed & 15, packed >> 4], dim=1).view(-1)[: math.prod(grouped)].view(grouped)
    out = torch.addcmul(low, q.to(scale.dtype), scale)
    out = out.view(grouped[0], grouped[1], -1, shape[3]) if axis == 2 else out.view(shape)
    return out[:, :, : shape[2]]


@given(x=layers(), axis=st.sampled_from((2, 3)), group=st.sampled_from((1, 4, 5, 8, 32)))
@settings(max_examples=200, deadline=None)
def test_decodes_are_those_of_the_definition(x: torch.Tensor, axis: int, group: int) -> None:
    """int8: ``q * scale`` rounded once to the dtype; int4: ``low + code * scale`` as addcmul rounds it."""
    q, scale = int8_encode(x, axis)
    assert torch.equal(int8_decode(q, scale), torch.mul(q, scale))
    packed, s4, low = int4_encode(x, axis, group)
    shape = (x.shape[0], x.shape[1], x.shape[2], x.shape[3])
    assert torch.equal(
        int4_decode(packed, s4, low, shape, axis, group), int4_decode_reference(packed, s4, low, shape, axis, group)
    )


@given(x=layers(), axis=st.sampled_from((2, 3)), bad=st.sampled_from((float("nan"), float("inf"), -float("inf"))))
@settings(max_examples=100, deadline=None)
def test_a_non_finite_value_gives_its_slice_a_non_finite_scale(x: torch.Tensor, axis: int, bad: float) -> None:
    x = x.clone()
    x[0, 0, 0, 0] = bad
    _, scale = int8_encode(x, axis)
    _, scale_ref = int8_reference(x, axis)
    assert not bool(scale[0, 0, 0, 0].isfinite())
    assert torch.equal(scale.isfinite(), scale_ref.isfinite())
    _, s4, _ = int4_encode(x, axis, 4)
    assert not bool(s4.isfinite().all())


def test_the_input_is_never_written_and_threads_do_not_share_the_buffer() -> None:
    x = torch.randn(1, 4, 64, 32)
    before = x.clone()
    int8_encode(x, 2)
    int4_encode(x, 3, 8)
    assert torch.equal(x, before)
    results: dict[int, torch.Tensor] = {}

    def work(i: int) -> None:
        y = torch.randn(1, 4, 64 + i, 32, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        for _ in range(20):
            q, _ = int8_encode(y, 3)
            if i in results:
                assert torch.equal(q, results[i])
            results[i] = q

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, q in results.items():
        y = torch.randn(1, 4, 64 + i, 32, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        assert torch.equal(q, int8_reference(y, 3)[0])
