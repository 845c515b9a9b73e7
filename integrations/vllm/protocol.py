"""The connector's own messages on NATS: prefix lookups, pulls, pushes and load events.

Subjects (``<agent>`` is an engine's agent name)::

    kvbus.vllm.<agent>.lookup             the engine's scheduler asks its worker what kvbus can deliver
    kvbus.vllm.<agent>.have               a peer asks how much of a prefix this agent holds
    kvbus.vllm.<agent>.pull.<requester>   a peer asks this agent to send it a prefix (a kvbus transfer)
    kvbus.vllm.<agent>.pulled.<holder>    a holder tells this agent that the pull it accepted failed
    kvbus.vllm.<agent>.push               this agent is asked to send a held context to named agents
    kvbus.vllm.events.<agent>             what the connector did (loads, saves, pushes, failures)

A pull and its failure carry their sender's name last in the subject: in secure mode the
server lets an agent publish only under its own name there (`kvbus.security.agent_permissions`),
and the receiver checks the name the message gives against it, so no agent can pull for another
or fail another's pull.

The KV itself never travels here: it goes as an ordinary kvbus transfer (group scheduler grant,
medium from the cost model, chunked stream, digests, lineage, trace). Every decoder validates
sizes and types and raises `WireFormatError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from kvbus.errors import WireFormatError
from kvbus.protocol import Message, check_name, message
from kvbus.security import VLLM_ROOT

#: Prefix of every subject the connector uses.
SUBJECT_ROOT = VLLM_ROOT
#: Most token ids one message may carry.
MAX_TOKENS = 1 << 16


def subject(agent: str, kind: str, sender: str | None = None) -> str:
    """``kvbus.vllm.<agent>.<kind>``, or ``kvbus.vllm.<agent>.<kind>.<sender>`` (``*``: any sender's)."""
    base = f"{SUBJECT_ROOT}.{check_name('agent', agent)}.{kind}"
    if sender is None:
        return base
    return f"{base}.{sender if sender == '*' else check_name('agent', sender)}"


def sender_of(msg_subject: str) -> str:
    """The sender's name at the end of a subject `subject` built with one ("" if none)."""
    return msg_subject.rsplit(".", 1)[-1] if msg_subject.count(".") >= 4 else ""


def events_subject(agent: str = "*") -> str:
    """Where ``agent``'s connector publishes its events (``*``: every agent's)."""
    return f"{SUBJECT_ROOT}.events.{agent if agent == '*' else check_name('agent', agent)}"


_SCOPE_RE = re.compile(r"\A(?:[0-9a-f]{32})?\Z")


def check_salt(what: str, salt: str) -> None:
    """A salt scope from the wire: empty, or 32 lowercase hex characters (`keys.salt_scope`)."""
    if not _SCOPE_RE.match(salt):
        raise WireFormatError(what, "salt must be empty or 32 lowercase hex characters")


def check_tokens(what: str, tokens: object) -> list[int]:
    """Token ids from the wire: a list of at most `MAX_TOKENS` integers in ``[0, 2**31)``."""
    if not isinstance(tokens, list):
        raise WireFormatError(what, f"tokens must be a list, got {type(tokens).__name__}")
    if len(tokens) > MAX_TOKENS:
        raise WireFormatError(what, f"{len(tokens)} tokens is over the limit of {MAX_TOKENS}")
    for t in tokens:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 1 << 31:
            raise WireFormatError(what, f"token id {t!r:.20} is not an integer in [0, 2**31)")
    return tokens


_M = TypeVar("_M", bound=Message)


def _decode_fields(cls: type[_M], body: object) -> _M:
    """The base class's field checks (zero-argument ``super()`` does not work in slotted dataclasses)."""
    return cast(_M, Message.from_map.__func__(cls, body))  # type: ignore[attr-defined]


def _check_agent(what: str, name: str) -> None:
    try:
        check_name("agent", name)
    except ValueError as exc:
        raise WireFormatError(what, str(exc)) from None


@message("vllm.lookup", {"tokens": list, "limit": int, "salt": str})
@dataclass(frozen=True, slots=True)
class LookupRequest(Message):
    """How many leading tokens of ``tokens[:limit]`` can kvbus deliver to this engine?"""

    tokens: list[int]
    limit: int
    salt: str = ""
    """The request's salt scope (`keys.salt_scope` of its ``cache_salt``; "" for none): only KV
    of that scope counts."""

    @classmethod
    def from_map(cls, body: object) -> LookupRequest:
        """`Message.from_map`, plus: ``tokens`` are valid token ids and ``limit`` is within ``0..len(tokens)``.

        Raises:
            WireFormatError: a field check failed.
        """
        msg = _decode_fields(cls, body)
        check_tokens("vllm.lookup message", msg.tokens)
        check_salt("vllm.lookup message", msg.salt)
        if not 0 <= msg.limit <= len(msg.tokens):
            raise WireFormatError("vllm.lookup message", f"limit {msg.limit} is outside 0..{len(msg.tokens)}")
        return msg


@message("vllm.lookup.reply", {"local": int, "remote": int, "holder": str, "tier": int, "declined": int})
@dataclass(frozen=True, slots=True)
class LookupReply(Message):
    """Tokens held by this engine's own store (``local``), by another agent (``remote``, held by
    ``holder``) and by the shared cache tier only (``tier``); each a whole number of blocks.
    ``declined``: tokens another agent or the tier holds but whose load would cost more than
    prefilling them (`kvbus.integrations.vllm.worth`; then ``remote`` and ``tier`` are 0)."""

    local: int = 0
    remote: int = 0
    holder: str = ""
    tier: int = 0
    declined: int = 0

    @classmethod
    def from_map(cls, body: object) -> LookupReply:
        """`Message.from_map`, plus: the counts are within ``0..MAX_TOKENS`` and remote tokens name a valid holder.

        Raises:
            WireFormatError: a field check failed.
        """
        msg = _decode_fields(cls, body)
        for name in ("local", "remote", "tier", "declined"):
            if not 0 <= getattr(msg, name) <= MAX_TOKENS:
                raise WireFormatError("vllm.lookup.reply message", f"{name} is out of range")
        if msg.remote and not msg.holder:
            raise WireFormatError("vllm.lookup.reply message", "remote tokens without a holder")
        if msg.holder:
            _check_agent("vllm.lookup.reply message", msg.holder)
        return msg


@message("vllm.have", {"tokens": list, "salt": str})
@dataclass(frozen=True, slots=True)
class HaveRequest(Message):
    """How many leading tokens of ``tokens`` does the asked agent hold (whole blocks), in scope ``salt``?"""

    tokens: list[int]
    salt: str = ""

    @classmethod
    def from_map(cls, body: object) -> HaveRequest:
        """`Message.from_map`, plus: ``tokens`` are valid token ids (see `check_tokens`).

        Raises:
            WireFormatError: a field check failed.
        """
        msg = _decode_fields(cls, body)
        check_tokens("vllm.have message", msg.tokens)
        check_salt("vllm.have message", msg.salt)
        return msg


@message("vllm.have.reply", {"tokens": int})
@dataclass(frozen=True, slots=True)
class HaveReply(Message):
    """The number of leading tokens the asked agent holds (whole blocks; 0 if none)."""

    tokens: int

    @classmethod
    def from_map(cls, body: object) -> HaveReply:
        """`Message.from_map`, plus: ``tokens`` is within ``0..MAX_TOKENS``.

        Raises:
            WireFormatError: a field check failed.
        """
        msg = _decode_fields(cls, body)
        if not 0 <= msg.tokens <= MAX_TOKENS:
            raise WireFormatError("vllm.have.reply message", f"tokens {msg.tokens} is out of range")
        return msg


@message("vllm.pull", {"pull_id": str, "requester": str, "tokens": list, "medium": (str, type(None)), "salt": str})
@dataclass(frozen=True, slots=True)
class PullRequest(Message):
    """Send ``requester`` the KV of ``tokens`` (a prefix this agent holds in scope ``salt``) as a
    kvbus transfer labelled with the scope."""

    pull_id: str
    requester: str
    tokens: list[int]
    medium: str | None = None
    salt: str = ""

    @classmethod
    def from_map(cls, body: object) -> PullRequest:
        """`Message.from_map`, plus: a 1-64 character ``pull_id``, a valid requester name, valid token ids and
        a medium of at most 128 characters.

        Raises:
            WireFormatError: a field check failed.
        """
        msg = _decode_fields(cls, body)
        what = "vllm.pull message"
        if not 1 <= len(msg.pull_id) <= 64:
            raise WireFormatError(what, "pull_id must be 1-64 characters")
        _check_agent(what, msg.requester)
        check_tokens(what, msg.tokens)
        check_salt(what, msg.salt)
        if msg.medium is not None and len(msg.medium) > 128:
            raise WireFormatError(what, "medium is too long")
        return msg


@message("vllm.pull.reply", {"ok": bool, "tokens": int, "reason": str})
@dataclass(frozen=True, slots=True)
class PullReply(Message):
    """Accepted (the transfer follows) or refused, with the reason."""

    ok: bool
    tokens: int = 0
    reason: str = ""


@message("vllm.pulled", {"pull_id": str, "ok": bool, "reason": str})
@dataclass(frozen=True, slots=True)
class PullOutcome(Message):
    """A holder's word that an accepted pull's transfer failed (``ok`` False) with ``reason``."""

    pull_id: str
    ok: bool
    reason: str = ""


@message("vllm.push", {"to": list, "tokens": list, "medium": (str, type(None)), "salt": str})
@dataclass(frozen=True, slots=True)
class PushRequest(Message):
    """Send the KV this agent holds for ``tokens`` (its longest held prefix in scope ``salt``) to
    every agent in ``to``, who keep it in that scope."""

    to: list[str]
    tokens: list[int]
    medium: str | None = None
    salt: str = ""

    @classmethod
    def from_map(cls, body: object) -> PushRequest:
        """`Message.from_map`, plus: ``to`` holds 1-64 valid agent names and ``tokens`` are valid token ids.

        Raises:
            WireFormatError: a field check failed.
        """
        msg = _decode_fields(cls, body)
        what = "vllm.push message"
        if not 1 <= len(msg.to) <= 64:
            raise WireFormatError(what, "to must name 1-64 agents")
        for name in msg.to:
            if not isinstance(name, str):
                raise WireFormatError(what, "to must be a list of agent names")
            _check_agent(what, name)
        check_tokens(what, msg.tokens)
        check_salt(what, msg.salt)
        return msg


@message(
    "vllm.push.reply",
    {"ok": bool, "reason": str, "tokens": int, "medium": str, "nbytes": int, "seconds": float, "transfer_id": str},
)
@dataclass(frozen=True, slots=True)
class PushReply(Message):
    """The outcome of a push: the transfer's medium, bytes and time, or why it failed."""

    ok: bool
    reason: str = ""
    tokens: int = 0
    medium: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    transfer_id: str = ""


@message(
    "vllm.event",
    {
        "agent": str,
        "kind": str,
        "ok": bool,
        "request_id": str,
        "tokens": int,
        "blocks": int,
        "medium": str,
        "nbytes": int,
        "seconds": float,
        "peer": str,
        "reason": str,
        "fidelity": float,
    },
)
@dataclass(frozen=True, slots=True)
class Event(Message):
    """One thing the connector did: ``kind`` is ``load`` (into vLLM's cache), ``save`` (into the
    store), ``receive`` (a delivery arrived), ``push``, ``serve`` (a pull this agent answered) or
    ``decline`` (a load not made: predicted slower than prefilling; ``seconds`` is its predicted cost)."""

    agent: str
    kind: str
    ok: bool = True
    request_id: str = ""
    tokens: int = 0
    blocks: int = 0
    medium: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    peer: str = ""
    reason: str = ""
    fidelity: float = 1.0

    def as_dict(self) -> dict[str, Any]:
        """The event's fields (for logs and JSON)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


__all__ = [
    "Event",
    "HaveReply",
    "HaveRequest",
    "LookupReply",
    "LookupRequest",
    "MAX_TOKENS",
    "PullOutcome",
    "PullReply",
    "PullRequest",
    "PushReply",
    "PushRequest",
    "SUBJECT_ROOT",
    "check_tokens",
    "events_subject",
    "subject",
]
