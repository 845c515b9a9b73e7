"""Zero-copy conversion between tensors and wire buffers, and checks of untrusted metadata.

Decoders call these helpers on everything that came from the wire: every size is checked
against the bytes actually received before a tensor is built, so hostile metadata can never
make a decoder allocate more than the payload it was handed.
"""

from __future__ import annotations

import ctypes
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvbus.codecs.errors import DecodeError, NonFiniteValues

#: Most dimensions a decoded tensor may have.
MAX_NDIM = 8
#: Largest single dimension a decoder accepts (2**40: far beyond any real KV).
MAX_DIM = 1 << 40
#: Largest number of elements in one decoded tensor (bounded again by the received bytes).
MAX_ELEMENTS = 1 << 40
#: Not empty once torch's one warning about a read-only buffer has been had (and silenced) in this process.
_READONLY_SILENCED: list[bool] = []


def show(value: object, limit: int = 80) -> str:
    """A short, always-printable rendering of an untrusted value for error messages."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"<int of {value.bit_length()} bits>"
    try:
        text = repr(value)
    except ValueError:  # e.g. a container holding an int too long to print
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def as_bytes(t: torch.Tensor) -> memoryview:
    """A flat ``uint8`` view of ``t``'s memory (any dtype, including ``bfloat16``).

    Zero copy when ``t`` is contiguous; otherwise one contiguous copy is made. The returned
    view keeps the tensor's storage alive.
    """
    if _viewable(t):
        return _span_view(t.data_ptr(), t.nbytes, t)
    flat = t.detach().contiguous().view(-1)
    return flat.view(torch.uint8).numpy().data


def byte_views(tensors: Sequence[torch.Tensor]) -> list[memoryview]:
    """`as_bytes` of each of ``tensors``, for a third of its per-tensor cost: the contiguous CPU
    tensors are slices of one view over the addresses they span (a context has a hundred tensors,
    and a view of its own costs each about 2 us). The views hold all of ``tensors`` alive, and no
    byte outside a tensor is ever read through them."""
    plain = [(t.data_ptr(), t.nbytes) if _viewable(t) else None for t in tensors]
    spans = [s for s in plain if s is not None]
    if len(spans) < 2:
        return [as_bytes(t) for t in tensors]
    lo = min(at for at, _ in spans)
    whole = _span_view(lo, max(at + n for at, n in spans) - lo, list(tensors))
    return [as_bytes(t) if s is None else whole[s[0] - lo : s[0] - lo + s[1]] for t, s in zip(tensors, plain)]


def _viewable(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be viewed in place (contiguous, non-empty, in CPU memory, plain)."""
    return t.is_contiguous() and t.is_cpu and not t.requires_grad and not t.is_conj() and t.nbytes > 0


def _span_view(address: int, nbytes: int, owner: object) -> memoryview:
    """A writable byte view of ``nbytes`` at ``address``, holding ``owner`` (what keeps them valid).

    A ctypes array over the bytes: a sixth of what a view through numpy costs. Its length is
    rounded up to a power of two, so that ctypes makes (and keeps forever) one array type per
    power and not one per size; the view is then cut to ``nbytes`` and the rest never read.
    """
    array = (ctypes.c_ubyte * (1 << (nbytes - 1).bit_length())).from_address(address)
    array.owner = owner  # type: ignore[attr-defined]  # keeps the memory alive with the view
    return memoryview(array).cast("B")[:nbytes]


def buffer_address(buf: memoryview) -> int:
    """The address of the first byte behind ``buf`` (for zero-copy checks)."""
    return int(np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0])


def byte_view(buf: object, codec: str) -> memoryview:
    """``buf`` as a flat, byte-formatted memoryview.

    Raises:
        DecodeError: ``buf`` is not a contiguous buffer.
    """
    try:
        # `buf` is whatever the caller (or the wire) gave: memoryview() itself is the check, and
        # its TypeError is turned into a DecodeError below.
        view = memoryview(buf)  # type: ignore[arg-type]
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
    except (TypeError, ValueError) as exc:
        raise DecodeError(codec, f"a buffer is not a contiguous byte buffer ({exc})") from None
    return view


def check_shape(shape: object, codec: str, what: str = "tensor") -> tuple[int, ...]:
    """Validate an untrusted shape: a short list of non-negative, bounded integers.

    Raises:
        DecodeError: the shape is not a list of integers in range.
    """
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM:
        raise DecodeError(codec, f"{what} shape must be a list of at most {MAX_NDIM} integers, got {show(shape)}")
    for dim in shape:
        if not isinstance(dim, int) or isinstance(dim, bool) or not 0 <= dim <= MAX_DIM:
            raise DecodeError(codec, f"{what} shape {show(shape)} has an entry outside 0..{MAX_DIM}")
    return tuple(shape)


def tensor_from(
    buf: memoryview, dtype: torch.dtype, shape: Sequence[int], codec: str, what: str = "tensor"
) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` viewing ``buf``.

    Zero copy when ``buf`` is suitably aligned (a misaligned one is copied into an aligned
    tensor). A read-only buffer is viewed too: the bus hands decoders the ``bytes`` of the
    chunks it received, which nothing else references, so aliasing them is safe and saves a
    copy of the whole payload.

    Raises:
        DecodeError: the shape is malformed or does not account for exactly ``len(buf)`` bytes.
    """
    dims = check_shape(shape, codec, what)
    view = byte_view(buf, codec)
    numel = math.prod(dims)
    if numel > MAX_ELEMENTS:
        raise DecodeError(codec, f"{what} of shape {list(dims)} has {numel} elements, more than {MAX_ELEMENTS}")
    want = numel * dtype.itemsize
    if view.nbytes != want:
        raise DecodeError(
            codec, f"{what} of shape {list(dims)} in {dtype} needs {want} bytes, its buffer has {view.nbytes}"
        )
    if numel == 0:
        return torch.empty(dims, dtype=dtype)
    return _view_as(view, dtype, dims)


def _view_as(view: memoryview, dtype: torch.dtype, dims: tuple[int, ...]) -> torch.Tensor:
    """The tensor viewing ``view`` (checked: non-empty, exactly ``dims`` of ``dtype``); copied
    only when misaligned."""
    if view.readonly and not _READONLY_SILENCED:
        # torch says "The given buffer is not writable" once per process (TORCH_WARN_ONCE): the
        # first time is silenced here, and no later call pays for catch_warnings (which also
        # swaps the process-wide filter list, racy between threads).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(view, dtype=dtype)
        _READONLY_SILENCED.append(True)
    else:
        t = torch.frombuffer(view, dtype=dtype)
    if t.data_ptr() % dtype.itemsize:
        t = t.clone()
    return t.view(dims)


def tensors_from(
    bufs: Sequence[memoryview],
    dtype: torch.dtype,
    shape: Sequence[int],
    codec: str,
    name: Callable[[int], str],
    *,
    region: memoryview | None = None,
    offsets: Sequence[int] = (),
) -> list[torch.Tensor]:
    """`tensor_from` for buffers that all hold a tensor of one ``dtype`` and ``shape`` (a
    layout's buffer in every layer): the shape is checked once; ``name(i)`` names buffer ``i``
    in an error. With the ``region`` they were sliced from and their ``offsets`` in it, buffers
    at a constant stride are viewed with one tensor (a tensor per buffer costs microseconds,
    and a context has a hundred of them).

    Raises:
        DecodeError: the shape is malformed or does not account for exactly a buffer's bytes.
    """
    if not bufs:
        return []
    first = tensor_from(bufs[0], dtype, shape, codec, name(0))
    dims = tuple(first.shape)
    want = first.numel() * dtype.itemsize
    if region is not None and len(offsets) == len(bufs) > 2 and want:
        strided = _strided(bufs, region, offsets, dtype, dims, want, first.data_ptr())
        if strided is not None:
            return strided
    out = [first]
    for i in range(1, len(bufs)):
        view = byte_view(bufs[i], codec)
        if view.nbytes != want or not want:
            out.append(tensor_from(view, dtype, dims, codec, name(i)))  # says what is wrong (or builds an empty one)
        else:
            out.append(_view_as(view, dtype, dims))
    return out


def _strided(
    bufs: Sequence[memoryview],
    region: memoryview,
    offsets: Sequence[int],
    dtype: torch.dtype,
    dims: tuple[int, ...],
    want: int,
    at: int,
) -> list[torch.Tensor] | None:
    """The tensors of ``bufs`` as views of one tensor over ``region``, when they lie in it at a
    constant stride, each exactly ``want`` bytes, element-aligned (the first at address ``at``);
    else None (viewed one by one)."""
    start, step, n = offsets[0], offsets[1] - offsets[0], len(bufs)
    size = dtype.itemsize
    end = start + (n - 1) * step + want
    if step < want or step % size or start % size or start < 0 or end > region.nbytes:
        return None
    # Compared as whole lists: a check per buffer in Python costs more than the views it saves.
    if list(offsets) != list(range(start, end - want + 1, step)) or set(map(len, bufs)) != {want}:
        return None
    span = region[start:end]
    if span.format != "B" or span.ndim != 1:
        return None
    flat = _view_as(span, dtype, ((end - start) // size,))
    if flat.data_ptr() != at:
        return None  # not where the first buffer lies (or copied for alignment): one by one
    inner = [1] * len(dims)
    for k in range(len(dims) - 2, -1, -1):
        inner[k] = inner[k + 1] * dims[k + 1]
    return list(flat.as_strided((n, *dims), (step // size, *inner)).unbind(0))


def require_finite(codec: str, *reduced: tuple[str, torch.Tensor]) -> None:
    """Refuse to encode data whose reductions (per-slice absmax scales, minimums, a Gram matrix)
    are not all finite.

    NaN and inf propagate through those reductions, so checking them, which the encoder computed
    anyway and which are far smaller than the data, finds every non-finite element without a
    pass over the data itself.

    Raises:
        NonFiniteValues: one of them holds NaN or inf (``what`` names the first such tensor).
    """
    for what, t in reduced:
        if not bool(torch.isfinite(t).all()):
            raise NonFiniteValues(codec, what)


def check_tokens(tokens: torch.Tensor, vocab_size: int, codec: str) -> None:
    """Reject token ids that are negative or not below ``vocab_size`` (0 means unchecked).

    Raises:
        DecodeError: a token id is out of range.
    """
    if tokens.numel() == 0:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or (vocab_size > 0 and high >= vocab_size):
        limit = f"0..{vocab_size - 1}" if vocab_size > 0 else "non-negative"
        raise DecodeError(codec, f"token ids range over {low}..{high}, expected {limit}")


# -- metadata ---------------------------------------------------------------------------------


def require_map(meta: object, codec: str) -> Mapping[str, Any]:
    """``meta`` itself, checked to be a map.

    Raises:
        DecodeError: ``meta`` is not a dict.
    """
    if not isinstance(meta, Mapping):
        raise DecodeError(codec, f"metadata must be a map, got {type(meta).__name__}")
    return meta


def _get(meta: Mapping[str, Any], key: str, codec: str) -> Any:
    try:
        return meta[key]
    except KeyError:
        raise DecodeError(codec, f"metadata field {key!r} is missing") from None


def meta_int(meta: Mapping[str, Any], key: str, codec: str, lo: int, hi: int) -> int:
    """An integer field within ``lo..hi`` (inclusive).

    Raises:
        DecodeError: the field is missing, not an integer, or out of range.
    """
    value = _get(meta, key, codec)
    if not isinstance(value, int) or isinstance(value, bool):
        raise DecodeError(codec, f"metadata field {key!r} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise DecodeError(codec, f"metadata field {key!r}={show(value)} is outside {lo}..{hi}")
    return value


def meta_float(meta: Mapping[str, Any], key: str, codec: str, lo: float, hi: float) -> float:
    """A finite number field within ``lo..hi`` (inclusive), as a float.

    Raises:
        DecodeError: the field is missing, not a number, or out of range.
    """
    value = _get(meta, key, codec)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise DecodeError(codec, f"metadata field {key!r} must be a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not lo <= number <= hi:  # also rejects NaN
        raise DecodeError(codec, f"metadata field {key!r}={show(value)} is outside {lo}..{hi}")
    return number


def meta_bool(meta: Mapping[str, Any], key: str, codec: str) -> bool:
    """A boolean field.

    Raises:
        DecodeError: the field is missing or not a boolean.
    """
    value = _get(meta, key, codec)
    if not isinstance(value, bool):
        raise DecodeError(codec, f"metadata field {key!r} must be a boolean, got {type(value).__name__}")
    return value


def meta_str(meta: Mapping[str, Any], key: str, codec: str, choices: Sequence[str] | None = None) -> str:
    """A string field, optionally one of ``choices``.

    Raises:
        DecodeError: the field is missing, not a string, or not one of ``choices``.
    """
    value = _get(meta, key, codec)
    if not isinstance(value, str):
        raise DecodeError(codec, f"metadata field {key!r} must be a string, got {type(value).__name__}")
    if choices is not None and value not in choices:
        raise DecodeError(codec, f"metadata field {key!r}={show(value)} is not one of {sorted(choices)}")
    return value


def meta_list(meta: Mapping[str, Any], key: str, codec: str, length: int) -> list[Any]:
    """A list field of exactly ``length`` entries.

    Raises:
        DecodeError: the field is missing, not a list, or of another length.
    """
    value = _get(meta, key, codec)
    if not isinstance(value, (list, tuple)):
        raise DecodeError(codec, f"metadata field {key!r} must be a list, got {type(value).__name__}")
    if len(value) != length:
        raise DecodeError(codec, f"metadata field {key!r} has {len(value)} entries, expected {length}")
    return list(value)


def check_buffer_count(buffers: object, expected: int, codec: str) -> list[memoryview]:
    """The payload buffers as byte views, checked to be exactly ``expected`` of them.

    Raises:
        DecodeError: ``buffers`` is not a list of that many byte buffers.
    """
    if not isinstance(buffers, (list, tuple)):
        raise DecodeError(codec, f"buffers must be a list, got {type(buffers).__name__}")
    if len(buffers) != expected:
        raise DecodeError(codec, f"expected {expected} buffers, got {len(buffers)}")
    # A flat byte memoryview (what the bus hands a decoder) is taken as it is, without a call.
    return [b if type(b) is memoryview and b.ndim == 1 and b.format == "B" else byte_view(b, codec) for b in buffers]
