"""Messages of a transfer's stream: the `Open` (framed with its inline payload), its reply,
acknowledgements and the chunk headers.

Bulk data travels as chunk messages whose metadata rides in NATS headers (`CHUNK_INDEX_HEADER`,
`CHUNK_SUM_HEADER`) so the payload is never copied to add a prefix.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvbus.errors import WireFormatError
from kvbus.protocol.wire import Message, OptStr, message
from kvbus.reasons import Reason

#: Largest codec metadata map inside an `Open`.
MAX_META_BYTES = 256 * 1024

CHUNK_INDEX_HEADER = "Kvbus-Chunk"
CHUNK_SUM_HEADER = "Kvbus-Sum"
#: On the last chunk of a streamed transfer: the whole-payload digest.
ROOT_SUM_HEADER = "Kvbus-Root"

#: The data paths a transfer's bytes can take, fastest first (`PathOffer`, `Open.paths`).
PATH_NAMES = ("shm", "tcp", "nats")
#: Hex characters of a one-time transfer token (32 random bytes).
TOKEN_HEX = 64
#: Longest a transfer token may stay valid, in seconds.
MAX_TOKEN_TTL_S = 3600.0
_HOST_ID_RE = re.compile(r"^[0-9a-f]{32}$")
_TOKEN_RE = re.compile(r"^[0-9a-f]{64}$")
#: An abstract Unix socket name (Linux, no file behind it).
_SHM_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")
#: A host name, an IPv4 or an IPv6 address (no brackets, no port).
_TCP_HOST_RE = re.compile(r"^[A-Za-z0-9_.:%-]{1,253}$")


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
        "paths": list,
        "host": str,
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
    paths: list = field(default_factory=list)
    """The data paths the sender may use (names from `PATH_NAMES`), fastest first; empty: an
    older sender, NATS only. The receiver offers direct paths only from this list."""
    host: str = ""
    """The sender's host identity (32 hex characters), empty if unknown: the receiver offers
    ``shm`` only to a sender on its own host."""

    _PREFIX: ClassVar[struct.Struct] = struct.Struct("!I")

    def frame(self, inline_payload: bytes | memoryview = b"") -> bytes:
        """This `Open` framed for the wire: a 4-byte length, the message, then any inline payload."""
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
        check_path_names(what, self.paths)
        if self.host and not _HOST_ID_RE.match(self.host):
            raise WireFormatError(what, "host must be 32 lowercase hex characters (or empty)")


@message(
    "open_reply",
    {
        "transfer_id": str,
        "ok": bool,
        "reason": str,
        "done": bool,
        "decode_s": float,
        "next": int,
        "code": Reason,
        "host": str,
        "shm": str,
        "tcp_host": str,
        "tcp_port": int,
        "tls": bool,
        "token": str,
        "token_ttl_s": float,
        "paths": list,
    },
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
    host: str = ""
    """The receiver's host identity (32 hex characters); empty: it offers no direct path."""
    shm: str = ""
    """Abstract Unix socket name of the receiver's shared-memory listener; empty: no ``shm``."""
    tcp_host: str = ""
    """Address of the receiver's data listener; empty: no ``tcp``."""
    tcp_port: int = 0
    """Port of the receiver's data listener (1..65535 when `tcp_host` is set)."""
    tls: bool = False
    """The data listener speaks TLS only (the deployment uses TLS)."""
    token: str = ""
    """One-time transfer token (64 hex characters) a direct connection presents for this
    transfer; a re-sent `Open` gets a new one and the old one stops working."""
    token_ttl_s: float = 0.0
    """Seconds the token stays valid if unused."""
    paths: list = field(default_factory=list)
    """The paths the receiver takes this transfer's bytes on (names from `PATH_NAMES`); empty:
    an older receiver, NATS only. A sender never falls back to a path not listed."""

    def __post_init__(self) -> None:
        check_path_names("open_reply message", self.paths)
        if self.host or self.shm or self.tcp_host or self.tcp_port or self.token or self.tls or self.token_ttl_s:
            PathOffer.from_reply(self)

    @property
    def offer(self) -> PathOffer | None:
        """The direct paths this reply offers, or None when it offers none."""
        return PathOffer.from_reply(self) if self.token else None


def check_path_names(what: str, paths: object) -> list[str]:
    """``paths`` as a list of known, distinct path names; `WireFormatError` otherwise."""
    if not isinstance(paths, list) or len(paths) > len(PATH_NAMES):
        raise WireFormatError(what, f"paths must be a list of at most {len(PATH_NAMES)} names")
    for p in paths:
        if p not in PATH_NAMES:
            raise WireFormatError(what, f"unknown path {str(p)[:32]!r}; known: {', '.join(PATH_NAMES)}")
    if len(set(paths)) != len(paths):
        raise WireFormatError(what, "paths must not repeat")
    return paths


@dataclass(frozen=True, slots=True)
class PathOffer:
    """What a receiver's `OpenReply` offers for one transfer's bytes, besides NATS, and how to reach it.

    ``shm`` and ``tcp_host``/``tcp_port`` are where its listeners are; ``token`` is the one-time
    transfer token a direct connection must present (one token for both paths: the first use
    consumes it); ``host`` lets the sender check it is on the same host before trying ``shm``.

    Raises:
        WireFormatError: a field is malformed (validated when built, also from the wire).
    """

    host: str
    token: str
    shm: str = ""
    tcp_host: str = ""
    tcp_port: int = 0
    tls: bool = False
    token_ttl_s: float = 30.0

    def __post_init__(self) -> None:
        what = "path offer"
        if not _HOST_ID_RE.match(self.host):
            raise WireFormatError(what, "host must be 32 lowercase hex characters")
        if not _TOKEN_RE.match(self.token):
            raise WireFormatError(what, f"token must be {TOKEN_HEX} lowercase hex characters")
        if self.shm and not _SHM_NAME_RE.match(self.shm):
            raise WireFormatError(what, "shm must be 1-100 letters, digits, '_', '.' or '-'")
        if isinstance(self.tcp_port, bool) or not isinstance(self.tcp_port, int):
            raise WireFormatError(what, "tcp_port must be an integer")
        if self.tcp_host:
            if not _TCP_HOST_RE.match(self.tcp_host):
                raise WireFormatError(what, "tcp_host must be a host name or an IP address")
            if not 1 <= self.tcp_port <= 65535:
                raise WireFormatError(what, f"tcp_port {self.tcp_port} must be within 1..65535")
        elif self.tcp_port:
            raise WireFormatError(what, "tcp_port without tcp_host")
        if not math.isfinite(self.token_ttl_s) or not 0 < self.token_ttl_s <= MAX_TOKEN_TTL_S:
            raise WireFormatError(what, f"token_ttl_s {self.token_ttl_s} must be within (0, {MAX_TOKEN_TTL_S:g}]")
        if not (self.shm or self.tcp_host):
            raise WireFormatError(what, "an offer names at least one direct path (shm or tcp)")

    @classmethod
    def from_reply(cls, reply: OpenReply) -> PathOffer:
        """The offer carried by ``reply``'s path fields; `WireFormatError` if they are malformed."""
        return cls(
            host=reply.host,
            token=reply.token,
            shm=reply.shm,
            tcp_host=reply.tcp_host,
            tcp_port=reply.tcp_port,
            tls=reply.tls,
            token_ttl_s=reply.token_ttl_s,
        )

    def reply_fields(self) -> dict[str, Any]:
        """Keyword arguments that put this offer into an `OpenReply`."""
        return {
            "host": self.host,
            "shm": self.shm,
            "tcp_host": self.tcp_host,
            "tcp_port": self.tcp_port,
            "tls": self.tls,
            "token": self.token,
            "token_ttl_s": self.token_ttl_s,
        }

    @property
    def paths(self) -> tuple[str, ...]:
        """The direct paths offered, fastest first."""
        return tuple(p for p, on in (("shm", bool(self.shm)), ("tcp", bool(self.tcp_host))) if on)

    def __repr__(self) -> str:
        # The token is a credential: never in logs or tracebacks.
        return (
            f"PathOffer(host={self.host!r}, shm={self.shm!r}, tcp={self.tcp_host}:{self.tcp_port}, "
            f"tls={self.tls}, token=***, token_ttl_s={self.token_ttl_s})"
        )


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
