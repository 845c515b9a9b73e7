"""Sender-side pacing: a token bucket that holds a stream to its allocated rate."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EmulatedLink:
    """A link to emulate for an agent: its transfers are paced to ``bandwidth_bps`` and delayed by
    ``latency_s`` per hop of each round trip. For tests and benchmarks; real deployments measure
    the real links and leave this unset."""

    bandwidth_bps: float = 0.0
    """Bytes per second (0 = not emulated)."""
    latency_s: float = 0.0
    """One-way latency in seconds."""

    @classmethod
    def mbit(cls, mbit_per_s: float, latency_ms: float = 0.0) -> EmulatedLink:
        """A link of ``mbit_per_s`` megabits per second and ``latency_ms`` one-way latency."""
        return cls(mbit_per_s * 1e6 / 8, latency_ms / 1000)


class TokenBucket:
    """Allows ``rate`` bytes/s on average with bursts up to ``burst`` bytes.

    A rate of 0 means unpaced. `set_rate` takes effect at once, also for a `take` already
    waiting (its remaining wait is recomputed at the new rate), so a scheduler can change a
    running stream's rate without the chunk in flight keeping the old one.
    """

    def __init__(
        self, rate: float = 0.0, burst: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self.rate = float(rate)
        self.burst = float(burst) if burst is not None else 0.0
        # Start empty: a stream's first bytes are paced like the rest, so a transfer of N bytes
        # takes N / rate (a full bucket would let the first burst through for free).
        self._tokens = 0.0
        self._last = clock()
        self._waiter: asyncio.Future[None] | None = None

    def set_rate(self, rate: float, burst: float | None = None) -> None:
        """Change the rate (and burst) now; a `take` already waiting is recomputed at the new rate."""
        self._refill()
        self.rate = float(rate)
        if burst is not None:
            self.burst = float(burst)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _refill(self) -> None:
        now = self._clock()
        if self.rate > 0:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now

    def delay_for(self, nbytes: int) -> float:
        """Seconds to wait before ``nbytes`` may go (0 when they may go now); reserves them."""
        if self.rate <= 0:
            return 0.0
        self._refill()
        self._tokens -= nbytes
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    def charge(self, nbytes: int) -> None:
        """``nbytes`` went without waiting: the next `take` waits until they are earned."""
        if self.rate > 0:
            self._refill()
            self._tokens -= nbytes

    def restart(self) -> None:
        """Forget credit saved while the stream was idle (paused): it restarts at its rate, no burst."""
        self._refill()
        self._tokens = min(self._tokens, 0.0)

    def _debt_delay(self) -> float:
        """Seconds until the bytes already reserved are earned at the current rate."""
        if self.rate <= 0:
            return 0.0
        self._refill()
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    async def take(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may go at the current rate."""
        delay = self.delay_for(nbytes)
        while delay > 0:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(delay, _release, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
            # Woken early by set_rate: wait out the rest of the debt at the new rate.
            delay = self._debt_delay()
            if self.rate <= 0:
                self._tokens = 0.0  # unpaced now: the debt is forgiven


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
