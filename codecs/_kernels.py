"""The tensor kernels of the quantising codecs: fused C where they apply, else torch (eager, or compiled on request).

Each kernel is a plain torch function over one layer's keys or values ``[b, h, s, d]``. Where
the fused C kernels (`kvbus.codecs._native`) are built and take the tensors (bfloat16 or
float32, contiguous, head dims up to 256; int4 with even groups), the kernels hand the work to
them, with the same codes, scales and decoded values bit for bit; the ``*_layer`` functions at
the end do a layer's keys and values in one C call (the codecs' fast path). What follows
describes the torch kernels, which serve every other case.

Measured on the 2-core development machine (`kvbus bench codecs`, Llama-3-8B-shaped bf16
cache, 512 tokens, against ``copy_`` at about 12 GB/s): ``int8_encode`` runs at 1.6 GB/s eager
(0.13x copy) and 4.0 GB/s compiled (0.33x: inductor fuses the reduction, the scale and the
rounding into two loops); ``int8_decode`` at 4.3 GB/s eager and 7.3 GB/s compiled. The int4
kernels were *slower* compiled (0.1-0.2 GB/s against 0.65 GB/s eager: inductor's code for the
grouped reductions and the nibble packing is poor on CPU), so they always run eager. The first
compiled call costs 5-15 s on two cores (less with inductor's on-disk cache), more than
short-lived processes and the test suite ever win back, so compiling is opt-in:
``KVBUS_COMPILE=1`` (or `set_compile`); long-lived agents should turn it on.

A compiled kernel that fails (no C++ compiler, an unsupported op) falls back to eager for good,
with a warning. Tensors smaller than `COMPILE_MIN_ELEMENTS` always run eager.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch

from kvbus.codecs import _native

logger = logging.getLogger(__name__)

#: Environment variable that turns `torch.compile` on (``1``/``true``/``on``).
COMPILE_ENV = "KVBUS_COMPILE"
#: Smallest tensor (elements) a compiled kernel is used for.
COMPILE_MIN_ELEMENTS = 1 << 16
#: Adding this to a float32 in [-2**22, 2**22] rounds it half-to-even to an integer held in the
#: low bits of its mantissa, so its bits viewed as int32 *are* that integer: one add replaces
#: ``round`` and the float-to-int conversion (eager only; inductor fuses ``round`` anyway).
ROUND_MAGIC = 12582912.0  # 1.5 * 2**23
#: `ROUND_MAGIC` as a float32 scalar tensor (the ``self`` of `torch.addcdiv`).
_MAGIC = torch.tensor(ROUND_MAGIC, dtype=torch.float32)
#: Integer dtype of the same width, for stepping a positive float up by one ulp.
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}

F = TypeVar("F", bound=Callable[..., Any])

_override: list[bool | None] = [None]
"""What `set_compile` forced (a one-element list: set without a ``global`` statement)."""


def compile_enabled() -> bool:
    """Whether kernels are compiled: `set_compile` if called, else ``KVBUS_COMPILE``."""
    if _override[0] is not None:
        return _override[0]
    return os.environ.get(COMPILE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def set_compile(enabled: bool | None) -> None:
    """Force compilation on or off in this process (``None``: back to ``KVBUS_COMPILE``)."""
    _override[0] = enabled


class _Kernel:
    """An eager function with a lazily compiled twin (compiled once per process, shared by threads)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.eager = fn
        self._compiled: Callable[..., Any] | None = None
        self._failed = False
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn)

    def _get_compiled(self) -> Callable[..., Any] | None:
        with self._lock:
            if self._compiled is None and not self._failed:
                try:
                    self._compiled = torch.compile(self.eager, dynamic=True)
                except Exception:
                    logger.warning(
                        "torch.compile of %s failed; using eager kernels", self.eager.__name__, exc_info=True
                    )
                    self._failed = True
        return self._compiled

    def __call__(self, x: torch.Tensor, *args: Any, out: Any = None) -> Any:
        # ``out``: where the eager kernel writes its results; a compiled kernel returns its own.
        if not self._failed and x.numel() >= COMPILE_MIN_ELEMENTS and compile_enabled():
            fn = self._get_compiled()
            if fn is not None:
                try:
                    return fn(x, *args)
                except Exception:
                    logger.warning(
                        "compiled %s failed; using eager kernels from now on", self.eager.__name__, exc_info=True
                    )
                    self._failed = True
        return self.eager(x, *args) if out is None else self.eager(x, *args, out=out)


def compilable(fn: F) -> F:
    """Decorator: ``fn`` runs eager, or compiled when `compile_enabled`."""
    return cast(F, _Kernel(fn))  # a _Kernel is called exactly like fn


def _step_up(scale: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``scale`` (positive, in a float dtype), one ulp larger wherever it is below ``exact``.

    Casting ``exact`` to a 16-bit dtype may round it down (by one ulp for normal numbers, by far
    more for subnormals, down to 0); for a non-negative float, adding 1 to its bits is nextafter
    towards +inf, subnormals and 0 included.
    """
    bumped = (scale.view(_BITS[scale.dtype]) + 1).view(scale.dtype)
    return torch.where(scale.double() < exact, bumped, scale)


#: Largest float32 scratch buffer a thread keeps between calls (elements: 64 MB); larger ones are
#: allocated per call.
SCRATCH_MAX_ELEMENTS = 16 << 20
_local = threading.local()
#: The dtypes the eager kernels compute in float32 passes (others go through plain torch ops).
_FAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _scratch(shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """A float32 tensor of ``shape`` from this thread's reused buffer (contents undefined).

    A fresh tensor of a layer's size costs its page faults on every call (about as much as the
    quantisation itself); the buffer is faulted in once per thread. Valid until this thread's
    next call: callers never return it.
    """
    n = math.prod(shape)
    if n > SCRATCH_MAX_ELEMENTS:
        return torch.empty(shape, dtype=torch.float32)
    buf: torch.Tensor | None = getattr(_local, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _local.buf = torch.empty(n, dtype=torch.float32)
    return buf[:n].view(shape)


def _as_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself if float32, else ``x`` converted into this thread's scratch buffer (`_scratch`).

    On CPUs without bfloat16 or float16 arithmetic units, every op on a 16-bit tensor converts
    each element to float32 and back; converting once and doing every pass in float32 is
    several times faster, and exact (float32 holds every 16-bit value).
    """
    if x.dtype == torch.float32:
        return x
    if x.dtype not in _FAST_DTYPES:
        raise TypeError(f"the quantising kernels take float32, float16 or bfloat16 tensors, not {x.dtype}")
    y = _scratch(x.shape)
    y.copy_(x)
    return y


# -- int8: symmetric absmax ---------------------------------------------------------------------


@compilable
def int8_encode(
    x: torch.Tensor, axis: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantisation of ``x`` to int8 along ``axis`` (reduced to 1 in the scale).

    Returns ``(q, scale)``: ``q`` int8 of ``x``'s shape, ``scale`` in ``x``'s dtype, with
    ``|x - q * scale| <= scale / 2`` element-wise (plus one rounding in the dtype). The scale is
    ``absmax / 127`` rounded up in the dtype, so no element clips; an all-zero slice gets 1. A
    slice holding NaN or inf gets a NaN or inf scale (callers refuse it). ``x`` is never written.

    Eager, a 16-bit ``x`` is converted once into a reused float32 buffer and every pass runs
    there (see `_as_float32`); the codes are those of ``round(x.float() / scale.float())``.
    ``out``: ``(q, scale)`` tensors of those shapes and dtypes that the results are written into
    and returned as (eager only).
    """
    if x.shape[axis] == 0:
        shape = list(x.shape)
        shape[axis] = 1
        return torch.empty(x.shape, dtype=torch.int8), torch.ones(shape, dtype=x.dtype)
    if torch.compiler.is_compiling():
        am = x.abs().amax(dim=axis, keepdim=True).double()
        exact = torch.where(am == 0, 1.0, am / 127)
        scale = _step_up(exact.to(x.dtype), exact)
        return torch.round(x.float() / scale.float()).clamp(-127, 127).to(torch.int8), scale
    if x.dtype not in _FAST_DTYPES:
        raise TypeError(f"the quantising kernels take float32, float16 or bfloat16 tensors, not {x.dtype}")
    fused = _int8_encode_native(x, axis, out)
    if fused is not None:
        return fused
    if x.dtype == torch.float32:
        am = x.abs().amax(dim=axis, keepdim=True).double()
    else:
        # one conversion to float32, then ``max(amax, -amin)``: the absmax exactly (negation is
        # exact), without an ``abs`` pass; NaN propagates through both
        y = _as_float32(x)
        am = torch.maximum(y.amax(dim=axis, keepdim=True).double(), y.amin(dim=axis, keepdim=True).double().neg_())
    # ``am == 0`` rather than ``am > 0``: a NaN absmax stays NaN in the scale (the caller checks it).
    exact = torch.where(am == 0, 1.0, am / 127)
    scale = _step_up(exact.to(x.dtype), exact)
    if x.dtype == torch.float32:
        y = torch.div(x, scale, out=_scratch(x.shape))  # x itself is never written
        y.add_(ROUND_MAGIC)
    elif axis % x.dim() != x.dim() - 1:
        # ``MAGIC + y / scale`` in one pass: addcdiv rounds the quotient, then the sum, exactly as
        # div_ then add_ do (the same codes), and saves a pass over y (keys, [512, 128] per head:
        # 65 against 96 us measured). With the scale broadcast along the last dimension (values)
        # addcdiv's kernel is not vectorised (213 us), so the values keep the two passes.
        torch.addcdiv(_MAGIC, y, scale.float(), out=y)
    else:
        y.div_(scale.float())
        y.add_(ROUND_MAGIC)
    if out is None:
        return y.view(torch.int32).to(torch.int8), scale
    q, scale_out = out
    q.copy_(y.view(torch.int32))
    scale_out.copy_(scale)
    return q, scale_out


@compilable
def int8_decode(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q * scale`` in ``scale``'s dtype (one pass, one new tensor or ``out``, eager only)."""
    if torch.compiler.is_compiling():
        return q.to(scale.dtype) * scale
    fused = _int8_decode_native(q, scale, out)
    if fused is not None:
        return fused
    return torch.mul(q, scale) if out is None else torch.mul(q, scale, out=out)


# -- int4: asymmetric min/max, grouped, two codes per byte ------------------------------------------


def int4_grouped_shape(shape: tuple[int, ...], axis: int, group: int) -> tuple[list[int], int]:
    """The grouped shape int4 quantises ``[b, h, s, d]`` in, and the dimension reduced per group.

    Along the tokens (``axis=2``, keys), groups of ``group`` tokens per channel; the sequence is
    padded to a multiple of ``group`` by repeating the last token (which widens no range).
    Along the channels (``axis=3``, values), groups of ``group`` channels per token when
    ``group`` divides the head dimension, else one group per token.
    """
    b, h, s, d = shape
    if axis == 2:
        return [b, h, -(-s // group), group, d], 3
    g = group if d % group == 0 else d
    return [b, h, s, d // g if g else 0, g], 4


def int4_encode(
    x: torch.Tensor, axis: int, group: int, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantisation of ``x`` ``[b, h, s, d]`` in groups (see `int4_grouped_shape`).

    Returns ``(packed, scale, low)``: ``packed`` uint8 holding two codes per byte (the first in
    the low nibble) in the grouped order, ``scale`` and ``low`` in ``x``'s dtype with the group
    dimension reduced to 1. Each element decodes within half a step (``scale / 2``) plus one
    rounding in the dtype. ``x`` is never written. ``out``: ``(packed, scale, low)`` tensors of
    those shapes and dtypes that the results are written into and returned as.
    """
    fused = _int4_encode_native(x, axis, group, out)
    if fused is not None:
        return fused
    grouped, red = int4_grouped_shape(tuple(x.shape), axis, group)
    s = x.shape[2]
    if axis == 2 and s % group:
        idx = torch.arange(grouped[2] * group).clamp_(max=max(s - 1, 0))
        x = x.index_select(2, idx)
    xg = x.reshape(grouped)
    red_shape = list(grouped)
    red_shape[red] = 1
    if xg.numel() == 0:
        ones = torch.ones(red_shape, dtype=x.dtype)
        return torch.empty(0, dtype=torch.uint8), ones, torch.zeros(red_shape, dtype=x.dtype)
    y = _as_float32(xg)  # every pass in float32 (see `_as_float32`)
    lo, hi = y.amin(dim=red, keepdim=True), y.amax(dim=red, keepdim=True)  # NaN propagates through both
    low = lo.to(x.dtype)  # lo holds a value of x: exact
    span = hi.double() - low.double()
    exact = torch.where(span == 0, 1.0, span / 15)  # a NaN span stays NaN (the caller checks it)
    scale = _step_up(exact.to(x.dtype), exact)
    if y is xg:  # float32: x itself is never written
        y = torch.sub(xg, low.float(), out=_scratch(xg.shape))
    else:
        y.sub_(low.float())
    codes = y.div_(scale.float()).round_().view(-1)  # 0..15 by construction of the scale, half to even
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    # two codes per byte, the first in the low nibble: first + 16 * second is exact in float32
    packed = torch.add(pairs[:, 0], pairs[:, 1], alpha=16)
    if out is None:
        return packed.to(torch.uint8), scale, low
    packed_out, scale_out, low_out = out
    packed_out.copy_(packed)
    scale_out.copy_(scale)
    low_out.copy_(low)
    return packed_out, scale_out, low_out


def int4_decode(
    packed: torch.Tensor,
    scale: torch.Tensor,
    low: torch.Tensor,
    shape: tuple[int, int, int, int],
    axis: int,
    group: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rebuild ``[b, h, s, d]`` from `int4_encode`'s output, in ``scale``'s dtype.

    The caller has checked ``packed`` holds ``ceil(numel(grouped) / 2)`` bytes and the scale
    and low shapes. ``out``: a contiguous ``[b, h, s, d]`` tensor of that dtype to write into
    and return.
    """
    fused = _int4_decode_native(packed, scale, low, shape, axis, group, out)
    if fused is not None:
        return fused
    grouped, _ = int4_grouped_shape(shape, axis, group)
    n = 1
    for dim in grouped:
        n *= dim
    q = torch.empty((packed.numel(), 2), dtype=torch.uint8)
    torch.bitwise_and(packed, 15, out=q[:, 0])
    torch.bitwise_right_shift(packed, 4, out=q[:, 1])
    codes = q.view(-1)[:n].view(grouped)
    if axis == 3 and scale.dtype in (torch.bfloat16, torch.float16):
        # Values (a scale per group of channels): ``addcmul`` in a 16-bit dtype, broadcast along
        # the last dimension, runs element by element (492 us a [1, 8, 512, 128] tensor);
        # converting the codes to float32 once, two in-place passes and one conversion back take
        # 261 us. code * scale is exact in float32 (4 by 8 significant bits), so only the sum is
        # rounded before the cast, as addcmul's float32 arithmetic does.
        y = _scratch(tuple(grouped))
        y.copy_(codes)
        y.mul_(scale.float()).add_(low.float())
        if out is None:
            return y.to(scale.dtype).view(shape)
        out.view(grouped).copy_(y)
        return out
    if out is not None and n == out.numel():  # no padded tokens: straight into out
        torch.addcmul(low, codes.to(scale.dtype), scale, out=out.view(grouped))
        return out
    full = torch.addcmul(low, codes.to(scale.dtype), scale)
    full = full.view(grouped[0], grouped[1], -1, shape[3]) if axis == 2 else full.view(shape)
    result = full[:, :, : shape[2]] if full.shape[2] != shape[2] else full
    return result if out is None else out.copy_(result)


# -- the fused C kernels (`kvbus.codecs._native`), where they apply ------------------------------

#: The dtypes the C kernels take, and the name suffix of their functions.
_NATIVE_INT8 = {torch.bfloat16: "bf16", torch.float32: "f32"}
_NATIVE_DTYPES = _NATIVE_INT8


def _plain(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is a contiguous, non-empty CPU tensor the C kernels can address."""
    return all(t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0 and not t.requires_grad for t in tensors)


def _reduced(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return tuple(1 if j == axis else n for j, n in enumerate(shape))


def _int8_encode_native(
    x: torch.Tensor, axis: int, out: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`int8_encode` of a ``[b, h, s, d]`` bfloat16 or float32 layer by the C kernels; None where they do not apply."""
    suffix = _NATIVE_INT8.get(x.dtype)
    if suffix is None or x.dim() != 4 or not _plain(x):
        return None
    axis %= 4
    b, h, s, d = x.shape
    if axis not in (2, 3) or (axis == 2 and d > _native.MAX_CHANNELS):
        return None
    lib = _native.library()
    if lib is None:
        return None
    q, scale = out if out is not None else (torch.empty(x.shape, dtype=torch.int8), None)
    if scale is None:
        scale = torch.empty(_reduced(tuple(x.shape), axis), dtype=x.dtype)
    if not _plain(q, scale) or q.dtype != torch.int8 or scale.dtype != x.dtype or q.numel() != x.numel():
        return None
    if axis == 2:
        getattr(lib, f"int8_enc_keys_{suffix}")(x.data_ptr(), q.data_ptr(), scale.data_ptr(), b * h, s, d)
    else:
        getattr(lib, f"int8_enc_rows_{suffix}")(x.data_ptr(), q.data_ptr(), scale.data_ptr(), b * h * s, d)
    return q, scale


def _int8_decode_native(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor | None:
    """`int8_decode` to bfloat16 or float32 by the C kernels (a scale per channel or per token); None
    where they do not apply."""
    suffix = _NATIVE_INT8.get(scale.dtype)
    if suffix is None or q.dtype != torch.int8 or q.dim() != 4 or not _plain(q, scale):
        return None
    b, h, s, d = q.shape
    per_channel = tuple(scale.shape) == (b, h, 1, d)
    if not per_channel and tuple(scale.shape) != (b, h, s, 1):
        return None
    if per_channel and d > _native.MAX_CHANNELS:
        return None
    lib = _native.library()
    if lib is None:
        return None
    if out is None:
        out = torch.empty(q.shape, dtype=scale.dtype)
    elif not _plain(out) or out.dtype != scale.dtype or tuple(out.shape) != tuple(q.shape):
        return None
    if per_channel:
        getattr(lib, f"int8_dec_keys_{suffix}")(q.data_ptr(), scale.data_ptr(), out.data_ptr(), b * h, s, d)
    else:
        getattr(lib, f"int8_dec_rows_{suffix}")(q.data_ptr(), scale.data_ptr(), out.data_ptr(), b * h * s, d)
    return out


def _int4_native_group(shape: tuple[int, ...], axis: int, group: int) -> int | None:
    """The group the C kernels would use for a bfloat16 ``[b, h, s, d]`` (see `int4_grouped_shape`), or None."""
    if len(shape) != 4:
        return None
    d = shape[3]
    if d % 2 or d > _native.MAX_CHANNELS or group < 1:
        return None
    if axis == 2:
        return group
    if axis == 3:
        g = group if d % group == 0 else d
        return g if g % 2 == 0 else None
    return None


def _int4_encode_native(
    x: torch.Tensor, axis: int, group: int, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`int4_encode` of a bfloat16 or float32 layer by the C kernels; None where they do not apply."""
    suffix = _NATIVE_INT8.get(x.dtype)
    if suffix is None or not _plain(x):
        return None
    g = _int4_native_group(tuple(x.shape), axis, group)
    if g is None:
        return None
    lib = _native.library()
    if lib is None:
        return None
    grouped, red = int4_grouped_shape(tuple(x.shape), axis, group)
    reduced = _reduced(tuple(grouped), red)
    if out is None:
        out = (
            torch.empty(math.prod(grouped) // 2, dtype=torch.uint8),
            torch.empty(reduced, dtype=x.dtype),
            torch.empty(reduced, dtype=x.dtype),
        )
    packed, scale, low = out
    if (
        not _plain(packed, scale, low)
        or packed.numel() * 2 != math.prod(grouped)
        or scale.numel() != math.prod(reduced)
    ):
        return None
    if packed.dtype != torch.uint8 or scale.dtype != x.dtype or low.dtype != x.dtype or low.numel() != scale.numel():
        return None
    b, h, s, d = x.shape
    ptrs = (x.data_ptr(), packed.data_ptr(), scale.data_ptr(), low.data_ptr())
    if axis == 2:
        getattr(lib, f"int4_enc_keys_{suffix}")(*ptrs, b * h, s, d, g)
    else:
        getattr(lib, f"int4_enc_rows_{suffix}")(*ptrs, b * h * s, d, g)
    return packed, scale, low


def _int4_decode_native(
    packed: torch.Tensor,
    scale: torch.Tensor,
    low: torch.Tensor,
    shape: tuple[int, int, int, int],
    axis: int,
    group: int,
    out: torch.Tensor | None,
) -> torch.Tensor | None:
    """`int4_decode` to bfloat16 or float32 by the C kernels; None where they do not apply."""
    suffix = _NATIVE_INT8.get(scale.dtype)
    if suffix is None or low.dtype != scale.dtype or packed.dtype != torch.uint8:
        return None
    if not _plain(packed, scale, low):
        return None
    g = _int4_native_group(tuple(shape), axis, group)
    if g is None:
        return None
    grouped, red = int4_grouped_shape(tuple(shape), axis, group)
    n_reduced = math.prod(_reduced(tuple(grouped), red))
    if packed.numel() * 2 != math.prod(grouped) or scale.numel() != n_reduced or low.numel() != n_reduced:
        return None
    lib = _native.library()
    if lib is None:
        return None
    if out is None:
        out = torch.empty(shape, dtype=scale.dtype)
    elif not _plain(out) or out.dtype != scale.dtype or tuple(out.shape) != tuple(shape):
        return None
    b, h, s, d = shape
    ptrs = (packed.data_ptr(), scale.data_ptr(), low.data_ptr(), out.data_ptr())
    if axis == 2:
        getattr(lib, f"int4_dec_keys_{suffix}")(*ptrs, b * h, s, d, g)
    else:
        getattr(lib, f"int4_dec_rows_{suffix}")(*ptrs, b * h * s, d, g)
    return out


# -- whole layers (one C call for a layer's keys and values: the codecs' fast path) --------------


def _layer_ok(keys: torch.Tensor, values: torch.Tensor, out: Sequence[torch.Tensor] | None) -> bool:
    """Whether a layer and its outputs are what the C layer kernels take (contiguous CPU, same shape)."""
    if keys.dim() != 4 or keys.shape != values.shape or keys.dtype != values.dtype or not _plain(keys, values):
        return False
    return out is None or _plain(*out)


def _int8_layer_encode(
    keys: torch.Tensor, values: torch.Tensor, out: Sequence[torch.Tensor] | None, centred: bool
) -> tuple[tuple[torch.Tensor, ...], int] | None:
    """One C call of ``int8_enc_layer`` (``int8c_enc_layer`` when ``centred``): the int8 layer
    kernels take keys, values, their outputs ``(kq, kscale[, koffset], vq, vscale)`` in that
    order, then ``b * h``, ``s``, ``d``."""
    suffix = _NATIVE_INT8.get(keys.dtype)
    if suffix is None or not _layer_ok(keys, values, out) or keys.shape[3] > _native.MAX_CHANNELS:
        return None
    lib = _native.library()
    if lib is None:
        return None
    b, h, s, d = keys.shape
    per_channel = ((b, h, 1, d), keys.dtype)
    specs = [(tuple(keys.shape), torch.int8), per_channel, *([per_channel] if centred else [])]
    specs += [(tuple(keys.shape), torch.int8), ((b, h, s, 1), keys.dtype)]
    if out is None:
        out = tuple(torch.empty(shape, dtype=dtype) for shape, dtype in specs)
    if len(out) != len(specs) or any(o.numel() != math.prod(shape) for o, (shape, _) in zip(out, specs)):
        return None
    kernel = "int8c" if centred else "int8"
    bad = getattr(lib, f"{kernel}_enc_layer_{suffix}")(
        keys.data_ptr(), values.data_ptr(), *(o.data_ptr() for o in out), b * h, s, d
    )
    return tuple(out), int(bad)


def _int8_layer_decode(
    views: Sequence[torch.Tensor], out: tuple[torch.Tensor, torch.Tensor] | None, centred: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One C call of ``int8_dec_layer`` (``int8c_dec_layer`` when ``centred``): the checked views
    ``(kq, kscale[, koffset], vq, vscale)`` and the two outputs, then ``b * h``, ``s``, ``d``."""
    if len(views) != (5 if centred else 4):
        return None
    kq, vq = views[0], views[-2]
    floats = [*views[1:-2], views[-1]]  # the scales (and offsets): the outputs' dtype
    ks, vs = floats[0], floats[-1]
    suffix = _NATIVE_INT8.get(ks.dtype)
    if suffix is None or any(t.dtype != ks.dtype for t in floats) or kq.dim() != 4 or not _plain(*views):
        return None
    b, h, s, d = kq.shape
    if d > _native.MAX_CHANNELS or vs.numel() != b * h * s or vq.shape != kq.shape:
        return None
    if any(t.numel() != b * h * d for t in floats[:-1]):
        return None
    lib = _native.library()
    if lib is None:
        return None
    if out is None:
        out = (torch.empty(kq.shape, dtype=ks.dtype), torch.empty(kq.shape, dtype=ks.dtype))
    elif not _plain(*out) or any(o.dtype != ks.dtype or o.shape != kq.shape for o in out):
        return None
    getattr(lib, f"{'int8c' if centred else 'int8'}_dec_layer_{suffix}")(
        *(v.data_ptr() for v in views), out[0].data_ptr(), out[1].data_ptr(), b * h, s, d
    )
    return out


def int8_encode_layer(
    keys: torch.Tensor, values: torch.Tensor, out: Sequence[torch.Tensor] | None = None
) -> tuple[tuple[torch.Tensor, ...], int] | None:
    """`int8_encode` of keys per channel and values per token in one C call, or None where it does not apply.

    Returns ``((kq, kscale, vq, vscale), bad)``, ``bad`` a mask of the tensors with a non-finite
    scale (1 keys, 2 values). ``out``: those four tensors to write into (contiguous, of the
    layout's dtypes and shapes).
    """
    return _int8_layer_encode(keys, values, out, centred=False)


def int8_decode_layer(
    views: Sequence[torch.Tensor], out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`int8_decode` of a layer's ``(kq, kscale, vq, vscale)`` (checked views) to the scales' dtype
    (bfloat16 or float32) in one C call, or None where it does not apply."""
    return _int8_layer_decode(views, out, centred=False)


def int8c_encode_layer(
    keys: torch.Tensor, values: torch.Tensor, out: Sequence[torch.Tensor] | None = None
) -> tuple[tuple[torch.Tensor, ...], int] | None:
    """int8 layout 2 of a layer in one C call, or None where it does not apply: keys centred on
    their channel's midpoint (the offsets) and quantised per channel, values per token, as
    `kvbus.codecs.int8.Int8Codec.encode_layer`'s torch path computes them.

    Returns ``((kq, kscale, koffset, vq, vscale), bad)`` as `int8_encode_layer`; ``out``: those
    five tensors to write into.
    """
    return _int8_layer_encode(keys, values, out, centred=True)


def int8c_decode_layer(
    views: Sequence[torch.Tensor], out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The decode of `int8c_encode_layer`'s ``(kq, kscale, koffset, vq, vscale)`` (checked views)
    in one C call, or None where it does not apply."""
    return _int8_layer_decode(views, out, centred=True)


def int4_encode_layer(
    keys: torch.Tensor, values: torch.Tensor, key_group: int, value_group: int, out: Sequence[torch.Tensor] | None
) -> tuple[tuple[torch.Tensor, ...], int] | None:
    """`int4_encode` of keys (``axis=2``, groups of ``key_group`` tokens) and values (``axis=3``) in one
    C call, or None where it does not apply.

    Returns ``((kc, kscale, klow, vc, vscale, vlow), bad)`` as `int8_encode_layer`; ``out`` is
    required (the layout's six tensors).
    """
    suffix = _NATIVE_INT8.get(keys.dtype)
    if suffix is None or out is None or not _layer_ok(keys, values, out):
        return None
    shape = tuple(keys.shape)
    kg = _int4_native_group(shape, 2, key_group)
    vg = _int4_native_group(shape, 3, value_group)
    if kg is None or vg is None or keys.shape[2] == 0:
        return None
    lib = _native.library()
    if lib is None:
        return None
    b, h, s, d = shape
    groups = -(-s // kg)
    kc, ks, kl, vc, vs, vl = out
    if kc.numel() * 2 != b * h * groups * kg * d or ks.numel() != b * h * groups * d or kl.numel() != ks.numel():
        return None
    if vc.numel() * 2 != keys.numel() or vs.numel() != b * h * s * (d // vg) or vl.numel() != vs.numel():
        return None
    bad = getattr(lib, f"int4_enc_layer_{suffix}")(
        keys.data_ptr(),
        values.data_ptr(),
        kc.data_ptr(),
        ks.data_ptr(),
        kl.data_ptr(),
        vc.data_ptr(),
        vs.data_ptr(),
        vl.data_ptr(),
        b * h,
        s,
        d,
        kg,
        vg,
    )
    return (kc, ks, kl, vc, vs, vl), int(bad)


def int4_decode_layer(
    views: Sequence[torch.Tensor],
    shape: tuple[int, int, int, int],
    key_group: int,
    value_group: int,
    out: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`int4_decode` of a layer's six checked views to the scales' dtype (bfloat16 or float32) in one
    C call, or None where it does not apply."""
    kc, ks, kl, vc, vs, vl = views
    suffix = _NATIVE_INT8.get(ks.dtype)
    if suffix is None or any(t.dtype != ks.dtype for t in (kl, vs, vl)) or not _plain(kc, ks, kl, vc, vs, vl):
        return None
    kg = _int4_native_group(shape, 2, key_group)
    vg = _int4_native_group(shape, 3, value_group)
    b, h, s, d = shape
    if kg is None or vg is None or s == 0:
        return None
    groups = -(-s // kg)
    if kc.numel() * 2 != b * h * groups * kg * d or ks.numel() != b * h * groups * d or kl.numel() != ks.numel():
        return None
    if vc.numel() * 2 != b * h * s * d or vs.numel() != b * h * s * (d // vg) or vl.numel() != vs.numel():
        return None
    lib = _native.library()
    if lib is None:
        return None
    if out is None:
        out = (torch.empty(shape, dtype=ks.dtype), torch.empty(shape, dtype=ks.dtype))
    elif not _plain(*out) or any(o.dtype != ks.dtype or tuple(o.shape) != tuple(shape) for o in out):
        return None
    getattr(lib, f"int4_dec_layer_{suffix}")(
        kc.data_ptr(),
        ks.data_ptr(),
        kl.data_ptr(),
        vc.data_ptr(),
        vs.data_ptr(),
        vl.data_ptr(),
        out[0].data_ptr(),
        out[1].data_ptr(),
        b * h,
        s,
        d,
        kg,
        vg,
    )
    return out
