"""What an agent's parts share: its identity and options, its settings and its connection."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbus.bus.cache import CacheTier
from kvbus.bus.config import BusConfig
from kvbus.bus.pacing import EmulatedLink
from kvbus.codecs import ModelRunner
from kvbus.net.transport import Transport
from kvbus.signature import ModelSignature


@dataclass(frozen=True, slots=True)
class AgentOptions:
    """Who an agent is and what it brings: the options of `Bus.agent`, checked and resolved there
    (the group placed, the signature taken from the runner), in the one value the agent is made of."""

    name: str
    group: str
    """The group whose scheduler grants this agent's transfers."""
    role: str
    priority: float
    """The role priority used in scheduling weights."""
    signature: ModelSignature | None
    """The model signature KV sent to this agent must match (None: token media only)."""
    runner: ModelRunner | None
    """The agent's model, for media that carry no KV (recompute) or need generation."""
    cache: CacheTier | None
    """The agent's cache tier, or None."""
    link: EmulatedLink | None
    """The emulated link declared to the schedulers at first, or None on real links."""


class Endpoint:
    """One agent as its sender, receiver, scheduler link and probes see it.

    `Agent` is an Endpoint and hands itself to its parts, so they read one live state: a new
    link, or a transport swapped for a faulty one in a test, reaches all of them at once. What
    a part needs from the bus the agent is registered on, it is given when it is made.
    """

    def __init__(self, options: AgentOptions, transport: Transport, config: BusConfig) -> None:
        self.link = options.link
        """The emulated link declared to the schedulers, or None on real links (`Agent.set_link`)."""
        self.name = options.name
        self.group = options.group
        """The group whose scheduler grants this agent's transfers."""
        self.role = options.role
        self.priority = options.priority
        self.signature = options.signature
        """The model signature KV sent to this agent must match (None: token media only)."""
        self.runner = options.runner
        """The agent's model, for media that carry no KV (recompute) or need generation."""
        self.cache = options.cache
        """The agent's cache tier, or None."""
        self.closed = False
        self.transport = transport
        """The NATS connection the parts send and reply on (the bus's; a test may swap in a wrapper)."""
        self.config = config
        self.prefill = PrefillSpeed()
        """The prefill speed this agent measured on its own recomputes (reported in its probes)."""


class PrefillSpeed:
    """An agent's measured prefill speed, tokens/s: an exponentially weighted mean of the
    recomputes it did (``tokens`` and ``summary`` deliveries), 0 until one was measured, with the
    same mean of their lengths and of the tokens each found held already.

    The scheduler's cost model uses it instead of the calibrated figure scaled by the reported
    load: it already is the speed under the load the agent really has. The lengths let it carry
    the speed to other lengths (a long prefill is slower per token than a short one).
    """

    __slots__ = ("held", "tokens", "tokens_per_s")

    #: Weight of the newest measurement.
    ALPHA = 0.3
    #: Recomputes of fewer tokens are dominated by fixed costs and say little about the speed.
    MIN_TOKENS = 16

    def __init__(self) -> None:
        self.tokens_per_s = 0.0
        self.tokens = 0.0
        self.held = 0.0

    def observe(self, tokens: int, seconds: float, held: int = 0) -> None:
        """Count a recompute of ``tokens`` tokens after ``held`` in the cache that took ``seconds``."""
        if tokens < self.MIN_TOKENS or not 0.0 < seconds < math.inf:
            return
        speed = tokens / seconds
        if self.tokens_per_s == 0.0:
            self.tokens_per_s, self.tokens, self.held = speed, float(tokens), float(max(0, held))
        else:
            self.tokens_per_s += self.ALPHA * (speed - self.tokens_per_s)
            self.tokens += self.ALPHA * (tokens - self.tokens)
            self.held += self.ALPHA * (max(0, held) - self.held)
