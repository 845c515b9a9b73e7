"""Shedding policy: how useful a block is, and what happens to it when memory runs short.

Utility is an exponentially decayed access count (LRFU): every access adds one, and the sum
halves every ``half_life`` seconds. It rewards both frequency (many accesses add up) and recency
(old ones fade), and needs two numbers per block.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum

from kvbus.cachetier.config import DEFAULT_CODEC, DEFAULT_DROP_BELOW, DEFAULT_HALF_LIFE
from kvbus.errors import ConfigError


class Action(Enum):
    """What shedding does with a resident block."""

    DROP = "drop"
    """Free it; it is recomputed from its tokens if it is needed again."""
    OFFLOAD = "offload"
    """Compress it into the remote tier and keep a stub."""


@dataclass(slots=True)
class Usage:
    """A block's decayed access count."""

    score: float = 0.0
    """Accesses, decayed to the time of the last one."""
    last: float = 0.0
    """Clock reading of the last access."""

    def value(self, now: float, half_life: float) -> float:
        """The decayed count at time ``now``."""
        if self.score == 0.0:
            return 0.0
        return self.score * math.exp2(-max(0.0, now - self.last) / half_life)

    def touch(self, now: float, half_life: float, weight: float = 1.0) -> None:
        """Record an access of ``weight`` at time ``now``."""
        self.score = self.value(now, half_life) + weight
        self.last = max(self.last, now)


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What a policy may look at when it decides about one block."""

    key: str
    """The block's content key."""
    start: int
    """First token of the block in its context."""
    n_tokens: int
    """Tokens in the block."""
    nbytes: int
    """Resident bytes of the block."""
    utility: float
    """Its decayed access count now."""


class ShedPolicy(ABC):
    """Decides how useful blocks are and what shedding does with each; subclass to change either.

    The defaults: utility is the decayed access count; a block below `drop_below` is dropped,
    others are offloaded with `codec_for`. A cost model plugs in by overriding `codec_for`
    (and `action`, to weigh recompute against a fetch).
    """

    half_life: float = DEFAULT_HALF_LIFE
    drop_below: float = DEFAULT_DROP_BELOW

    def utility(self, usage: Usage, now: float) -> float:
        """The block's utility at time ``now`` (higher is kept longer)."""
        return usage.value(now, self.half_life)

    def action(self, block: BlockInfo) -> Action:
        """Drop or offload ``block`` (chosen for shedding)."""
        return Action.DROP if block.utility < self.drop_below else Action.OFFLOAD

    @abstractmethod
    def codec_for(self, block: BlockInfo) -> str:
        """The codec an offloaded ``block`` is stored with."""


class UtilityPolicy(ShedPolicy):
    """The default policy: decayed-frequency utility, one codec for every offloaded block."""

    def __init__(
        self,
        *,
        codec: str = DEFAULT_CODEC,
        half_life: float = DEFAULT_HALF_LIFE,
        drop_below: float = DEFAULT_DROP_BELOW,
    ) -> None:
        """Args:
        codec: the codec offloaded blocks are stored with.
        half_life: seconds after which an access counts half.
        drop_below: utility under which a shed block is dropped instead of offloaded
            (0 offloads everything; ``inf`` drops everything).
        """
        if half_life <= 0:
            raise ConfigError(f"half_life {half_life} must be positive")
        if drop_below < 0:
            raise ConfigError(f"drop_below {drop_below} must not be negative")
        self.codec = codec
        self.half_life = half_life
        self.drop_below = drop_below

    def codec_for(self, block: BlockInfo) -> str:
        """The one codec every offloaded block is stored with."""
        return self.codec

    def __repr__(self) -> str:
        return f"UtilityPolicy(codec={self.codec!r}, half_life={self.half_life}, drop_below={self.drop_below})"
