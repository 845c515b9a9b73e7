"""The sender's side of scheduler control: pause, resume, rate and cancel of outgoing transfers.

A control can arrive between the grant and the moment the transfer starts streaming (while
its payload is encoded). Such controls are kept per granted transfer and applied when its
`OutgoingTransfer` registers, so a transfer preempted or re-rated before it starts begins in
the state the scheduler asked for.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

from kvbus.bus.outgoing import OutgoingTransfer
from kvbus.protocol import Control, ControlReply

logger = logging.getLogger(__name__)

#: Granted-but-not-started transfers whose early controls are remembered.
EARLY_MEMORY = 4096


@dataclass
class _Early:
    """Controls received for a granted transfer that is not streaming yet."""

    paused: bool = False
    rate_bps: float | None = None
    cancel: str | None = None


class TransferControls:
    """Applies `Control` messages to this agent's outgoing transfers."""

    def __init__(self) -> None:
        self.outgoing = OutgoingTable(self)
        self._early: collections.OrderedDict[str, _Early] = collections.OrderedDict()

    def granted(self, transfer_id: str) -> None:
        """A grant arrived: controls for this transfer may come before it streams."""
        self._early[transfer_id] = _Early()
        while len(self._early) > EARLY_MEMORY:
            self._early.popitem(last=False)

    def attach(self, transfer_id: str, out: OutgoingTransfer) -> None:
        """``out`` starts streaming: apply the controls that came for it before."""
        early = self._early.pop(transfer_id, None)
        if early is None:
            return
        if early.rate_bps is not None:
            out.set_rate(early.rate_bps)
        if early.cancel is not None:
            out.cancel(early.cancel)
        elif early.paused:
            out.pause()

    def detach(self, transfer_id: str) -> None:
        """The transfer is over: forget its early controls."""
        self._early.pop(transfer_id, None)

    def apply(self, cmd: Control) -> ControlReply:
        """Act on ``cmd``; the reply says whether it was done (a pause may be declined)."""
        tid, action = cmd.transfer_id, cmd.action
        out = self.outgoing.get(tid)
        if out is None:
            early = self._early.get(tid)
            if early is None:
                return ControlReply(
                    tid, action, False, 0.0, "no such transfer on this agent (finished or never granted)"
                )
            if action == "pause":
                early.paused = True
            elif action == "resume":
                early.paused = False
            elif action == "rate":
                early.rate_bps = cmd.rate_bps
            elif action == "cancel":
                early.cancel = cmd.reason or "cancelled"
            return ControlReply(tid, action, True, 0.0, "not started yet")
        if action == "pause":
            if out.pause(cmd.max_fraction):
                return ControlReply(tid, action, True, out.fraction_sent)
            why = (
                "its payload travels in one message"
                if out.open.inline
                else f"{out.fraction_sent:.0%} already sent, not below the {cmd.max_fraction:.0%} threshold"
            )
            return ControlReply(tid, action, False, out.fraction_sent, why)
        if action == "resume":
            out.resume()
        elif action == "rate":
            out.set_rate(cmd.rate_bps)
        elif action == "cancel":
            out.cancel(cmd.reason)
        return ControlReply(tid, action, True, out.fraction_sent)


class OutgoingTable(dict):
    """The agent's running outgoing transfers by id; registering one applies its early controls."""

    def __init__(self, controls: TransferControls) -> None:
        super().__init__()
        self._controls = controls

    def __setitem__(self, transfer_id: str, out: OutgoingTransfer) -> None:
        super().__setitem__(transfer_id, out)
        self._controls.attach(transfer_id, out)

    def pop(self, transfer_id: str, *default: object) -> object:
        """Remove a finished transfer (and its early controls)."""
        self._controls.detach(transfer_id)
        return super().pop(transfer_id, *default)
