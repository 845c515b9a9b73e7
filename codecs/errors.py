"""Errors of the codec library."""

from __future__ import annotations

from collections.abc import Iterable

from kvbus.errors import KVBusError, WireFormatError


class CodecError(KVBusError):
    """Root of codec errors."""


class UnknownCodec(CodecError, ValueError):
    """A medium name is not registered.

    Attributes:
        name: the name asked for.
        known: the registered names.
    """

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = sorted(known)
        super().__init__(f"unknown codec {name!r}; known codecs: {', '.join(self.known)}")


class DecodeError(CodecError, WireFormatError):
    """An encoded payload or its metadata cannot be decoded (truncated, corrupted, hostile)."""

    def __init__(self, codec: str, reason: str) -> None:
        self.codec = codec
        WireFormatError.__init__(self, f"{codec} payload", reason)


class RecomputeUnavailable(CodecError):
    """A medium needs the receiver's model to rebuild the KV, and none was given."""

    def __init__(self, codec: str) -> None:
        self.codec = codec
        super().__init__(f"the {codec!r} medium needs a model runner on the receiver to recompute the KV")
