"""Errors of the codec library."""

from __future__ import annotations

from collections.abc import Iterable

from kvbus.errors import KVBusError, WireFormatError


class CodecError(KVBusError):
    """Root of codec errors."""


class UnknownCodec(CodecError, ValueError):
    """A medium name is not registered (a `ValueError`, like `SpecError`).

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


class NonFiniteValues(CodecError, ValueError):
    """A lossy medium was asked to encode a KV holding NaN or infinite values.

    Its scales (or basis) would be NaN or infinite and every element sharing them would come back
    wrong while the fidelity figure still looked fine, so it refuses; ``full`` carries such values
    exactly (and the bus falls back to it when the medium was the scheduler's choice).

    Attributes:
        codec: the medium.
        what: which tensor holds them (``"keys[3]"``).
    """

    def __init__(self, codec: str, what: str) -> None:
        self.codec = codec
        self.what = what
        super().__init__(
            f"{what} holds NaN or infinite values, which the lossy {codec!r} medium cannot carry; "
            f"send it with medium='full' (which carries them exactly) or clean the KV first"
        )


class RecomputeUnavailable(CodecError):
    """A medium needs the receiver's model to rebuild the KV, and none was given."""

    def __init__(self, codec: str) -> None:
        self.codec = codec
        super().__init__(f"the {codec!r} medium needs a model runner on the receiver to recompute the KV")


class SpecError(CodecError, ValueError):
    """A medium spec (``"topk(0.25)+int8"``) is malformed, has a bad parameter, or composes badly.

    Attributes:
        spec: the spec as given (shortened when long).
        reason: what is wrong with it.
    """

    def __init__(self, spec: str, reason: str) -> None:
        self.spec = spec
        self.reason = reason
        super().__init__(f"bad medium spec {spec!r}: {reason}")


class DeltaBaseMismatch(CodecError, ValueError):
    """A delta payload does not apply to the receiver's base (missing, wrong, stale or too short).

    The receiver must ask for a full (non-delta) transfer; it never gets a wrong cache.

    Attributes:
        reason: what did not match.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"delta does not apply to the receiver's base: {reason}")


class SummaryUnavailable(CodecError):
    """The `summary` medium cannot summarise: the sender gave no model runner that can generate.

    Attributes:
        reason: what is missing.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"cannot make a summary: {reason}")


class CalibrationError(CodecError, ValueError):
    """A calibration profile is missing, malformed, or of an unknown version.

    Attributes:
        path: where it was read from (or ``"<memory>"``).
        reason: what was wrong.
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"calibration profile {path}: {reason}")
