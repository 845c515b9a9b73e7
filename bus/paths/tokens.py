"""One-time transfer tokens: the receiver hands one out in its `OpenReply`; a direct connection
presents it to bind a stream to that transfer. Each token works once, for one transfer, until
it expires; a new token for the same transfer (a re-sent `Open`) replaces the old one."""

from __future__ import annotations

import enum
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvbus.bus.paths.frames import TOKEN_BYTES


class Claim(enum.StrEnum):
    """The outcome of presenting a token."""

    OK = "ok"
    UNKNOWN = "unknown transfer"
    WRONG = "wrong token"
    REPLAYED = "token already used"
    EXPIRED = "token expired"


@dataclass(slots=True)
class _Entry:
    token: bytes
    expires: float
    used: bool = False


class TokenTable:
    """The tokens a receiving process has handed out, by transfer id."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[str, _Entry] = {}

    def issue(self, transfer_id: str, ttl: float) -> str:
        """A fresh token for ``transfer_id`` (hex), valid once within ``ttl`` seconds; any older one stops working."""
        raw = secrets.token_bytes(TOKEN_BYTES)
        self._entries[transfer_id] = _Entry(raw, self._clock() + ttl)
        return raw.hex()

    def claim(self, transfer_id: str, token: bytes) -> Claim:
        """Use ``token`` for ``transfer_id``; only `Claim.OK` means it was valid (and it is spent now)."""
        entry = self._entries.get(transfer_id)
        if entry is None:
            return Claim.UNKNOWN
        if len(token) != TOKEN_BYTES or not hmac.compare_digest(entry.token, token):
            return Claim.WRONG
        if entry.used:
            return Claim.REPLAYED
        if self._clock() > entry.expires:
            return Claim.EXPIRED
        entry.used = True
        return Claim.OK

    def revoke(self, transfer_id: str) -> None:
        """Forget ``transfer_id``'s token (the transfer ended)."""
        self._entries.pop(transfer_id, None)

    def __len__(self) -> int:
        return len(self._entries)
