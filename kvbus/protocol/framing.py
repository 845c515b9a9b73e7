"""Messages of a transfer's stream: the `Open` (framed with its inline payload), its reply,
acknowledgements and the chunk headers.

Bulk data travels as chunk messages whose metadata rides in NATS headers (`CHUNK_INDEX_HEADER`,
`CHUNK_SUM_HEADER`) so the payload is never copied to add a prefix.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import ClassVar

from kvbus.errors import WireFormatError
from kvbus.protocol.wire import Message, OptStr, message
from kvbus.reasons import Reason

#: Largest codec metadata map inside an `Open`.
MAX_META_BYTES = 256 * 1024

CHUNK_INDEX_HEADER = "Kvbus-Chunk"
CHUNK_SUM_HEADER = "Kvbus-Sum"
#: On the last chunk of a streamed transfer: the whole-payload digest.
ROOT_SUM_HEADER = "Kvbus-Root"


@message(
    "open",
    {
        "transfer_id": str,
        "src": str,
        "codec": str,
        "meta": dict,
        "sizes": list,
        "total": int,
        "chunk_size": int,
        "n_chunks": int,
        "digest": str,
        "window": int,
        "data_subject": str,
        "ack_subject": str,
        "inline": bool,
        "traceparent": OptStr,
        "trace_link": OptStr,
    },
)
@dataclass(frozen=True, slots=True)
class Open(Message):
    """Sender -> receiver: a transfer is about to stream (or, ``inline``, is in this message).

    On the wire an `Open` is ``u32 length | msgpack(Open) | inline payload``.
    """

    transfer_id: str
    src: str
    codec: str
    meta: dict
    sizes: list
    total: int
    chunk_size: int
    n_chunks: int
    digest: str
    """xxh3-128 hex digest of the whole payload for an inline transfer; empty when streamed
    (the last chunk carries it in `ROOT_SUM_HEADER`)."""
    window: int
    data_subject: str
    ack_subject: str
    inline: bool = False
    traceparent: str | None = None
    """The sender's ``kvbus.send`` span: the receiver's spans are its children."""
    trace_link: str | None = None
    """When the sender does not trace: the scheduler's root ``kvbus.schedule`` span (the grant's
    ``traceparent``), which the receiver's own root span links to."""

    _PREFIX: ClassVar[struct.Struct] = struct.Struct("!I")

    def frame(self, inline_payload: bytes | memoryview = b"") -> bytes:
        """The wire form: ``u32 length | msgpack(Open) | inline payload``."""
        head = self.encode()
        return self._PREFIX.pack(len(head)) + head + bytes(inline_payload)

    @classmethod
    def unframe(cls, data: bytes | memoryview) -> tuple[Open, memoryview]:
        """Split a framed `Open` into the message and its inline payload."""
        view = memoryview(data)
        if len(view) < cls._PREFIX.size:
            raise WireFormatError("open message", f"{len(view)} bytes is shorter than its length prefix")
        (n,) = cls._PREFIX.unpack_from(view)
        if n > MAX_META_BYTES + 4096:
            raise WireFormatError("open message", f"header of {n} bytes is over the limit of {MAX_META_BYTES + 4096}")
        if cls._PREFIX.size + n > len(view):
            raise WireFormatError("open message", f"header claims {n} bytes, only {len(view) - 4} present")
        msg = cls.decode(view[cls._PREFIX.size : cls._PREFIX.size + n])
        msg.check()
        return msg, view[cls._PREFIX.size + n :]

    def check(self) -> None:
        """Consistency of sizes and counts (each field's type is already checked)."""
        what = "open message"
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in self.sizes):
            raise WireFormatError(what, "sizes must be non-negative integers")
        if sum(self.sizes) != self.total or self.total < 0:
            raise WireFormatError(what, f"sizes add up to {sum(self.sizes)}, total says {self.total}")
        if self.chunk_size <= 0:
            raise WireFormatError(what, f"chunk_size {self.chunk_size} must be positive")
        if not 0 <= self.n_chunks <= self.total or (self.total and not self.n_chunks):
            raise WireFormatError(what, f"n_chunks {self.n_chunks} does not fit a total of {self.total} bytes")
        if not 0 < self.window <= 1 << 16:
            raise WireFormatError(what, f"window {self.window} is out of range")
        if len(self.digest) not in ((32,) if self.inline else (0, 32)):
            raise WireFormatError(what, "digest must be 32 hex characters (or empty for a streamed transfer)")


@message(
    "open_reply",
    {"transfer_id": str, "ok": bool, "reason": str, "done": bool, "decode_s": float, "next": int, "code": Reason},
)
@dataclass(frozen=True, slots=True)
class OpenReply(Message):
    """Receiver -> sender: ready to receive, done (inline), or refused and why."""

    transfer_id: str
    ok: bool
    reason: str = ""
    done: bool = False
    decode_s: float = 0.0
    next: int = 0
    """For a transfer already under way: the lowest chunk index the receiver still needs."""
    code: Reason = Reason.NONE
    """Why it was refused, as a code to match on (`reason` is for people)."""


@message(
    "ack",
    {
        "transfer_id": str,
        "rx": str,
        "next": int,
        "received": int,
        "missing": list,
        "done": bool,
        "ok": bool,
        "reason": str,
        "decode_s": float,
        "code": Reason,
    },
)
@dataclass(frozen=True, slots=True)
class Ack(Message):
    """Receiver -> sender: credit and repair requests, and the final verdict.

    ``next`` is the lowest chunk index not yet received (all below it are in); ``missing`` lists
    chunks to send again; ``done`` with ``ok`` means the payload arrived whole, verified and
    decoded; ``done`` without ``ok`` means the receiver gave up (``reason`` says why).
    """

    transfer_id: str
    rx: str
    next: int
    received: int
    missing: list = field(default_factory=list)
    done: bool = False
    ok: bool = True
    reason: str = ""
    decode_s: float = 0.0
    code: Reason = Reason.NONE
    """Why it was refused, as a code to match on (`reason` is for people)."""


@message("ping", {"transfer_id": str, "src": str})
@dataclass(frozen=True, slots=True)
class Ping(Message):
    """Sender -> receiver liveness check (request on the receiver's ``ping`` subject)."""

    transfer_id: str = ""
    src: str = ""
