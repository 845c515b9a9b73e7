"""Errors of the cache tier."""

from __future__ import annotations

from kvbus.errors import KVBusError, WireFormatError


class CacheTierError(KVBusError):
    """Root of cache-tier errors."""


class TierClosed(CacheTierError):
    """The tier was closed."""

    def __init__(self) -> None:
        super().__init__("the cache tier is closed")


class RecordFormatError(CacheTierError, WireFormatError):
    """A block record read from the remote tier is malformed (hostile, truncated or foreign).

    Attributes:
        what: which part of the record was being decoded.
        reason: what was wrong with it.
    """

    def __init__(self, what: str, reason: str) -> None:
        WireFormatError.__init__(self, what, reason)


class RemoteUnavailable(CacheTierError, ConnectionError):
    """The remote tier (a Redis-protocol server) cannot be reached or refused us.

    Attributes:
        url: the server's URL with any password removed.
        reason: what went wrong.
    """

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        self.reason = reason
        super().__init__(f"remote cache tier at {url} is unavailable: {reason}")


class BlockUnavailable(CacheTierError, LookupError):
    """Blocks of a context are neither in memory nor remote, and cannot be recomputed.

    Attributes:
        keys: the block keys that are missing.
        reason: why they could not be rebuilt.
    """

    def __init__(self, keys: list[str], reason: str) -> None:
        self.keys = list(keys)
        self.reason = reason
        shown = ", ".join(k[:12] for k in self.keys[:4]) + (" ..." if len(self.keys) > 4 else "")
        super().__init__(f"{len(self.keys)} block(s) unavailable ({shown}): {reason}")


class ContextMismatch(CacheTierError, ValueError):
    """A context does not fit the tier (another model, dtype or shape).

    Attributes:
        expected: what the tier holds.
        got: what was given.
    """

    def __init__(self, expected: str, got: str) -> None:
        self.expected = expected
        self.got = got
        super().__init__(f"context does not fit the cache tier: expected {expected}, got {got}")


class UnsuitableCodec(CacheTierError, ValueError):
    """A codec cannot store blocks on its own (it carries no KV, or needs a base to decode).

    Attributes:
        codec: the codec spec.
        reason: why it does not fit.
    """

    def __init__(self, codec: str, reason: str) -> None:
        self.codec = codec
        self.reason = reason
        super().__init__(f"codec {codec!r} cannot store cache-tier blocks: {reason}")
