"""Leader election by a lease in a JetStream KV bucket (compare-and-set on the key's revision).

Used by coordinator replicas and by group scheduler replicas: the holder renews the lease every
``ttl / 3``; a standby takes it over when it has not been renewed for ``ttl``.

A holder that cannot reach the bucket (its NATS server died and the client is moving to another,
or JetStream is electing a new meta leader) keeps the lease until ``ttl`` has passed since its
last renewal began: no standby can take it over sooner, so stepping down at the first error only
leaves the group without a leader through the failover. Every bucket call is bounded by
``ttl / 3``, so a call that hangs on a dead server cannot outlive the lease.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

logger = logging.getLogger(__name__)


class LeaderLease:
    """Holds or waits for the lease ``key`` in ``bucket``; calls ``on_elected`` once when it wins."""

    def __init__(
        self,
        bucket: Any,
        key: str,
        holder: str,
        *,
        ttl: float = 3.0,
        on_elected: Callable[[], Awaitable[None]] | None = None,
        on_lost: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.bucket = bucket
        self.key = key
        self.holder = holder
        self.ttl = ttl
        self.on_elected = on_elected
        self.on_lost = on_lost
        self.is_leader = False
        self._revision: int | None = None
        self._renewed_at = 0.0
        """`time.monotonic()` when the last successful write of the lease began."""
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def _value(self) -> bytes:
        return json.dumps({"holder": self.holder, "ts": time.time()}).encode()

    async def try_acquire(self) -> bool:
        """One attempt: create the key, renew it if ours, or take it over if stale.

        Returns whether this holder has the lease now. A holder that could not reach the bucket
        still has it while less than ``ttl`` has passed since its last renewal began.
        """
        started = time.monotonic()
        try:
            won = await asyncio.wait_for(self._attempt(), self.ttl / 3)
        except KeyWrongLastSequenceError:
            return False  # someone else wrote the key: it is theirs
        except Exception:
            keeps = self.is_leader and time.monotonic() - self._renewed_at < self.ttl
            logger.warning(
                "lease %s: could not reach the bucket%s",
                self.key,
                " (keeping the lease until it expires)" if keeps else "",
                exc_info=True,
            )
            return keeps
        if won:
            self._renewed_at = started
        return won

    async def _attempt(self) -> bool:
        if self.is_leader and self._revision is not None:
            try:
                self._revision = await self.bucket.update(self.key, self._value(), last=self._revision)
                return True
            except KeyWrongLastSequenceError:
                pass  # a renewal that timed out may have landed after all: read who holds it
        try:
            entry = await self.bucket.get(self.key)
        except KeyNotFoundError:
            entry = None
        if entry is None or entry.value is None:
            self._revision = await self.bucket.create(self.key, self._value())
            return True
        current = json.loads(entry.value)
        if current.get("holder") == self.holder or time.time() - float(current.get("ts", 0)) > self.ttl:
            self._revision = await self.bucket.update(self.key, self._value(), last=entry.revision)
            return True
        return False

    async def run(self) -> None:
        """Campaign and renew until cancelled or released.

        The loop also checks a flag: a cancellation that lands inside a NATS request can come
        back as a timeout error, which would otherwise keep a released lease renewing forever.
        """
        while not self._stopping:
            won = await self.try_acquire()
            if won and not self.is_leader:
                self.is_leader = True
                logger.info("%s is now the leader for %s", self.holder, self.key)
                if self.on_elected:
                    await self.on_elected()
            elif not won and self.is_leader:
                self.is_leader = False
                self._revision = None
                logger.warning("%s lost the lease %s", self.holder, self.key)
                if self.on_lost:
                    await self.on_lost()
            await asyncio.sleep(self.ttl / 3)

    def start(self) -> asyncio.Task[None]:
        """Start campaigning for the lease in a background task (`run`) and return that task."""
        self._task = asyncio.create_task(self.run(), name=f"kvbus-lease-{self.key}")
        return self._task

    async def release(self, timeout: float = 2.0) -> None:
        """Stop campaigning and give the lease up (delete it if ours)."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            try:
                await asyncio.wait_for(self._task, timeout)
            except (asyncio.CancelledError, TimeoutError):
                pass
        if self.is_leader:
            try:
                await asyncio.wait_for(self.bucket.delete(self.key), timeout)
            except (Exception, TimeoutError):
                logger.debug("could not delete lease %s", self.key, exc_info=True)
        self.is_leader = False
