"""The sender's dialogue with one receiver of a transfer: its `Open`, retries, status requests, verdict.

Each receiver gets its own `Open` (its data and ack subjects differ). The first attempt is
attempt 0; an unanswered one is asked again, and a sender without acknowledgements asks where
the receiver stands, both with the same transfer id and a higher ``attempt``. Every reply names
the receiver's incarnation (a random id per agent start); a retry names the one the sender
expects (learned from this transfer's replies, else from earlier transfers to that receiver),
and ``retry_age``, so a receiver that restarted in between refuses it with
`Reason.RECEIVER_RESTARTED` instead of delivering a transfer its earlier incarnation may have
delivered already.

A reply counts only if it names this transfer: outside secure mode any client may answer an
agent's `Open`, and one for another transfer id decides nothing here (it is counted in
`Handshake.foreign` and the `Open` is asked again).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvbus.bus.errors import TransferError, TransferRejected
from kvbus.net.transport import Transport, request_views
from kvbus.protocol import Open, OpenReply, Reason, inbox_subject

logger = logging.getLogger(__name__)


@dataclass
class ReceiverOutcome:
    """How one receiver's side of a transfer ended."""

    ok: bool = False
    error: TransferError | None = None
    decode_s: float = 0.0

    @property
    def pending(self) -> bool:
        """Neither delivered nor failed yet."""
        return not self.ok and self.error is None


class Handshake:
    """One receiver of a transfer, as its sender sees it: the `Open` it gets and its outcome."""

    def __init__(self, transport: Transport, rx: str, open_msg: Open, *, expected_incarnation: str = "") -> None:
        self.transport = transport
        self.rx = rx
        self.open = open_msg
        """This receiver's `Open` (attempt 0)."""
        self.expected = expected_incarnation
        """The incarnation earlier transfers met (empty when none)."""
        self.learned = ""
        """The incarnation this transfer's replies named."""
        self.attempts = 0
        self.first_sent = 0.0
        self.outcome = ReceiverOutcome()
        self.foreign = 0
        """Replies that named another transfer id (ignored)."""

    @property
    def incarnation(self) -> str:
        """The incarnation a retry expects."""
        return self.learned or self.expected

    def frame(self, inline_payload: Sequence[bytes | memoryview] = ()) -> list[bytes | memoryview]:
        """The next attempt's framed `Open` (attempt 0, then retries naming the expected
        incarnation), as pieces: the message, then the inline payload uncopied."""
        attempt = self.attempts
        self.attempts += 1
        if attempt == 0:
            self.first_sent = time.monotonic()
            return self.open.frame_views(inline_payload)
        retry = dataclasses.replace(
            self.open,
            attempt=attempt,
            incarnation=self.incarnation,
            retry_age=max(0.0, time.monotonic() - self.first_sent),
        )
        return retry.frame_views(inline_payload)

    async def ask(self, frame: Sequence[bytes | memoryview], timeout: float) -> bytes:
        """Send ``frame`` (its pieces back to back) to the receiver's inbox as a request.

        Raises:
            NoResponders: no agent listens on that inbox.
            TimeoutError: no answer within ``timeout``.
        """
        return await request_views(self.transport, inbox_subject(self.rx, self.open.src), frame, timeout=timeout)

    def apply(self, data: bytes, *, verdict: bool = True) -> OpenReply | None:
        """Read a reply: learn the incarnation; a refusal or a broken reply fails this receiver,
        ``done`` delivers it. Returns the reply when the receiver is still receiving.

        A reply naming another transfer id is ignored (counted in `foreign`): None while the
        outcome stays pending. With ``verdict`` False (the transfer's bytes go on a direct path,
        whose own verdict counts), a ``done`` is not taken either.
        """
        outcome = self.outcome
        tid = self.open.transfer_id
        try:
            reply = OpenReply.decode(data)
        except Exception as exc:  # noqa: BLE001 - a broken reply fails this receiver only
            outcome.error = TransferError(tid, f"bad reply from {self.rx}: {exc}", peer=self.rx)
            return None
        if reply.transfer_id != tid:
            self.foreign += 1
            logger.warning(
                "transfer %s: a reply on %s's inbox names transfer %r; ignored",
                tid,
                self.rx,
                reply.transfer_id[:64],
            )
            return None
        if reply.incarnation:
            self.learned = reply.incarnation
        if not outcome.pending:
            return None
        if not reply.ok:
            outcome.error = TransferRejected(tid, self.rx, reply.reason, code=reply.code or Reason.OTHER)
            return None
        if reply.done:
            if not verdict:
                return None
            outcome.ok = True
            outcome.decode_s = reply.decode_s
            return None
        return reply

    @property
    def restarted(self) -> bool:
        """Whether this transfer met another incarnation than earlier transfers did."""
        return bool(self.expected and self.learned and self.expected != self.learned)
