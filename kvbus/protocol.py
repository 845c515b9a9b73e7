"""The wire protocol that agents, group schedulers and the coordinator exchange over NATS.

Control messages are msgpack maps with a type tag ``t`` and a protocol version ``v``; each has
a dataclass here with ``encode()`` and a validating ``decode()`` that raises `WireFormatError`
for anything malformed. Bulk data travels as chunk messages whose metadata rides in NATS
headers (`CHUNK_INDEX_HEADER`, `CHUNK_SUM_HEADER`) so the payload is never copied to add a
prefix.

Subjects (``<x>`` are names: letters, digits, ``-`` and ``_``):

=====================================  ========================================================
``kvbus.sched.<group>.request``        agent -> its group scheduler: `TransferRequest` (reply: `RequestAck`)
``kvbus.sched.<group>.done``           agent -> scheduler: `TransferDone`
``kvbus.sched.<group>.probe``          agent -> scheduler: `Probe`
``kvbus.sched.<group>.reserve``        agent -> scheduler: `FlowReservation` (reply: `ReservationReply`)
``kvbus.agent.<agent>.ctl``            scheduler -> agent: `Grant`, `Control` (pause/resume/cancel/rate/shed;
                                       a conditional pause is a request, answered with `ControlReply`)
``kvbus.agent.<agent>.inbox``          sender -> receiver: `Open` (request; reply: `OpenReply`)
``kvbus.agent.<agent>.ack``            receiver -> sender: `Ack`
``kvbus.agent.<rx>.data.<transfer>``   sender -> receiver: chunk messages of a unicast transfer
``kvbus.bcast.<sender>.<transfer>``    sender -> receivers: chunk messages of a broadcast
``kvbus.sched.<group>.register``       agent -> scheduler: `AgentRecord` (secure mode: the scheduler
                                       writes the directory, agents have no JetStream access)
``kvbus.coord.*``                      group schedulers <-> coordinator
=====================================  ========================================================
"""

from __future__ import annotations

import functools
import re
import struct
import time
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, TypeVar

import msgpack

from kvbus.errors import WireFormatError

PROTOCOL_VERSION = 1

#: Largest control message we decode; anything longer is rejected before msgpack sees it.
MAX_CONTROL_BYTES = 1 << 20
#: Largest codec metadata map inside an `Open`.
MAX_META_BYTES = 256 * 1024

CHUNK_INDEX_HEADER = "Kvbus-Chunk"
CHUNK_SUM_HEADER = "Kvbus-Sum"
#: On the last chunk of a streamed transfer: the whole-payload digest.
ROOT_SUM_HEADER = "Kvbus-Root"

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# Bucket names in JetStream KV.
AGENTS_BUCKET = "kvbus_agents"
GROUPS_BUCKET = "kvbus_groups"


def check_name(kind: str, name: object) -> str:
    """Validate an agent or group name (it becomes a NATS subject token)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"invalid {kind} name {name!r}: use 1-64 letters, digits, '-' or '_'")
    return name


# -- subjects ---------------------------------------------------------------------------------


#: What agents send their group scheduler, each on a subject ending in the sender's name
#: (``kvbus.sched.<group>.<kind>.<agent>``): the server's permissions let an agent publish only
#: on its own, and the scheduler refuses a message whose claimed agent is not the subject's.
AGENT_TO_SCHED = ("request", "done", "probe", "reserve", "register")


def sched_subject(group: str, kind: str, agent: str | None = None) -> str:
    """A scheduler subject; with ``agent``, the one that agent sends ``kind`` on (``"*"``: all)."""
    return f"kvbus.sched.{group}.{kind}" if agent is None else f"kvbus.sched.{group}.{kind}.{agent}"


def subject_sender(subject: str) -> str:
    """The agent a per-sender subject (`sched_subject` with an agent) belongs to: its last token."""
    return subject.rsplit(".", 1)[-1]


def agent_subject(agent: str, kind: str) -> str:
    return f"kvbus.agent.{agent}.{kind}"


def inbox_subject(agent: str, sender: str) -> str:
    """Where ``sender`` opens transfers to ``agent``: the receiver's inbox, ending in the sender's
    name (in secure mode an agent may publish only on inboxes ending in its own name, and the
    receiver refuses an `Open` whose ``src`` is not the subject's: no agent can pose as another)."""
    return f"kvbus.agent.{agent}.inbox.{sender}"


def data_subject(agent: str, transfer_id: str) -> str:
    """Chunks of a unicast transfer, under the receiver's own prefix (only it may subscribe)."""
    return f"kvbus.agent.{agent}.data.{transfer_id}"


def bcast_subject(sender: str, transfer_id: str) -> str:
    """Chunks of a broadcast, under the sender's broadcast prefix (receivers that joined it subscribe)."""
    return f"kvbus.bcast.{sender}.{transfer_id}"


def check_data_subject(subject: str, src: str, rx: str, transfer_id: str) -> None:
    """Reject an `Open` whose data subject is not one a receiver may subscribe to for it.

    Raises:
        WireFormatError: ``subject`` is neither ``data_subject(rx, tid)`` nor ``bcast_subject(src, tid)``.
    """
    if subject not in (data_subject(rx, transfer_id), bcast_subject(src, transfer_id)):
        raise WireFormatError("open message", f"data subject {subject[:200]!r} is neither "
                                              f"{data_subject(rx, transfer_id)!r} nor {bcast_subject(src, transfer_id)!r}")


COORD_REGISTER = "kvbus.coord.register"
COORD_GROUPS = "kvbus.coord.groups"
COORD_LEAVE = "kvbus.coord.leave"
COORD_LEASE = "kvbus.coord.lease"
COORD_RESERVE = "kvbus.coord.reserve"
COORD_UNRESERVE = "kvbus.coord.unreserve"
COORD_PLACE = "kvbus.coord.place"
#: JetStream KV bucket of the coordinator's durable state (groups, leases, reservations, tickets).
COORD_BUCKET = "kvbus_coord"


# -- encoding helpers ---------------------------------------------------------------------------

M = TypeVar("M", bound="Message")


def _default(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return asdict(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} on the wire")


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, default=_default)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def unpackb(data: bytes | bytearray | memoryview, what: str, limit: int = MAX_CONTROL_BYTES) -> Any:
    """Decode msgpack from the wire with size limits; raise `WireFormatError` on anything wrong."""
    if len(data) > limit:
        raise WireFormatError(what, f"{len(data)} bytes is over the limit of {limit}")
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_str_len=limit, max_bin_len=limit, max_array_len=1 << 16, max_map_len=1 << 12,
        )
    except Exception as exc:  # msgpack raises a zoo of types for bad input
        raise WireFormatError(what, f"not valid msgpack ({type(exc).__name__}: {exc})") from None


class _Any:
    """Marker: a field of this type accepts any msgpack value (validated by its user)."""


@dataclass(frozen=True, slots=True)
class Message:
    """Base of control messages: ``t`` names the type, the fields are the payload."""

    TYPE: ClassVar[str] = ""

    def encode(self) -> bytes:
        # Shallow: the field values are msgpack-ready (nested dataclasses go through `_default`);
        # `dataclasses.asdict` deep-copies every list and dict and was a sixth of a busy
        # scheduler's time.
        body = {name: getattr(self, name) for name in _field_names(type(self))}
        body["t"] = self.TYPE
        body["v"] = PROTOCOL_VERSION
        return packb(body)

    @classmethod
    def decode(cls: type[M], data: bytes | bytearray | memoryview) -> M:
        """Decode and validate; raises `WireFormatError` for anything malformed."""
        what = f"{cls.TYPE} message"
        body = unpackb(data, what)
        return cls.from_map(body)

    @classmethod
    def from_map(cls: type[M], body: object) -> M:
        what = f"{cls.TYPE} message"
        if not isinstance(body, dict):
            raise WireFormatError(what, f"expected a map, got {type(body).__name__}")
        if body.get("t") != cls.TYPE:
            raise WireFormatError(what, f"type tag is {body.get('t')!r}")
        if body.get("v") != PROTOCOL_VERSION:
            raise WireFormatError(what, f"protocol version {body.get('v')!r}, this side speaks {PROTOCOL_VERSION}")
        kwargs = {}
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name not in body:
                if f.default is not MISSING or f.default_factory is not MISSING:
                    continue
                raise WireFormatError(what, f"missing field {f.name!r}")
            kwargs[f.name] = _check_type(what, f.name, body[f.name], _FIELD_TYPES[cls][f.name])
        return cls(**kwargs)


_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def _check_type(what: str, name: str, value: Any, kind: Any) -> Any:
    if kind is _Any:
        return value
    allowed = kind if isinstance(kind, tuple) else (kind,)
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and bool not in allowed:
        raise WireFormatError(what, f"field {name!r} must be {_names(allowed)}, got bool")
    if not isinstance(value, allowed):
        raise WireFormatError(what, f"field {name!r} must be {_names(allowed)}, got {type(value).__name__}")
    return value


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def _message(tag: str, types: dict[str, Any]):  # noqa: ANN202 - decorator factory
    """Register a message class under its tag with the wire types of its fields."""

    def wrap(cls: type[M]) -> type[M]:
        cls.TYPE = tag
        _FIELD_TYPES[cls] = types
        return cls

    return wrap


_OptFloat = (float, type(None))
_OptStr = (str, type(None))


# -- scheduling -------------------------------------------------------------------------------


@_message("request", {"transfer_id": str, "src": str, "dst": list, "group": str, "n_tokens": int,
                      "nbytes": int, "signature": dict, "medium": _OptStr, "deadline": _OptFloat,
                      "critical": bool, "ts": float, "traceparent": _OptStr, "fidelity": float,
                      "base_tokens": int})
@dataclass(frozen=True, slots=True)
class TransferRequest(Message):
    """An agent asks its group scheduler for permission to send."""

    transfer_id: str
    src: str
    dst: list
    group: str
    n_tokens: int
    nbytes: int
    """Size of the context uncompressed (`full`), for the cost model."""
    signature: dict
    medium: str | None = None
    """A medium the sender insists on, or None to let the scheduler choose."""
    deadline: float | None = None
    critical: bool = False
    ts: float = field(default_factory=time.time)
    traceparent: str | None = None
    fidelity: float = 1.0
    """The context's lineage: product of the fidelity factors of the lossy hops it took."""
    base_tokens: int = 0
    """Tokens of this context every receiver already holds from this sender (enables delta media)."""


@_message("request_ack", {"transfer_id": str, "ok": bool, "reason": str})
@dataclass(frozen=True, slots=True)
class RequestAck(Message):
    """The scheduler's immediate answer to a request: queued, or refused and why."""

    transfer_id: str
    ok: bool
    reason: str = ""


@_message("grant", {"transfer_id": str, "medium": str, "rate_bps": float, "start_at": float,
                    "chunk_size": int, "window": int, "reason": str, "decision": dict, "latency_s": float,
                    "sched_s": float})
@dataclass(frozen=True, slots=True)
class Grant(Message):
    """The scheduler's decision: send with this medium at this rate from this time.

    A grant with an empty ``medium`` refuses the transfer; ``reason`` says why.
    """

    transfer_id: str
    medium: str
    rate_bps: float = 0.0
    """Allocated bandwidth in bytes/s; 0 means unpaced."""
    start_at: float = 0.0
    """Wall-clock time (epoch seconds) at which sending may begin."""
    chunk_size: int = 0
    """Chunk size to use, 0 for the sender's default."""
    window: int = 0
    """Credit window in chunks, 0 for the sender's default."""
    reason: str = ""
    decision: dict = field(default_factory=dict)
    """The decision record: candidates with their predicted cost terms, and why this medium."""
    latency_s: float = 0.0
    """Emulated one-way latency of the path, for link emulation (0 on real links)."""
    sched_s: float = 0.0
    """Seconds from the request leaving its sender (its ``ts``) to this grant leaving the
    scheduler: the scheduling overhead without the way back (0 when not known)."""


@_message("control", {"transfer_id": str, "action": str, "reason": str, "rate_bps": float,
                      "max_fraction": float, "nbytes": int})
@dataclass(frozen=True, slots=True)
class Control(Message):
    """Scheduler -> agent: act on a running transfer, or (``shed``) on the agent's memory.

    - ``pause``: stop at the next chunk boundary, but only if less than ``max_fraction`` of the
      payload has gone out; sent as a request, answered with a `ControlReply` (declined past it).
    - ``resume``: continue from the first chunk not yet sent (nothing acknowledged is resent).
    - ``cancel``: give up the transfer (``reason`` says why).
    - ``rate``: pace the transfer at ``rate_bps`` bytes/s from now on (0 = unpaced).
    - ``shed``: the agent's cache passed its watermark; shed down to ``nbytes`` (0 = the tier's
      own low watermark). ``transfer_id`` is empty.
    """

    ACTIONS: ClassVar[tuple[str, ...]] = ("pause", "resume", "cancel", "rate", "shed")
    transfer_id: str
    action: str
    reason: str = ""
    rate_bps: float = 0.0
    """For ``rate``: the new allocated rate in bytes/s."""
    max_fraction: float = 1.0
    """For ``pause``: pause only if less than this fraction of the payload has been sent."""
    nbytes: int = 0
    """For ``shed``: resident cache bytes to shed down to (0 = the tier's default)."""

    def __post_init__(self) -> None:
        if self.action not in self.ACTIONS:
            raise WireFormatError("control message", f"action {self.action!r} is not one of {self.ACTIONS}")
        if not (0 <= self.rate_bps < float("inf")) or self.nbytes < 0:
            raise WireFormatError("control message", "rate_bps must be finite and nbytes not negative")
        if not 0 <= self.max_fraction <= 1:
            raise WireFormatError("control message", f"max_fraction {self.max_fraction} must be within 0..1")


@_message("control_reply", {"transfer_id": str, "action": str, "ok": bool, "fraction": float, "reason": str})
@dataclass(frozen=True, slots=True)
class ControlReply(Message):
    """Agent -> scheduler: the answer to a `Control` sent as a request (a conditional ``pause``).

    ``ok`` false means the agent declined (``reason`` says why: past the threshold, inline,
    unknown transfer); ``fraction`` is the share of the payload it had sent.
    """

    transfer_id: str
    action: str
    ok: bool
    fraction: float = 0.0
    reason: str = ""


@_message("flow_reserve", {"reservation_id": str, "src": str, "dst": list, "group": str, "period_s": float,
                           "size_bytes": int, "deadline_s": float, "cancel": bool, "ts": float})
@dataclass(frozen=True, slots=True)
class FlowReservation(Message):
    """Agent -> its group scheduler (request on ``kvbus.sched.<group>.reserve``): a periodic critical
    flow from ``src`` to ``dst``: ``size_bytes`` every ``period_s``, each due within ``deadline_s``
    of its period's start. ``cancel`` releases it. Answered with a `ReservationReply`.

    Critical sends from ``src`` to exactly ``dst`` then use the bandwidth set aside.
    """

    reservation_id: str
    src: str
    dst: list
    group: str
    period_s: float
    size_bytes: int
    deadline_s: float
    cancel: bool = False
    ts: float = field(default_factory=time.time)
    """When it was first admitted (wall clock); kept when the scheduler persists it."""


@_message("done", {"transfer_id": str, "src": str, "ok": bool, "medium": str, "nbytes": int,
                   "seconds": float, "error": str, "dst": list, "wire_s": float})
@dataclass(frozen=True, slots=True)
class TransferDone(Message):
    """Sender -> scheduler: the transfer finished (or failed); observed size and time."""

    transfer_id: str
    src: str
    ok: bool
    medium: str
    nbytes: int
    seconds: float
    """Encode + transfer + the receivers' decode: what the cost model predicted."""
    error: str = ""
    dst: list = field(default_factory=list)
    wire_s: float = 0.0
    """Time on the wire (transfer minus the slowest receiver's decode), for the link estimate."""


@_message("probe", {"agent": str, "group": str, "queue_size": int, "cache_bytes": int,
                    "compute_load": float, "role_priority": float, "role": str, "ts": float,
                    "link_bps": float, "latency_s": float})
@dataclass(frozen=True, slots=True)
class Probe(Message):
    """An agent's state, reported periodically to its group scheduler."""

    agent: str
    group: str
    queue_size: int
    cache_bytes: int
    compute_load: float
    role_priority: float
    role: str = "agent"
    ts: float = field(default_factory=time.time)
    link_bps: float = 0.0
    """Declared (or emulated) link capacity, bytes/s (0 = unknown)."""
    latency_s: float = 0.0


@_message("agent", {"name": str, "group": str, "role": str, "priority": float, "signature": _Any,
                    "ts": float, "link_bps": float, "latency_s": float, "recompute": bool})
@dataclass(frozen=True, slots=True)
class AgentRecord(Message):
    """An agent's entry in the directory (JetStream KV bucket `AGENTS_BUCKET`)."""

    name: str
    group: str
    role: str
    priority: float
    signature: Any
    """`ModelSignature.to_dict()`, or None for an agent that takes any context as tokens."""
    ts: float = field(default_factory=time.time)
    link_bps: float = 0.0
    """Declared (or emulated) link capacity in bytes/s; 0 when unknown."""
    latency_s: float = 0.0
    """Declared (or emulated) one-way latency."""
    recompute: bool = False
    """Whether the agent has a model to rebuild KV from tokens."""


@_message("group", {"group": str, "scheduler": str, "agents": int, "ts": float})
@dataclass(frozen=True, slots=True)
class GroupHeartbeat(Message):
    """A group scheduler announces itself to the coordinator."""

    group: str
    scheduler: str
    agents: int = 0
    ts: float = field(default_factory=time.time)


# -- streaming ---------------------------------------------------------------------------------


@_message("open", {"transfer_id": str, "src": str, "codec": str, "meta": dict, "sizes": list,
                   "total": int, "chunk_size": int, "n_chunks": int, "digest": str, "window": int,
                   "data_subject": str, "ack_subject": str, "inline": bool, "traceparent": _OptStr})
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

    _PREFIX: ClassVar[struct.Struct] = struct.Struct("!I")

    def frame(self, inline_payload: bytes | memoryview = b"") -> bytes:
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
        msg = cls.decode(view[cls._PREFIX.size:cls._PREFIX.size + n])
        msg.check()
        return msg, view[cls._PREFIX.size + n:]

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


@_message("open_reply", {"transfer_id": str, "ok": bool, "reason": str, "done": bool,
                         "decode_s": float, "next": int})
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


@_message("ack", {"transfer_id": str, "rx": str, "next": int, "received": int, "missing": list,
                  "done": bool, "ok": bool, "reason": str, "decode_s": float})
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


@_message("ping", {"transfer_id": str, "src": str})
@dataclass(frozen=True, slots=True)
class Ping(Message):
    """Sender -> receiver liveness check (request on the receiver's ``ping`` subject)."""

    transfer_id: str = ""
    src: str = ""


def decode_message(data: bytes | bytearray | memoryview, *types: type[M]) -> M:
    """Decode a message that may be any of ``types`` (dispatch on its tag)."""
    names = {t.TYPE: t for t in types}
    body = unpackb(data, "/".join(names) + " message")
    tag = body.get("t") if isinstance(body, dict) else None
    if tag not in names:
        raise WireFormatError("/".join(names) + " message", f"unexpected type tag {tag!r}")
    return names[tag].from_map(body)


# -- coordinator ---------------------------------------------------------------------------------


@_message("leave", {"group": str, "scheduler": str})
@dataclass(frozen=True, slots=True)
class GroupLeave(Message):
    """A group scheduler deregisters (its group's lease is released at once)."""

    group: str
    scheduler: str = ""


@_message("lease_request", {"group": str, "scheduler": str, "demand_bps": float, "priority": float,
                            "traceparent": _OptStr})
@dataclass(frozen=True, slots=True)
class LeaseRequest(Message):
    """A group asks for its share of the shared (inter-group) capacity for the next epoch."""

    group: str
    scheduler: str
    demand_bps: float
    """Bandwidth its inter-group transfers want (0 releases the lease)."""
    priority: float = 1.0
    """Weight of the group in the max-min split."""
    traceparent: str | None = None
    """The transfer that made the group ask (W3C trace context): the coordinator's span joins its trace."""


@_message("lease", {"group": str, "share_bps": float, "expires_at": float, "epoch_s": float, "capacity_bps": float})
@dataclass(frozen=True, slots=True)
class LeaseGrant(Message):
    """The coordinator's answer: the group's share until ``expires_at`` (epoch seconds)."""

    group: str
    share_bps: float
    expires_at: float
    epoch_s: float
    capacity_bps: float = 0.0


@_message("reserve", {"reservation_id": str, "group": str, "who": str, "period_s": float, "size_bytes": int,
                      "deadline_s": float, "traceparent": _OptStr})
@dataclass(frozen=True, slots=True)
class ReservationRequest(Message):
    """A periodic critical flow asks for bandwidth set aside: ``size_bytes`` every ``period_s``,
    each due within ``deadline_s`` of its period's start."""

    reservation_id: str
    group: str
    who: str
    period_s: float
    size_bytes: int
    deadline_s: float
    traceparent: str | None = None


@_message("reserve_reply", {"reservation_id": str, "ok": bool, "reason": str, "rate_bps": float})
@dataclass(frozen=True, slots=True)
class ReservationReply(Message):
    """Admitted (with the rate set aside) or refused with the reason."""

    reservation_id: str
    ok: bool
    reason: str = ""
    rate_bps: float = 0.0


@_message("unreserve", {"reservation_id": str})
@dataclass(frozen=True, slots=True)
class ReservationCancel(Message):
    reservation_id: str


@_message("place", {"agent": str, "talks_to": list, "traceparent": _OptStr})
@dataclass(frozen=True, slots=True)
class PlacementRequest(Message):
    """Which group should this agent join? ``talks_to`` names the agents it exchanges most with."""

    agent: str
    talks_to: list = field(default_factory=list)
    traceparent: str | None = None


@_message("placement", {"agent": str, "group": str, "reason": str})
@dataclass(frozen=True, slots=True)
class PlacementReply(Message):
    agent: str
    group: str
    reason: str = ""
