"""Scheduling policies: who may send now, with which medium and at what rate.

A policy is a strategy object passed to the `GroupScheduler`; the scheduling issue adds
weighted round robin with preemption and reservations next to the first-come-first-served one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from kvbus.codecs import get_codec
from kvbus.codecs.errors import CodecError
from kvbus.group_scheduler.state import GroupState, Pending
from kvbus.signature import ModelSignature


@dataclass(frozen=True)
class Decision:
    """What the policy decided for one pending transfer."""

    pending: Pending
    medium: str
    """Empty to refuse the transfer."""
    rate_bps: float = 0.0
    reason: str = ""


class MediumSelector(ABC):
    """Chooses the medium of a transfer."""

    @abstractmethod
    def choose(self, state: GroupState, pending: Pending) -> tuple[str, str]:
        """Return (medium, reason); an empty medium refuses the transfer with that reason."""


class StaticSelector(MediumSelector):
    """The sender's requested medium, else ``default`` when every receiver can use KV, else ``tokens``."""

    def __init__(self, default: str = "full", fallback: str = "tokens") -> None:
        self.default = default
        self.fallback = fallback

    def choose(self, state: GroupState, pending: Pending) -> tuple[str, str]:
        req = pending.request
        try:
            sender = ModelSignature.from_dict(req.signature)
        except Exception as exc:  # noqa: BLE001 - validated on arrival; be safe anyway
            return "", f"bad sender signature: {exc}"
        unusable = [rx for rx, sig in pending.receivers.items() if sig is None or not sender.compatible_with(sig)]
        if req.medium:
            try:
                codec = get_codec(req.medium)
            except CodecError as exc:
                return "", str(exc)
            if codec.needs_kv and unusable:
                return "", (f"medium {req.medium!r} carries KV that {', '.join(unusable)} cannot use "
                            f"(different model); send with medium='tokens' or let kvbus choose")
            return req.medium, "requested by the sender"
        if unusable:
            return self.fallback, f"{', '.join(unusable)} cannot use {sender.model} KV"
        return self.default, "first-cut policy: lossless KV between compatible models"


class SchedulingPolicy(ABC):
    """Decides, each time the state changes, which queued transfers start now."""

    def __init__(self, selector: MediumSelector | None = None) -> None:
        self.selector = selector or StaticSelector()

    @abstractmethod
    def decide(self, state: GroupState, now: float) -> list[Decision]:
        """Pick transfers from ``state.queue`` to grant now (the scheduler moves them to active)."""


class FifoPolicy(SchedulingPolicy):
    """First come, first served, with at most ``max_active`` transfers running and one per sender.

    The group's bandwidth budget (if any) is split evenly between running transfers.
    """

    def __init__(self, selector: MediumSelector | None = None, *, max_active: int = 4) -> None:
        super().__init__(selector)
        self.max_active = max_active

    def decide(self, state: GroupState, now: float) -> list[Decision]:
        decisions: list[Decision] = []
        busy = {p.request.src for p in state.active.values()}
        slots = self.max_active - len(state.active)
        for pending in list(state.queue):
            if slots <= 0:
                break
            if pending.request.src in busy:
                continue
            medium, reason = self.selector.choose(state, pending)
            running = len(state.active) + len(decisions) + 1
            rate = state.bandwidth_bps / running if state.bandwidth_bps > 0 else 0.0
            decisions.append(Decision(pending, medium, rate, reason))
            if medium:
                busy.add(pending.request.src)
                slots -= 1
        return decisions
