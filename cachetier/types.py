"""What the tier reports: its status, counters, shed reports, and the listener hook."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, Protocol


class Status(Enum):
    """Lifecycle of a tier: open until `CacheTier.close`."""

    OPEN = "open"
    CLOSED = "closed"


@dataclass(slots=True)
class TierStats:
    """Counters since the tier was created (blocks unless the name says otherwise)."""

    puts: int = 0
    """Contexts stored with `CacheTier.put`."""
    gets: int = 0
    """Contexts assembled with `CacheTier.get`."""
    hits: int = 0
    """Blocks that were resident when a `get` or prefetch asked for them."""
    fetched: int = 0
    """Blocks read back from the remote tier, verified and decoded."""
    misses: int = 0
    """Remote reads that found no usable record (deleted, expired, evicted, flushed, corrupt)."""
    recomputed: int = 0
    """Blocks rebuilt from their tokens by the model runner."""
    recompute_tokens: int = 0
    """Tokens the runner prefilled to rebuild them."""
    offloaded: int = 0
    """Blocks this tier wrote to the remote tier (the write was confirmed)."""
    adopted: int = 0
    """Blocks shed without a write because the remote tier already held them (deduplication)."""
    released: int = 0
    """Blocks shed without a write because this tier had fetched them and kept their stub."""
    dropped: int = 0
    """Blocks shed without any remote copy (low utility, or the remote tier failed)."""
    bytes_written: int = 0
    """Payload bytes written to the remote tier."""
    bytes_read: int = 0
    """Payload bytes read from the remote tier."""
    remote_reads: int = 0
    """Records requested from the remote tier."""
    remote_errors: int = 0
    """Remote calls that failed (connection lost, timeout, refused)."""
    stall_seconds: float = 0.0
    """Time `get` waited for blocks that were not resident (fetch or recompute)."""
    peak_memory_bytes: int = 0
    """Highest resident byte count seen."""

    def to_dict(self) -> dict[str, Any]:
        """The counters as a plain dict (for JSON reports and bench output)."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class ShedReport:
    """What one round of shedding did."""

    dropped: int = 0
    """Blocks freed with no remote copy."""
    offloaded: int = 0
    """Blocks written to the remote tier and left as stubs."""
    adopted: int = 0
    """Blocks left as stubs to records the remote tier already had."""
    released: int = 0
    """Blocks left as stubs they already had."""
    bytes_freed: int = 0
    """Resident bytes freed."""
    bytes_written: int = 0
    """Payload bytes written."""
    memory_bytes: int = 0
    """Resident bytes afterwards."""


class TierEvents(Protocol):
    """What a tier's ``listener`` is: any object with these five hooks (`TierListener` is the base
    with no-op defaults; the bus puts its metrics wrapper there, `kvbus.telemetry.CacheMetrics`)."""

    def offloaded(self, keys: list[str]) -> None:
        """Blocks were written and confirmed."""

    def fetched(self, keys: list[str]) -> None:
        """Blocks were read back."""

    def missed(self, keys: list[str]) -> None:
        """Remote reads found nothing usable."""

    def dropped(self, keys: list[str]) -> None:
        """Blocks were freed with no remote copy."""

    def recomputed(self, keys: list[str]) -> None:
        """Blocks were rebuilt from their tokens."""


class TierListener:
    """Hook for metrics and tracing: the tier calls these on its event loop (subclass what you need).

    Calls are synchronous and must be quick; an exception is logged and ignored.
    """

    def offloaded(self, keys: list[str]) -> None:
        """A batch of blocks was written and confirmed; their stubs exist now."""

    def fetched(self, keys: list[str]) -> None:
        """Blocks were read back, verified and decoded."""

    def missed(self, keys: list[str]) -> None:
        """Remote reads found no usable record for these blocks."""

    def dropped(self, keys: list[str]) -> None:
        """Blocks were freed with no remote copy."""

    def recomputed(self, keys: list[str]) -> None:
        """Blocks were rebuilt from their tokens."""
