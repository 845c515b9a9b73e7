"""Messages of a transfer's stream: the `Open` (framed with its inline payload), its reply,
acknowledgements and the chunk headers.

Bulk data travels as chunk messages whose metadata rides in NATS headers (`CHUNK_INDEX_HEADER`,
`CHUNK_SUM_HEADER`) so the payload is never copied to add a prefix.
"""

from __future__ import annotations

import enum
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvbus.errors import WireFormatError
from kvbus.protocol.wire import MAX_BYTES, MAX_COUNT, MAX_SECONDS, ListOf, Message, OptStr, float_in, int_in, message
from kvbus.reasons import Reason

#: Largest codec metadata map inside an `Open` (real ones take well under 1 KB; the bound keeps
#: what one `Open` costs to decode small).
MAX_META_BYTES = 64 * 1024
#: Smallest chunk size an `Open` may name: a smaller one would make a receiver's per-chunk
#: bookkeeping far larger than the bytes the sender announced.
MIN_CHUNK_SIZE = 1024
#: Largest chunk size an `Open` may name (receivers also refuse chunks over their server's max_payload).
MAX_CHUNK_SIZE = 1 << 30
#: Most chunks one transfer may have (16 GB at 1 MB chunks): bounds the digest list of an `Open`
#: and the per-chunk state a receiver keeps.
MAX_CHUNKS = 16384
#: Most buffers (``sizes``) one payload may have.
MAX_BUFFERS = 4096
#: Largest payload an `Open` may announce at all (receivers have their own, lower limit).
MAX_TOTAL = 1 << 48
#: Bytes of one chunk digest in `Open.digests` (xxh3-64, big-endian).
DIGEST_BYTES = 8
#: Longest receiver incarnation id.
MAX_INCARNATION = 32
#: Longest idempotency key of a send (`Open.idempotency_key`).
MAX_IDEMPOTENCY_KEY = 128
#: Longest label of a send (`Open.label`).
MAX_LABEL = 128

CHUNK_INDEX_HEADER = "Kvbus-Chunk"
#: Formerly each chunk's own digest; receivers now verify chunks against `Open.digests` only and
#: ignore this header (kept so that tools and fault injectors that set it keep working).
CHUNK_SUM_HEADER = "Kvbus-Sum"
#: Formerly the whole-payload digest on the last chunk; ignored (the `Open` carries it).
ROOT_SUM_HEADER = "Kvbus-Root"


class PathName(enum.StrEnum):
    """The data paths a transfer's bytes can take, fastest first; on the wire, their values.

    The one name for a path everywhere: the bus's path objects (`kvbus.bus.paths`) and the
    parts above the bus (the scheduler's link estimates) both use it.
    """

    SHM = "shm"
    """Shared memory: same host, an anonymous segment passed over a Unix socket."""
    TCP = "tcp"
    """A direct TCP (or TLS) connection between the two processes."""
    NATS = "nats"
    """Through the NATS server, as chunk messages on the transfer's data subject."""


#: The data paths' wire names, fastest first (`PathOffer`, `Open.paths`).
PATH_NAMES: tuple[str, ...] = tuple(p.value for p in PathName)
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


class OpenOverLimit(WireFormatError):
    """An `Open` announces more than the protocol allows (chunks, buffers, bytes): a receiver
    refuses it as `Reason.TOO_LARGE`, before it allocates anything for it."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(what, reason)
        self.args = (f"{what} over the protocol's limits: {reason}",)

    def __str__(self) -> str:
        return str(self.args[0])


#: An inline payload starts at a multiple of this within its message (tensors view it in place).
PAYLOAD_ALIGN = 16


@message(
    "open",
    {
        "transfer_id": str,
        "src": str,
        "codec": str,
        "meta": dict,
        "sizes": ListOf(int_in(0, MAX_BYTES)),
        "total": int_in(0, MAX_BYTES),
        "chunk_size": int_in(1, MAX_BYTES),
        "n_chunks": int_in(0, MAX_COUNT),
        "digest": str,
        "window": int_in(1, 1 << 16),
        "data_subject": str,
        "ack_subject": str,
        "inline": bool,
        "traceparent": OptStr,
        "paths": list,
        "host": str,
        "digests": bytes,
        "incarnation": str,
        "attempt": int_in(0, 1 << 20),
        "retry_age": float_in(0.0, MAX_SECONDS),
        "trace_link": OptStr,
        "idempotency_key": str,
        "label": str,
    },
)
@dataclass(frozen=True, slots=True)
class Open(Message):
    """Sender -> receiver: a transfer is about to stream (or, ``inline``, is in this message).

    On the wire an `Open` is ``u32 length | msgpack(Open) | inline payload``, the payload (when
    there is one) after up to 15 zero bytes that start it at a multiple of `PAYLOAD_ALIGN` within
    the message, so that the receiver's tensors view it in place (a misaligned one is copied). It
    is a request on the receiver's inbox subject ending in the sender's name, so its content is
    the sender's (in secure mode only the sender may publish there): a receiver takes every
    digest from it, never from a chunk.
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
    """xxh3-128 hex digest of the whole payload: for an inline payload over its chunks' digests
    (`kvbus.bus.chunking.tree_digest`), for a streamed one over `digests`
    (`kvbus.bus.chunking.digests_root`)."""
    window: int
    data_subject: str
    ack_subject: str
    inline: bool = False
    traceparent: str | None = None
    """The sender's ``kvbus.send`` span: the receiver's spans are its children."""
    trace_link: str | None = None
    """When the sender does not trace: the scheduler's root ``kvbus.schedule`` span (the grant's
    ``traceparent``), which the receiver's own root span links to."""
    paths: list = field(default_factory=list)
    """The data paths the sender may use (names from `PATH_NAMES`), fastest first; empty: an
    older sender, NATS only. The receiver offers direct paths only from this list."""
    host: str = ""
    """The sender's host identity (32 hex characters), empty if unknown: the receiver offers
    ``shm`` only to a sender on its own host."""
    digests: bytes = b""
    """For a streamed payload: every chunk's xxh3-64 digest, `DIGEST_BYTES` each, in chunk order.
    A chunk that does not match its entry is dropped and asked for again from the sender."""
    incarnation: str = ""
    """On a retried `Open`: the receiver incarnation the sender expects (from an earlier reply),
    empty when it got none. A receiver of another incarnation refuses with
    `Reason.RECEIVER_RESTARTED` rather than deliver a transfer an earlier one may have delivered."""
    attempt: int = 0
    """0 for the first `Open` of a transfer, then 1, 2, ... for retries and status requests."""
    retry_age: float = 0.0
    """On a retry: seconds since the sender's first attempt (its own clock)."""
    idempotency_key: str = ""
    """The caller's key for this send (`Agent.send`), at most `MAX_IDEMPOTENCY_KEY` characters;
    empty: none. A receiver that delivered a transfer from the same sender with the same key
    answers "done" without delivering again."""
    label: str = ""
    """The sender's label for this context (`Agent.send`), at most `MAX_LABEL` characters, handed
    to the receiver as `Delivery.label`; empty: none. The bus gives it no meaning: it is what the
    sender says, and an application that acts on it trusts its sender (whose name the server
    enforces in secure mode) as far as it does."""

    _PREFIX: ClassVar[struct.Struct] = struct.Struct("!I")

    #: Largest msgpack header of a framed `Open`.
    MAX_HEADER: ClassVar[int] = MAX_META_BYTES + MAX_CHUNKS * DIGEST_BYTES + 8192

    def frame(self, inline_payload: bytes | memoryview = b"") -> bytes:
        """This `Open` framed for the wire: a 4-byte length, the message, then any inline payload."""
        return b"".join(self.frame_views([inline_payload]))

    def frame_views(self, inline_payload: Sequence[bytes | memoryview] = ()) -> list[bytes | memoryview]:
        """`frame` as pieces to send back to back: the length and message, then the inline
        payload's pieces as given (not copied)."""
        head = self.encode()
        pieces = [p for p in inline_payload if len(p)]
        pad = b"\0" * (-(self._PREFIX.size + len(head)) % PAYLOAD_ALIGN) if pieces else b""
        return [self._PREFIX.pack(len(head)) + head + pad, *pieces]

    @classmethod
    def unframe(cls, data: bytes | memoryview) -> tuple[Open, memoryview]:
        """Split a framed `Open` into the message and its inline payload.

        Raises:
            OpenOverLimit: it announces more chunks, buffers or bytes than the protocol allows.
            WireFormatError: anything else is malformed.
        """
        view = memoryview(data)
        if len(view) < cls._PREFIX.size:
            raise WireFormatError("open message", f"{len(view)} bytes is shorter than its length prefix")
        (n,) = cls._PREFIX.unpack_from(view)
        if n > cls.MAX_HEADER:
            raise WireFormatError("open message", f"header of {n} bytes is over the limit of {cls.MAX_HEADER}")
        if cls._PREFIX.size + n > len(view):
            raise WireFormatError("open message", f"header claims {n} bytes, only {len(view) - 4} present")
        msg = cls.decode(view[cls._PREFIX.size : cls._PREFIX.size + n])
        if n > MAX_META_BYTES + len(msg.digests) + 8192:
            raise OpenOverLimit("open message", f"header of {n} bytes carries more than {MAX_META_BYTES} of metadata")
        msg.check()
        start = cls._PREFIX.size + n
        if len(view) > start:
            start += -start % PAYLOAD_ALIGN  # the payload is aligned within the message
            if start > len(view) or any(view[cls._PREFIX.size + n : start]):
                raise WireFormatError("open message", "the padding before the inline payload is malformed")
        return msg, view[start:]

    def check(self) -> None:
        """Consistency and bounds of sizes and counts (each field's type is already checked).

        Every count is checked against its bound before anything proportional to it is done (the
        sizes are summed last), so a hostile `Open` costs O(1) work until it is known to be small.

        Raises:
            OpenOverLimit: more chunks, buffers or bytes than the protocol allows.
            WireFormatError: an inconsistent or out-of-range field.
        """
        what = "open message"
        if len(self.sizes) > MAX_BUFFERS:
            raise OpenOverLimit(what, f"{len(self.sizes)} buffers is over the limit of {MAX_BUFFERS}")
        if not 0 <= self.n_chunks <= MAX_CHUNKS:
            raise OpenOverLimit(what, f"n_chunks {self.n_chunks} is outside 0..{MAX_CHUNKS}")
        if not 0 <= self.total <= MAX_TOTAL:
            raise OpenOverLimit(what, f"total {self.total} is outside 0..{MAX_TOTAL}")
        if not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise WireFormatError(what, f"chunk_size {self.chunk_size} is outside {MIN_CHUNK_SIZE}..{MAX_CHUNK_SIZE}")
        if self.n_chunks > self.total or (self.total and not self.n_chunks):
            raise WireFormatError(what, f"n_chunks {self.n_chunks} does not fit a total of {self.total} bytes")
        if self.n_chunks * self.chunk_size < self.total:
            raise WireFormatError(what, f"{self.n_chunks} chunks of {self.chunk_size} bytes cannot hold {self.total}")
        if not 0 < self.window <= 1 << 16:
            raise WireFormatError(what, f"window {self.window} is out of range")
        if len(self.digest) != 32:
            raise WireFormatError(what, "digest must be 32 hex characters")
        want = 0 if self.inline else self.n_chunks * DIGEST_BYTES
        if len(self.digests) != want:
            raise WireFormatError(what, f"digests has {len(self.digests)} bytes, {want} expected")
        if len(self.incarnation) > MAX_INCARNATION:
            raise WireFormatError(what, f"incarnation is longer than {MAX_INCARNATION} characters")
        if len(self.idempotency_key) > MAX_IDEMPOTENCY_KEY:
            raise WireFormatError(what, f"idempotency_key is longer than {MAX_IDEMPOTENCY_KEY} characters")
        if len(self.label) > MAX_LABEL:
            raise WireFormatError(what, f"label is longer than {MAX_LABEL} characters")
        if not 0 <= self.attempt <= 1 << 20:
            raise WireFormatError(what, f"attempt {self.attempt} is out of range")
        if not 0.0 <= self.retry_age <= 1e9:  # also rejects NaN
            raise WireFormatError(what, f"retry_age {self.retry_age} must be finite and not negative")
        sizes = self.sizes
        if not (all(type(s) is int for s in sizes) and min(sizes, default=0) >= 0) and not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sizes
        ):
            raise WireFormatError(what, "sizes must be non-negative integers")
        if sum(self.sizes) != self.total:
            raise WireFormatError(what, f"sizes add up to {sum(self.sizes)}, total says {self.total}")
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
        "decode_s": float_in(0.0, MAX_SECONDS),
        "next": int_in(0, MAX_COUNT),
        "code": Reason,
        "host": str,
        "shm": str,
        "tcp_host": str,
        "tcp_port": int_in(0, 65535),
        "tls": bool,
        "token": str,
        "token_ttl_s": float_in(0.0, MAX_TOKEN_TTL_S),
        "paths": list,
        "incarnation": str,
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
    incarnation: str = ""
    """The receiver's incarnation: a random id per agent start (a retried `Open` names it)."""
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
        "next": int_in(0, MAX_COUNT),
        "received": int_in(0, MAX_COUNT),
        "missing": ListOf(int_in(0, MAX_COUNT)),
        "done": bool,
        "ok": bool,
        "reason": str,
        "decode_s": float_in(0.0, MAX_SECONDS),
        "code": Reason,
    },
)
@dataclass(frozen=True, slots=True)
class Ack(Message):
    """Receiver -> sender: credit and repair requests, and the final verdict.

    Published on `ack_subject` (sender, receiver): the sender takes the receiver from the
    subject and drops an `Ack` whose ``rx`` names another.

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
