"""Typed reason codes: why a request, an `Open` or a transfer was refused or failed.

Every refusal on the wire carries a ``code`` (one of `Reason`) beside its human-readable
``reason``; code paths match the code, never the text.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Why something was refused or failed; ``NONE`` when it was not."""

    NONE = ""
    OTHER = "other"
    """A reason this side does not know (a newer peer); the text says more."""
    MALFORMED = "malformed"
    """The message did not decode or failed validation."""
    WRONG_SENDER = "wrong_sender"
    """The message names a sender other than the one its subject belongs to."""
    UNKNOWN_RECEIVER = "unknown_receiver"
    RECEIVER_DOWN = "receiver_down"
    """A receiver sent no probe for longer than the probe TTL: refused until it probes again."""
    SENDER_DOWN = "sender_down"
    """The sender itself sent no probe for longer than the probe TTL (its probes do not reach its
    scheduler): refused until it probes again."""
    RECEIVER_GONE = "receiver_gone"
    INCOMPATIBLE = "incompatible"
    """The receiver's model cannot use the medium (signature mismatch, no model)."""
    UNKNOWN_CODEC = "unknown_codec"
    TOO_LARGE = "too_large"
    """A size or count is over the receiver's or the protocol's limit."""
    DIGEST_MISMATCH = "digest_mismatch"
    DECODE_FAILED = "decode_failed"
    DELTA_BASE_MISMATCH = "delta_base_mismatch"
    """A delta medium's base is not what the receiver holds: resend without delta."""
    CANCELLED = "cancelled"
    """The scheduler cancelled the transfer (preempted for good, its receiver went down, ...)."""
    REFUSED = "refused"
    """Admission control or policy said no (a reservation that does not fit, ...)."""
    UNAVAILABLE = "unavailable"
    """A service the answer depends on did not answer (the coordinator, for a deployment-wide
    reservation); asking again later may work."""
    NOT_FOUND = "not_found"
    """The transfer or reservation the message names is not known here."""
    SHUTTING_DOWN = "shutting_down"
    RECEIVER_RESTARTED = "receiver_restarted"
    """A retried `Open` reached a new incarnation of the receiver (it restarted since the transfer
    was first offered): an earlier incarnation may have delivered it, so this one refuses rather
    than risk a second delivery. The transfer is not confirmed; a retry is a new transfer."""
    KEY_IN_PROGRESS = "key_in_progress"
    """An `Open` carries the idempotency key of a transfer from the same sender that this
    receiver is still receiving or decoding: it is refused rather than delivered twice (the
    first may yet be delivered; ask again once it has its verdict)."""
    PARTIAL_DROPPED = "partial_dropped"
    """The receiver dropped a partial transfer: no valid progress for ``partial_timeout``, or evicted
    (the one with the oldest valid progress) to stay within its caps on partial transfers."""
    INTERNAL = "internal"

    @classmethod
    def parse(cls, value: object) -> Reason:
        """The code for a wire value; an unknown one is `OTHER` (a peer newer than this side)."""
        if isinstance(value, str):
            try:
                return cls(value)
            except ValueError:
                pass
        return cls.OTHER
