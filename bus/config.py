"""Settings of the bus client."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbus.config import from_env
from kvbus.errors import ConfigError

DEFAULT_CHUNK_SIZE = 1024 * 1024
DEFAULT_WINDOW = 16
#: Bytes of NATS headers and protocol line we keep free below the server's max_payload.
HEADER_ROOM = 4096
#: Payloads above this are encoded and decoded in a worker thread, off the event loop.
OFFLOAD_BYTES = 1 << 20
#: A plain copy up to this size (a delta base) runs on the event loop: at 8 GB/s and more it takes
#: under 0.5 ms, where a hop to a worker thread and back costs 0.1 ms of two loaded cores.
COPY_INLINE_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class BusConfig:
    """How agents stream. Override any field with ``KVBUS_BUS_<FIELD>``."""

    chunk_size: int = DEFAULT_CHUNK_SIZE
    """Bytes per chunk; capped at the server's max_payload minus `HEADER_ROOM`."""
    window: int = DEFAULT_WINDOW
    """Chunks a sender may have in flight beyond the receiver's last acknowledgement."""
    ack_every: int = 4
    """The receiver acknowledges every this many chunks (and always the last one)."""
    inline_limit: int = 2 * 1024 * 1024
    """Payloads up to this size travel inside the `Open` message (one round trip), if it fits max_payload."""
    max_transfer_bytes: int = 4 * 1024**3
    """Largest payload a receiver accepts."""
    ack_timeout: float = 2.0
    """Seconds without acknowledgement before the sender re-checks the receiver and resends."""
    peer_timeout: float = 15.0
    """Seconds without any progress after which a transfer fails."""
    request_timeout: float = 5.0
    """Seconds to wait for a scheduler's or receiver's answer to a request."""
    grant_timeout: float = 60.0
    """Seconds to wait for a grant when the send has no deadline."""
    regrant_interval: float = 1.0
    """A queued sender asks its scheduler again after this many seconds without a grant (the
    scheduler may have restarted); also the longest pause between tries while none answers."""
    partial_timeout: float = 30.0
    """Seconds a receiver keeps a partial transfer without valid progress (a chunk that passed
    its digest); junk chunks do not count."""
    max_partials: int = 32
    """Most partial (streamed, not yet whole) transfers a receiver holds; over it, the one with
    the oldest valid progress is dropped and its sender gets `Reason.PARTIAL_DROPPED`."""
    max_partial_bytes: int = 4 * 1024**3
    """Most bytes (as announced in their Opens) a receiver's partial transfers may add up to; a
    single transfer over it is refused (`Reason.TOO_LARGE`), else the oldest are dropped as above."""
    max_partial_overhead: int = 8 * 1024**2
    """Most bytes of bookkeeping (chunk digests and plan, codec metadata) a receiver's partial
    transfers may hold together, beyond their payloads; over it, the oldest are dropped as above.
    A legitimate partial holds a few KB; the largest an `Open` can announce, about 0.6 MB."""
    probe_interval: float = 1.0
    """Seconds between probe reports to the group scheduler."""
    max_missing: int = 256
    """Most chunk indices one repair request lists."""
    keep_bases: bool = True
    """Keep the last context from each sender as the base for delta media (costs its memory)."""
    rate_budgets: bool = True
    """Take the rate budgets the scheduler grants with small transfers (`kvbus.bus.budgets`): the
    next small ones to the same receivers start without a grant round trip."""

    def __post_init__(self) -> None:
        if self.chunk_size < 1024:
            raise ConfigError(f"chunk_size {self.chunk_size} must be at least 1024 bytes")
        if not 1 <= self.window <= 4096:
            raise ConfigError(f"window {self.window} must be in 1..4096")
        if self.max_partials < 1 or self.max_partial_bytes < 1 or self.max_partial_overhead < 1:
            raise ConfigError("max_partials, max_partial_bytes and max_partial_overhead must be at least 1")
        if not 1 <= self.ack_every <= self.window:
            raise ConfigError(f"ack_every {self.ack_every} must be in 1..window ({self.window})")
        for name in (
            "ack_timeout",
            "peer_timeout",
            "request_timeout",
            "grant_timeout",
            "regrant_interval",
            "partial_timeout",
            "probe_interval",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")

    @classmethod
    def from_env(cls, **overrides: Any) -> BusConfig:
        """The defaults, overridden by ``KVBUS_BUS_<FIELD>`` variables, then by ``overrides``."""
        return from_env(cls, "bus", None, **overrides)
