"""Checking a transfer request before it joins the group's queue.

A request is refused at once, with a reason code and a sentence, when it does not decode or
names agents badly (`MALFORMED`), comes on another agent's subject (`WRONG_SENDER`), names more
receivers than ``max_receivers`` (`TOO_LARGE`), names a receiver the directory does not know
(`UNKNOWN_RECEIVER`) or one that left the group (`RECEIVER_GONE`), or involves an agent marked
down (`RECEIVER_DOWN`, `SENDER_DOWN`). (Admitting *reservations* is `kvbus.group_scheduler.reservations`.)

What one request may cost is bounded: the receivers are checked against the directory cache
(which a JetStream watch keeps current); the names it does not know cause at most one batch of
``lookup_batch`` lookups, made together and given ``admit_timeout_s`` in all; a request with
more unknown names is refused without any lookup. Only a request that needs lookups waits for
anything (`RequestAdmission.admit_now` answers every other one without awaiting).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

from nats.aio.msg import Msg

from kvbus.errors import WireFormatError
from kvbus.group_scheduler.config import SchedulerConfig
from kvbus.group_scheduler.directory import Directory
from kvbus.group_scheduler.errors import TooManyReceivers, WrongSender
from kvbus.group_scheduler.signatures import signature_of
from kvbus.group_scheduler.state import GroupState, Pending
from kvbus.protocol import AgentRecord, Reason, TransferRequest, check_name, subject_sender
from kvbus.signature import ModelSignature

#: A re-sent request keeps its original queue time, but never more than this much of it.
MAX_CARRIED_WAIT_S = 600.0
#: Unknown names a refusal lists (the rest are counted).
SHOWN_NAMES = 8


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
    """The code of a message that failed its checks: `WRONG_SENDER`, `TOO_LARGE` or `MALFORMED`."""
    if isinstance(exc, WrongSender):
        return Reason.WRONG_SENDER
    return Reason.TOO_LARGE if isinstance(exc, TooManyReceivers) else Reason.MALFORMED


def parse_request(msg: Msg, max_receivers: int | None = None) -> TransferRequest:
    """Decode and check a request: its sender, the number of its receivers, its signature, their names.

    Raises:
        WireFormatError: it does not decode (a number out of range too), or its signature is malformed.
        WrongSender: it came on another agent's subject.
        TooManyReceivers: it names more than ``max_receivers`` receivers.
        ValueError: a receiver's name is not a valid name, or there is none.
    """
    req = TransferRequest.decode(msg.data)
    check_sender(msg, req.src)
    if max_receivers is not None and len(req.dst) > max_receivers:
        raise TooManyReceivers(len(req.dst), max_receivers)
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


def unknown_refusal(names: list[str]) -> Refusal:
    """The refusal of a request naming receivers the directory does not know."""
    shown = ", ".join(names[:SHOWN_NAMES]) + (
        f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else ""
    )
    return Refusal(Reason.UNKNOWN_RECEIVER, f"unknown agent(s): {shown} (not registered on the bus)")


def gone_refusal(names: list[str]) -> Refusal:
    """The refusal of a request naming receivers that left the group (closed) and did not come back."""
    return Refusal(
        Reason.RECEIVER_GONE,
        f"receiver(s) {', '.join(names[:SHOWN_NAMES])} left the group (closed) and did not come back",
    )


class RequestAdmission:
    """Turns a checked request into a `Pending` entry, or a `Refusal`.

    Args:
        directory: where receivers are looked up (their model signatures).
        state: the group's S(t) (which agents are down, which left).
        config: the probe TTL (for the refusal's text) and what one request may cost
            (``lookup_batch``, ``admit_timeout_s``).
    """

    def __init__(self, directory: Directory, state: GroupState, config: SchedulerConfig) -> None:
        self.directory = directory
        self.state = state
        self.probe_ttl_s = config.probe_ttl_s
        self.lookup_batch = config.lookup_batch
        self.timeout_s = config.admit_timeout_s
        """Longest one request's lookups may take (then it is refused with `Reason.UNAVAILABLE`)."""

    def _needs_lookup(self, req: TransferRequest) -> tuple[dict[str, AgentRecord], list[str]]:
        """The receivers' records the cache holds, and the names that need a lookup (in order):
        names it does not know, and receivers that left (only a fresh record says they came back)."""
        records: dict[str, AgentRecord] = {}
        missing: list[str] = []
        for name in dict.fromkeys(req.dst):
            record = None if name in self.state.left else self.directory.cached(name)
            if record is None:
                missing.append(name)
            else:
                records[name] = record
        return records, missing

    def admit_now(self, req: TransferRequest) -> Pending | Refusal | None:
        """The answer from what the scheduler holds, without awaiting anything; None when the
        request needs directory lookups first (then `admit`)."""
        records, missing = self._needs_lookup(req)
        if not missing:
            return self._decide(req, records, [])
        if len(missing) > self.lookup_batch:
            # Not worth a single round trip: a request naming this many unknown agents is wrong.
            return unknown_refusal([m for m in missing if m not in self.state.left] or missing)
        return None

    async def admit(self, req: TransferRequest) -> Pending | Refusal:
        """The answer, looking up (in one batch, within ``timeout_s``) the names the cache does not know."""
        early = self.admit_now(req)
        if early is not None:
            return early
        records, missing = self._needs_lookup(req)
        try:
            found = await asyncio.wait_for(self.directory.lookup_many(missing), self.timeout_s)
        except TimeoutError:
            return Refusal(
                Reason.UNAVAILABLE,
                f"the agent directory did not answer within {self.timeout_s:g} s (admit_timeout_s); ask again later",
            )
        gone = []
        for name in missing:
            record = found.get(name)
            left = self.state.left.get(name)
            if left is not None:
                # It left; a record written after it left is a new incarnation of the name.
                if record is None or record.ts <= left:
                    gone.append(name)
                    continue
                self.state.returned(name)
            if record is not None:
                records[name] = record
        return self._decide(req, records, gone)

    def _decide(self, req: TransferRequest, records: dict[str, AgentRecord], gone: list[str]) -> Pending | Refusal:
        unknown = [rx for rx in dict.fromkeys(req.dst) if rx not in records and rx not in gone]
        if unknown:
            return unknown_refusal(unknown)
        if gone:
            return gone_refusal(gone)
        sigs: dict[str, ModelSignature | None] = {}
        recompute: dict[str, bool] = {}
        sender = self.directory.cached(req.src)
        hosts = {req.src: sender.host if sender is not None else ""}
        for rx in req.dst:
            record = records[rx]
            recompute[rx] = bool(record.recompute)
            hosts[rx] = record.host
            try:
                sigs[rx] = signature_of(record.signature) if record.signature else None
            except WireFormatError:
                sigs[rx] = None
        now = time.monotonic()
        down = [a for a in [req.src, *req.dst] if self.state.is_down(a)]
        if down:
            return down_refusal(self.state, self.probe_ttl_s, down[0], req.src, now)
        waited = min(max(0.0, time.time() - req.ts), MAX_CARRIED_WAIT_S)
        deadline_at = now + (req.deadline - time.time()) if req.deadline is not None else None
        if deadline_at is not None and not math.isfinite(deadline_at):
            return Refusal(Reason.MALFORMED, f"deadline {req.deadline!r} is not a time")
        return Pending(req, sigs, arrived=now - waited, deadline_at=deadline_at, recompute=recompute, hosts=hosts)
