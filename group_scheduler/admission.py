"""Checking a transfer request before it joins the group's queue.

A request is refused at once, with a reason code and a sentence, when it does not decode or
names agents badly (`MALFORMED`), comes on another agent's subject (`WRONG_SENDER`), names a
receiver the directory does not know (`UNKNOWN_RECEIVER`), or involves an agent marked down
(`RECEIVER_DOWN`, `SENDER_DOWN`). (Admitting *reservations* is `kvbus.group_scheduler.reservations`.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from nats.aio.msg import Msg

from kvbus.errors import WireFormatError
from kvbus.group_scheduler.directory import Directory
from kvbus.group_scheduler.errors import WrongSender
from kvbus.group_scheduler.signatures import signature_of
from kvbus.group_scheduler.state import GroupState, Pending
from kvbus.protocol import Reason, TransferRequest, check_name, subject_sender
from kvbus.signature import ModelSignature

#: A re-sent request keeps its original queue time, but never more than this much of it.
MAX_CARRIED_WAIT_S = 600.0


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is refused: a code to match on and a sentence for people."""

    code: Reason
    reason: str


def check_sender(msg: Msg, claimed: str) -> None:
    """Raise `WrongSender` unless ``claimed`` is the agent whose subject ``msg`` came on (the server
    lets each agent publish only on its own, so a message cannot speak for another agent)."""
    sender = subject_sender(msg.subject)
    if claimed != sender:
        raise WrongSender(claimed, sender)


def refusal_code(exc: Exception) -> Reason:
    """The code of a message that failed its checks: `WRONG_SENDER` or `MALFORMED`."""
    return Reason.WRONG_SENDER if isinstance(exc, WrongSender) else Reason.MALFORMED


def parse_request(msg: Msg) -> TransferRequest:
    """Decode and check a request: its sender, its signature, its receivers' names.

    Raises:
        WireFormatError: it does not decode, or its signature is malformed.
        WrongSender: it came on another agent's subject.
        ValueError: a receiver's name is not a valid name, or there is none.
    """
    req = TransferRequest.decode(msg.data)
    check_sender(msg, req.src)
    signature_of(req.signature)
    for rx in req.dst:
        check_name("agent", rx)
    if not req.dst:
        raise ValueError("no receivers")
    return req


def down_refusal(state: GroupState, probe_ttl_s: float, agent: str, src: str, now: float) -> Refusal:
    """The refusal of a transfer to or from ``agent``, which is marked down."""
    a = state.agents.get(agent)
    age = now - a.last_seen if a is not None else 0.0
    sender = agent == src
    who = "sender" if sender else "receiver"
    return Refusal(
        Reason.SENDER_DOWN if sender else Reason.RECEIVER_DOWN,
        f"{who} {agent!r} is down: no probe for {age:.1f} s (probe_ttl_s {probe_ttl_s:g} s); "
        f"transfers to or from it are refused until it probes again",
    )


class RequestAdmission:
    """Turns a checked request into a `Pending` entry, or a `Refusal`.

    Args:
        directory: where receivers are looked up (their model signatures).
        state: the group's S(t) (which agents are down).
        probe_ttl_s: how long an agent may stay silent before it is down (for the refusal's text).
    """

    def __init__(self, directory: Directory, state: GroupState, probe_ttl_s: float) -> None:
        self.directory = directory
        self.state = state
        self.probe_ttl_s = probe_ttl_s

    async def admit(self, req: TransferRequest) -> Pending | Refusal:
        """Look the receivers up and check that nobody involved is down."""
        sigs: dict[str, ModelSignature | None] = {}
        unknown = []
        await self.directory.lookup(req.src)
        for rx in req.dst:
            record = await self.directory.lookup(rx)
            if record is None:
                unknown.append(rx)
                continue
            try:
                sigs[rx] = signature_of(record.signature) if record.signature else None
            except WireFormatError:
                sigs[rx] = None
        if unknown:
            return Refusal(
                Reason.UNKNOWN_RECEIVER, f"unknown agent(s): {', '.join(unknown)} (not registered on the bus)"
            )
        now = time.monotonic()
        down = [a for a in [req.src, *req.dst] if self.state.is_down(a)]
        if down:
            return down_refusal(self.state, self.probe_ttl_s, down[0], req.src, now)
        waited = min(max(0.0, time.time() - req.ts), MAX_CARRIED_WAIT_S)
        deadline_at = now + (req.deadline - time.time()) if req.deadline is not None else None
        return Pending(req, sigs, arrived=now - waited, deadline_at=deadline_at)
