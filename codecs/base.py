"""The codec family: `Codec`, `Encoded`, and the registry of media."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

import torch

from kvbus.codecs.errors import DecodeError, UnknownCodec
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature


class ModelRunner(Protocol):
    """What a receiver needs to rebuild KV from tokens (the `tokens` and `summary` media)."""

    signature: ModelSignature

    def prefill(self, tokens: torch.Tensor) -> KVCache:
        """Run the model over ``tokens`` ``[batch, n]`` and return their KV-cache."""
        ...


@dataclass(eq=False)
class Encoded:
    """A KV-cache in one medium, ready for the wire.

    ``buffers`` are views of the encoded tensors (no copies of big tensors); on the wire they
    travel back to back, and ``meta`` (small, msgpack-able) says how to read them.
    """

    codec: str
    """The medium spec that produced it (e.g. ``"int8"``)."""
    meta: dict[str, Any]
    """Small metadata: shapes, dtypes, the model signature, codec parameters."""
    buffers: list[memoryview]
    """Byte views of the payload, in wire order."""
    keepalive: list[Any] = field(default_factory=list, repr=False)
    """Objects (tensors) that own the memory behind ``buffers``."""

    @property
    def nbytes(self) -> int:
        """Payload bytes on the wire (the metadata is not counted)."""
        return sum(b.nbytes for b in self.buffers)

    @property
    def sizes(self) -> list[int]:
        return [b.nbytes for b in self.buffers]

    @classmethod
    def from_payload(cls, codec: str, meta: dict[str, Any], payload: memoryview | bytes | bytearray,
                     sizes: Sequence[int]) -> Encoded:
        """Split a received contiguous payload back into its buffers (views, no copies).

        Raises:
            DecodeError: the sizes do not add up to the payload.
        """
        view = memoryview(payload).cast("B")
        if not isinstance(sizes, (list, tuple)) or not all(isinstance(n, int) and n >= 0 for n in sizes):
            raise DecodeError(codec, "buffer sizes must be a list of non-negative integers")
        if sum(sizes) != view.nbytes:
            raise DecodeError(codec, f"buffer sizes add up to {sum(sizes)} bytes, payload has {view.nbytes}")
        buffers, offset = [], 0
        for n in sizes:
            buffers.append(view[offset:offset + n])
            offset += n
        return cls(codec=codec, meta=meta, buffers=buffers, keepalive=[payload])


class Codec(ABC):
    """One medium: how a KV-cache is turned into bytes and back.

    Subclasses set ``name`` and ``lossless`` and implement `encode` / `decode`. ``decode``
    must treat ``encoded`` as hostile: every size, shape and count in ``meta`` is checked
    before memory is allocated, and anything wrong raises `DecodeError`.
    """

    name: ClassVar[str]
    lossless: ClassVar[bool] = False
    needs_kv: ClassVar[bool] = True
    """False for media that carry no KV (the receiver recomputes)."""
    fidelity: ClassVar[float] = 1.0
    """Default fidelity factor of one hop (calibration replaces it with a measured one)."""
    cheap_decode: ClassVar[bool] = False
    """True when decode only builds views (no pass over the data): run it on the event loop."""

    def usable(self, sender: ModelSignature, receiver: ModelSignature) -> bool:
        """Whether a receiver with ``receiver`` can use what a sender with ``sender`` encodes."""
        return not self.needs_kv or sender.compatible_with(receiver)

    @abstractmethod
    def encode(self, kv: KVCache) -> Encoded:
        """Encode ``kv``; the result's buffers may share memory with it."""

    @abstractmethod
    def decode(self, encoded: Encoded, *, base: KVCache | None = None,
               runner: ModelRunner | None = None) -> KVCache:
        """Rebuild a KV-cache.

        Args:
            encoded: what `encode` produced, possibly after a trip over the wire.
            base: the receiver's cache for delta media.
            runner: the receiver's model, for media that recompute.

        Raises:
            DecodeError: the payload or metadata is malformed.
        """

    def estimate_nbytes(self, signature: ModelSignature, n_tokens: int, batch: int = 1) -> int:
        """Predicted payload bytes for ``n_tokens`` of context (used before encoding)."""
        return batch * n_tokens * (signature.kv_bytes_per_token() + 8)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


C = TypeVar("C", bound=type[Codec])

_REGISTRY: dict[str, Callable[[], Codec]] = {}


def register(name: str) -> Callable[[C], C]:
    """Class decorator that registers a codec under ``name``."""

    def wrap(cls: C) -> C:
        if name in _REGISTRY:
            raise ValueError(f"codec {name!r} is registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def get_codec(name: str) -> Codec:
    """The codec registered under ``name``.

    Raises:
        UnknownCodec: (a `ValueError`) listing the known names.
    """
    try:
        factory = _REGISTRY[name]
    except (KeyError, TypeError):
        raise UnknownCodec(str(name), _REGISTRY) from None
    return factory()


def available_codecs() -> list[str]:
    """Names of every registered medium."""
    return sorted(_REGISTRY)
