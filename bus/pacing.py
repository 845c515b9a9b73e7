"""Sender-side pacing: a token bucket that holds a stream to its allocated rate."""

from __future__ import annotations

import asyncio
import time


class TokenBucket:
    """Allows ``rate`` bytes/s on average with bursts up to ``burst`` bytes.

    A rate of 0 means unpaced. `set_rate` takes effect on the next `take`, so a scheduler can
    change a running stream's rate.
    """

    def __init__(self, rate: float = 0.0, burst: float | None = None, clock=time.monotonic) -> None:
        self._clock = clock
        self.rate = float(rate)
        self.burst = float(burst) if burst is not None else 0.0
        self._tokens = self.burst
        self._last = clock()

    def set_rate(self, rate: float, burst: float | None = None) -> None:
        self._refill()
        self.rate = float(rate)
        if burst is not None:
            self.burst = float(burst)

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

    async def take(self, nbytes: int) -> None:
        delay = self.delay_for(nbytes)
        if delay > 0:
            await asyncio.sleep(delay)
