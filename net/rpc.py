"""Request/reply with a timeout per attempt, retried on timeout or no responders with backoff.

Retrying sends the same payload again, so it is only safe for a request the server answers
idempotently by a key the caller put in it (a transfer id, a reservation id, a group): asked
twice, the server gives the same answer and has the effect once (the group scheduler answers a
re-sent request with the entry it already has; the coordinator replaces a group's lease and a
reservation by id). `RpcClient.request` takes that key and refuses to retry without one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from kvbus.errors import ConfigError
from kvbus.net.transport import NoResponders, Transport

logger = logging.getLogger(__name__)

__all__ = ["NO_RETRY", "Retry", "RpcClient"]


@dataclass(frozen=True, slots=True)
class Retry:
    """How an unanswered request is tried again (a strategy object, as redis-py's ``Retry``)."""

    attempts: int = 1
    """Tries in all; 1 means no retry."""
    backoff_s: float = 0.05
    """Wait before the second try; it doubles for every further one."""
    max_backoff_s: float = 1.0
    """The wait between tries never grows past this."""
    on_timeout: bool = True
    """Retry when nobody answered in time."""
    on_no_responders: bool = True
    """Retry when nobody was subscribed (a service restarting or failing over)."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"retry attempts {self.attempts} must be at least 1")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ConfigError("retry backoff must not be negative")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed try number ``attempt`` (1-based) before the next."""
        return min(self.max_backoff_s, self.backoff_s * (2.0 ** max(0, attempt - 1)))


#: One try, no retry: what a request without a retry strategy does.
NO_RETRY = Retry()


class RpcClient:
    """Requests over a `Transport`: a timeout per try, retries by a `Retry` strategy.

    Args:
        transport: the NATS seam.
        timeout: seconds each try waits for the reply (default for `request`).
        retry: the default retry strategy (default: no retry).
    """

    def __init__(self, transport: Transport, *, timeout: float = 2.0, retry: Retry = NO_RETRY) -> None:
        self.transport = transport
        self.timeout = timeout
        self.retry = retry

    async def request(
        self,
        subject: str,
        payload: bytes,
        *,
        key: str = "",
        timeout: float | None = None,
        retry: Retry | None = None,
        total_s: float | None = None,
    ) -> bytes:
        """Send ``payload`` to ``subject`` and return the reply, trying again as ``retry`` says.

        Args:
            subject: where to send it.
            payload: the request, carrying ``key``.
            key: the idempotency key the server answers the request by (required to retry).
            timeout: seconds per try (default: the client's).
            retry: the retry strategy (default: the client's).
            total_s: give up after this many seconds in all (the last try gets what is left).

        Raises:
            NoResponders: nobody was subscribed on the last try.
            TimeoutError: nobody answered the last try in time.
            ValueError: a retrying strategy without a ``key``.
        """
        retry = self.retry if retry is None else retry
        if retry.attempts > 1 and not key:
            raise ValueError(f"a request on {subject} is retried only with an idempotency key")
        per_try = self.timeout if timeout is None else timeout
        give_up = None if total_s is None else time.monotonic() + total_s
        attempt = 1
        while True:
            wait = per_try
            if give_up is not None:
                wait = min(wait, max(0.0, give_up - time.monotonic()))
            try:
                return await self.transport.request(subject, payload, timeout=wait)
            except NoResponders:
                if not retry.on_no_responders or not self._again(retry, attempt, give_up):
                    raise
                why = "no responders"
            except TimeoutError:
                if not retry.on_timeout or not self._again(retry, attempt, give_up):
                    raise
                why = "no reply in time"
            delay = retry.delay(attempt)
            if give_up is not None:
                delay = min(delay, max(0.0, give_up - time.monotonic()))
            logger.debug(
                "request %s on %s: %s (try %d of %d); again in %.2f s",
                key,
                subject,
                why,
                attempt,
                retry.attempts,
                delay,
            )
            await asyncio.sleep(delay)
            attempt += 1

    @staticmethod
    def _again(retry: Retry, attempt: int, give_up: float | None) -> bool:
        """Whether another try is allowed after try number ``attempt``."""
        return attempt < retry.attempts and (give_up is None or time.monotonic() < give_up)
