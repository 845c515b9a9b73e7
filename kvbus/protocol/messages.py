"""Control messages between agents and their group scheduler: requests, grants, controls,
reservations, reports, probes and directory records."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvbus.errors import WireFormatError
from kvbus.protocol.wire import (
    MAX_BYTES,
    MAX_COUNT,
    MAX_EPOCH_S,
    MAX_PRIORITY,
    MAX_RATE_BPS,
    MAX_SECONDS,
    AnyValue,
    ListOf,
    Message,
    OptStr,
    float_in,
    int_in,
    message,
)
from kvbus.reasons import Reason

#: The ranges of this module's numeric fields (see `kvbus.protocol.wire.Num`).
EPOCH = float_in(0.0, MAX_EPOCH_S)
SECONDS = float_in(0.0, MAX_SECONDS)
LATENCY = float_in(0.0, 3600.0)
#: Longest rate budget a grant may carry (seconds).
MAX_BUDGET_S = 60.0
RATE = float_in(0.0, MAX_RATE_BPS)
FRACTION = float_in(0.0, 1.0)
PRIORITY = float_in(0.0, MAX_PRIORITY)


@message(
    "request",
    {
        "transfer_id": str,
        "src": str,
        "dst": ListOf(str),
        "group": str,
        "n_tokens": int_in(0, MAX_COUNT),
        "nbytes": int_in(0, MAX_BYTES),
        "signature": dict,
        "medium": OptStr,
        "deadline": float_in(0.0, MAX_EPOCH_S, optional=True),
        "critical": bool,
        "ts": EPOCH,
        "traceparent": OptStr,
        "fidelity": FRACTION,
        "base_tokens": int_in(0, MAX_COUNT),
        "path": str,
        "budget": bool,
        "inline_limit": int_in(0, MAX_BYTES),
    },
)
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
    path: str = ""
    """The data path the sender expects the bytes to take (``shm``, ``tcp``, ``nats``; empty:
    ``nats``): the cost model predicts the wire time from that path's link estimate."""
    budget: bool = False
    """The sender takes a rate budget with the grant (`Grant.budget_s`): later small transfers
    to the same receivers start without asking."""
    inline_limit: int = 0
    """The sender's inline limit: a payload of at most this many bytes rides in the `Open` over
    NATS whatever ``path`` says, and is predicted on that path (0: unknown, ``path`` for all)."""


@message("request_ack", {"transfer_id": str, "ok": bool, "reason": str, "code": Reason})
@dataclass(frozen=True, slots=True)
class RequestAck(Message):
    """The scheduler's immediate answer to a request: queued, or refused and why."""

    transfer_id: str
    ok: bool
    reason: str = ""
    code: Reason = Reason.NONE
    """Why it was refused, as a code to match on (`reason` is for people)."""


@message(
    "grant",
    {
        "transfer_id": str,
        "medium": str,
        "rate_bps": RATE,
        "start_at": EPOCH,
        "chunk_size": int_in(0, 1 << 30),
        "window": int_in(0, 1 << 16),
        "reason": str,
        "decision": dict,
        "latency_s": LATENCY,
        "sched_s": SECONDS,
        "code": Reason,
        "traceparent": OptStr,
        "budget_s": float_in(0.0, MAX_BUDGET_S),
        "budget_bytes": int_in(0, MAX_BYTES),
    },
)
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
    code: Reason = Reason.NONE
    """Why it was refused, as a code to match on (`reason` is for people)."""
    traceparent: str | None = None
    """The scheduler's ``kvbus.schedule`` span when it is a root (the request carried no trace
    context): a sender that does not trace passes it on as the `Open`'s ``trace_link``."""
    budget_s: float = 0.0
    """A rate budget (0: none): for this many seconds from the grant, the transfer's slot stays
    the sender's, and it may start transfers of at most ``budget_bytes`` each to the same
    receivers with the same medium and rate without asking (each reported done with
    `TransferDone.budget`). A ``pause`` control naming this transfer suspends the budget, a
    ``resume`` gives it back, a ``cancel`` withdraws it (the scheduler does so once any transfer
    waits); the sender ends it early by reporting this transfer id done with ``budget`` set to it."""
    budget_bytes: int = 0
    """Largest context (``TransferRequest.nbytes``) a transfer under the budget may carry."""


class ControlAction(enum.StrEnum):
    """What a `Control` asks of its agent (see `Control`); on the wire, the value."""

    PAUSE = "pause"
    RESUME = "resume"
    CANCEL = "cancel"
    RATE = "rate"
    SHED = "shed"


@message(
    "control",
    {
        "transfer_id": str,
        "action": str,
        "reason": str,
        "rate_bps": RATE,
        "max_fraction": FRACTION,
        "nbytes": int_in(0, MAX_BYTES),
    },
)
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

    ACTIONS: ClassVar[tuple[str, ...]] = tuple(a.value for a in ControlAction)
    transfer_id: str
    action: ControlAction
    """A `ControlAction` (a plain string naming one is taken and converted)."""
    reason: str = ""
    rate_bps: float = 0.0
    """For ``rate``: the new allocated rate in bytes/s."""
    max_fraction: float = 1.0
    """For ``pause``: pause only if less than this fraction of the payload has been sent."""
    nbytes: int = 0
    """For ``shed``: resident cache bytes to shed down to (0 = the tier's default)."""

    def __post_init__(self) -> None:
        try:
            action = ControlAction(self.action)
        except ValueError:
            raise WireFormatError("control message", f"action {self.action!r} is not one of {self.ACTIONS}") from None
        object.__setattr__(self, "action", action)  # frozen: the wire's string becomes the enum once, here
        if not (0 <= self.rate_bps < float("inf")) or self.nbytes < 0:
            raise WireFormatError("control message", "rate_bps must be finite and nbytes not negative")
        if not 0 <= self.max_fraction <= 1:
            raise WireFormatError("control message", f"max_fraction {self.max_fraction} must be within 0..1")


@message(
    "control_reply",
    {"transfer_id": str, "action": str, "ok": bool, "fraction": FRACTION, "reason": str, "code": Reason},
)
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
    code: Reason = Reason.NONE
    """Why it was refused, as a code to match on (`reason` is for people)."""


@message(
    "flow_reserve",
    {
        "reservation_id": str,
        "src": str,
        "dst": ListOf(str),
        "group": str,
        "period_s": SECONDS,
        "size_bytes": int_in(0, MAX_BYTES),
        "deadline_s": SECONDS,
        "cancel": bool,
        "ts": EPOCH,
    },
)
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


@message(
    "done",
    {
        "transfer_id": str,
        "src": str,
        "ok": bool,
        "medium": str,
        "nbytes": int_in(0, MAX_BYTES),
        "seconds": SECONDS,
        "error": str,
        "dst": ListOf(str),
        "wire_s": SECONDS,
        "path": str,
        "budget": str,
        "encode_s": SECONDS,
        "decode_s": SECONDS,
    },
)
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
    path: str = ""
    """The data path the bytes took (empty: ``nats``; ``mixed``: a direct path failed and the
    rest went on NATS, which feeds no link estimate)."""
    budget: str = ""
    """The granted transfer whose rate budget this one ran under (`Grant.budget_s`; the
    scheduler never saw a request for it). Equal to ``transfer_id``: the sender ends that budget."""
    encode_s: float = 0.0
    """The sender's encode (in ``seconds``; 0: not measured), for the cost model's codec term."""
    decode_s: float = 0.0
    """The slowest receiver's decode, its prefill for ``tokens`` (in ``seconds``; 0: not measured)."""


@message(
    "probe",
    {
        "agent": str,
        "group": str,
        "queue_size": int_in(0, MAX_COUNT),
        "cache_bytes": int_in(0, MAX_BYTES),
        "compute_load": FRACTION,
        "role_priority": PRIORITY,
        "role": str,
        "ts": EPOCH,
        "link_bps": RATE,
        "latency_s": LATENCY,
        "prefill_tps": float_in(0.0, 1e9),
        "prefill_tokens": float_in(0.0, 1e9),
        "prefill_held": float_in(0.0, 1e9),
    },
)
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
    prefill_tps: float = 0.0
    """The agent's measured prefill speed, tokens/s, from the recomputes it did lately, under the
    load it really had (0 = none measured yet: the scheduler uses the calibrated figure)."""
    prefill_tokens: float = 0.0
    """The mean length of the recomputes ``prefill_tps`` was measured on (0 = not said: the
    calibration's context length)."""
    prefill_held: float = 0.0
    """The mean of the tokens those recomputes found in the cache already."""


@message(
    "agent",
    {
        "name": str,
        "group": str,
        "role": str,
        "priority": PRIORITY,
        "signature": AnyValue,
        "ts": EPOCH,
        "link_bps": RATE,
        "latency_s": LATENCY,
        "recompute": bool,
        "host": str,
    },
)
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
    host: str = ""
    """The host its data plane runs on (`kvbus.bus.paths.host_identity`; "" without one). A hint
    for the cost model only (two agents on one host can use ``shm``), never an identity."""


@message("leave_agent", {"agent": str, "group": str, "reason": str, "ts": EPOCH})
@dataclass(frozen=True, slots=True)
class AgentLeave(Message):
    """An agent closed: its scheduler drops it at once and refuses new transfers to it."""

    agent: str
    group: str
    reason: str = "closed"
    ts: float = field(default_factory=time.time)
