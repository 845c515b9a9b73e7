"""Errors of the bus client: every way a transfer can fail, each with the transfer's id."""

from __future__ import annotations

from kvbus.errors import KVBusError
from kvbus.reasons import Reason


class BusError(KVBusError):
    """Root of bus errors."""


class BusClosed(BusError):
    """The bus or agent was closed."""

    def __init__(self, what: str = "bus") -> None:
        super().__init__(f"the {what} is closed")


class TransferError(BusError):
    """A transfer failed; ``transfer_id`` names it and ``peer`` the other side, if known.

    ``failed`` maps each receiver that failed to its error (for a broadcast, the others were
    delivered); it is empty when the transfer failed before any receiver was involved.
    """

    def __init__(self, transfer_id: str, message: str, *, peer: str = "") -> None:
        self.transfer_id = transfer_id
        self.peer = peer
        self.failed: dict[str, TransferError] = {}
        super().__init__(f"transfer {transfer_id}: {message}")


class ReceiverGone(TransferError, ConnectionError):
    """The receiver is not (or no longer) subscribed: it never existed, died or left."""

    def __init__(self, transfer_id: str, peer: str, detail: str = "") -> None:
        tail = f" ({detail})" if detail else ""
        super().__init__(transfer_id, f"receiver {peer!r} is gone{tail}", peer=peer)


class TransferRejected(TransferError):
    """The receiver or the scheduler refused the transfer; ``reason`` says why, ``code`` is the
    `Reason` to match on."""

    def __init__(self, transfer_id: str, by: str, reason: str, code: Reason = Reason.OTHER) -> None:
        self.by = by
        self.reason = reason
        self.code = code
        super().__init__(transfer_id, f"rejected by {by}: {reason}", peer=by)


class TransferTimeout(TransferError, TimeoutError):
    """No progress within the allowed time."""

    def __init__(self, transfer_id: str, stage: str, seconds: float, peer: str = "") -> None:
        self.stage = stage
        self.seconds = seconds
        super().__init__(transfer_id, f"timed out after {seconds:.1f} s while {stage}", peer=peer)


class TransferInDoubt(TransferError):
    """The transfer failed after its bytes may have arrived: the receiver may have delivered it
    (its verdict was lost with it, or it restarted after the last chunk). A plain `TransferError`
    means nothing can have been delivered; this one does not know.

    ``cause`` is the failure as the sender saw it (a `TransferTimeout`, `ReceiverGone`, ...).
    Sent again with the same ``idempotency_key`` (`Agent.send`), a receiver that delivered the
    first answers with that verdict instead of delivering it twice.
    """

    def __init__(self, cause: TransferError) -> None:
        self.cause = cause
        detail = str(cause).removeprefix(f"transfer {cause.transfer_id}: ")
        super().__init__(cause.transfer_id, f"in doubt, the receiver may have it ({detail})", peer=cause.peer)


class SchedulerUnavailable(TransferError):
    """No group scheduler answers for the sender's group."""

    def __init__(self, transfer_id: str, group: str) -> None:
        self.group = group
        super().__init__(
            transfer_id,
            f"no group scheduler answers for group {group!r} (start one with `kvbus group-scheduler --group {group}`)",
        )


class PayloadTooLarge(BusError, ValueError):
    """A payload or header is over a configured limit."""

    def __init__(self, what: str, size: int, limit: int) -> None:
        self.what = what
        self.size = size
        self.limit = limit
        super().__init__(f"{what} of {size} bytes is over the limit of {limit} bytes")


class ReceiveTimeout(BusError, TimeoutError):
    """Nothing arrived in the inbox in time."""

    def __init__(self, seconds: float, waiting_for: str = "a delivery") -> None:
        self.seconds = seconds
        super().__init__(f"no {waiting_for} within {seconds:.1f} s")
