"""Settings of the cache tier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbus.config import from_env
from kvbus.errors import ConfigError

DEFAULT_BLOCK_TOKENS = 256
DEFAULT_BUDGET_BYTES = 2 * 1024**3
DEFAULT_HIGH_WATERMARK = 0.9
DEFAULT_LOW_WATERMARK = 0.75
DEFAULT_CODEC = "int8"
DEFAULT_HALF_LIFE = 60.0
DEFAULT_DROP_BELOW = 0.1
DEFAULT_KEY_PREFIX = "kvbus:kv:"
DEFAULT_REMOTE_TTL = 24 * 3600
DEFAULT_BATCH_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class CacheTierConfig:
    """How an agent's KV memory is managed. Override any field with ``KVBUS_CACHETIER_<FIELD>``."""

    block_tokens: int = DEFAULT_BLOCK_TOKENS
    """Tokens per block; every agent sharing a remote tier must use the same value to share blocks."""
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    """The agent's memory budget for resident KV, in bytes."""
    high_watermark: float = DEFAULT_HIGH_WATERMARK
    """Shedding starts when resident bytes would exceed this fraction of the budget."""
    low_watermark: float = DEFAULT_LOW_WATERMARK
    """Shedding stops once resident bytes are at or below this fraction of the budget."""
    codec: str = DEFAULT_CODEC
    """Codec that offloaded blocks are stored with (the default `UtilityPolicy`'s choice)."""
    half_life: float = DEFAULT_HALF_LIFE
    """Seconds after which an access counts half as much towards a block's utility."""
    drop_below: float = DEFAULT_DROP_BELOW
    """Blocks shed with a utility below this are dropped (recomputed from tokens), others offloaded."""
    key_prefix: str = DEFAULT_KEY_PREFIX
    """Prefix of every remote key; tiers with the same prefix on the same server share blocks."""
    remote_ttl: int = DEFAULT_REMOTE_TTL
    """Seconds a remote block lives after its last write or read (0: until the server evicts it)."""
    write_batch_bytes: int = DEFAULT_BATCH_BYTES
    """Payload bytes per pipelined write (a bigger block goes alone); the next batch is encoded
    while one is in flight. Small blocks share round trips; multi-MB ones gain nothing from
    sharing one, and redis-py moves them slower in big pipelines (buffering)."""
    read_batch_bytes: int = DEFAULT_BATCH_BYTES
    """Payload bytes per pipelined read; one batch is verified and decoded while the next is read."""
    connect_timeout: float = 5.0
    """Seconds to wait for a connection to the remote tier."""
    socket_timeout: float = 30.0
    """Seconds to wait for one reply from the remote tier."""
    retries: int = 2
    """Times a failed remote command is retried (with jittered backoff) before the tier gives up on it."""
    cluster: bool = False
    """Talk to a Redis Cluster (Valkey cluster mode) through redis-py's cluster client even when
    the URL names one node (a ``redis+cluster://`` URL, or one with several hosts, implies it)."""
    wait_replicas: int = -1
    """Replicas that must have a block before its write counts (``WAIT``): a block is turned into a
    stub (its memory freed) only then, so a primary's failover cannot lose it. -1: 1 on a cluster,
    0 on a single server."""
    wait_timeout_ms: int = 1000
    """Milliseconds a write waits for ``wait_replicas`` replicas; a block not confirmed in time stays resident."""

    def __post_init__(self) -> None:
        if not 1 <= self.block_tokens <= 1 << 16:
            raise ConfigError(f"block_tokens {self.block_tokens} must be in 1..65536")
        if self.budget_bytes < 0:
            raise ConfigError(f"budget_bytes {self.budget_bytes} must not be negative")
        if not 0.0 <= self.low_watermark <= self.high_watermark <= 1.0:
            raise ConfigError(
                f"watermarks must satisfy 0 <= low ({self.low_watermark}) <= high ({self.high_watermark}) <= 1"
            )
        if self.half_life <= 0:
            raise ConfigError(f"half_life {self.half_life} must be positive")
        if self.drop_below < 0:
            raise ConfigError(f"drop_below {self.drop_below} must not be negative")
        if not self.codec:
            raise ConfigError("codec must name a registered codec")
        if self.remote_ttl < 0:
            raise ConfigError(f"remote_ttl {self.remote_ttl} must not be negative")
        for name in ("write_batch_bytes", "read_batch_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive")
        for name in ("connect_timeout", "socket_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.retries < 0:
            raise ConfigError(f"retries {self.retries} must not be negative")
        if self.wait_replicas < -1:
            raise ConfigError(f"wait_replicas {self.wait_replicas} must be -1 (auto) or more")
        if self.wait_timeout_ms < 1:
            raise ConfigError(f"wait_timeout_ms {self.wait_timeout_ms} must be positive")

    @property
    def high_bytes(self) -> int:
        """Resident bytes above which the tier sheds."""
        return int(self.budget_bytes * self.high_watermark)

    @property
    def low_bytes(self) -> int:
        """Resident bytes the tier sheds down to."""
        return int(self.budget_bytes * self.low_watermark)

    @classmethod
    def from_env(cls, **overrides: Any) -> CacheTierConfig:
        """The defaults, overridden by ``KVBUS_CACHETIER_<FIELD>`` variables, then by ``overrides``."""
        return from_env(cls, "cachetier", **overrides)
