"""The group's state S(t): agents from probes, links from observed transfers, the work queue."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvbus.protocol import Probe, TransferRequest
from kvbus.signature import ModelSignature


@dataclass
class AgentState:
    """What the scheduler knows of one agent of its group."""

    name: str
    queue_size: int = 0
    cache_bytes: int = 0
    compute_load: float = 0.0
    role_priority: float = 1.0
    role: str = "agent"
    last_seen: float = 0.0
    memory_pressure: float = 0.0
    """0..1: how far past its cache watermark (set by the memory-hint logic; 0 without a budget)."""

    def update(self, probe: Probe) -> None:
        self.queue_size = probe.queue_size
        self.cache_bytes = probe.cache_bytes
        self.compute_load = probe.compute_load
        self.role_priority = probe.role_priority
        self.role = probe.role
        self.last_seen = time.monotonic()


@dataclass
class LinkEstimate:
    """Bandwidth of one (sender, receiver) link over a sliding window of observed transfers."""

    samples: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=16))
    """(bytes, seconds, when) of recent transfers."""
    max_age_s: float = 60.0
    """Samples older than this are forgotten (links change; an unused estimate goes stale)."""

    def observe(self, nbytes: int, seconds: float, now: float | None = None) -> None:
        if nbytes > 0 and seconds > 0:
            self.samples.append((float(nbytes), float(seconds), time.monotonic() if now is None else now))

    def _fresh(self) -> list[tuple[float, float, float]]:
        cutoff = time.monotonic() - self.max_age_s
        while self.samples and self.samples[0][2] < cutoff:
            self.samples.popleft()
        return list(self.samples)

    @property
    def bandwidth_bps(self) -> float:
        """Bytes over seconds across the window (weights big transfers by their size), 0 if unknown."""
        fresh = self._fresh()
        b = sum(s[0] for s in fresh)
        t = sum(s[1] for s in fresh)
        return b / t if t > 0 else 0.0

    @property
    def known(self) -> bool:
        return bool(self._fresh())


@dataclass
class Pending:
    """A transfer request waiting for, or holding, a grant."""

    request: TransferRequest
    receivers: dict[str, ModelSignature | None]
    """Each receiver's model signature from the directory (None: accepts tokens only)."""
    arrived: float = field(default_factory=time.monotonic)
    granted_at: float = 0.0
    medium: str = ""
    rate_bps: float = 0.0
    decision: dict = field(default_factory=dict)
    predicted_s: float = 0.0

    @property
    def transfer_id(self) -> str:
        return self.request.transfer_id


@dataclass
class GroupState:
    """S(t) for one group."""

    group: str
    agents: dict[str, AgentState] = field(default_factory=dict)
    links: dict[tuple[str, str], LinkEstimate] = field(default_factory=dict)
    queue: list[Pending] = field(default_factory=list)
    active: dict[str, Pending] = field(default_factory=dict)
    bandwidth_bps: float = 0.0
    """The group's bandwidth budget (0 = unlimited)."""
    granted: int = 0
    completed: int = 0
    failed: int = 0

    def on_probe(self, probe: Probe) -> None:
        self.agents.setdefault(probe.agent, AgentState(probe.agent)).update(probe)
        self.declare(probe.agent, probe.link_bps, probe.latency_s)

    def declare(self, agent: str, link_bps: float, latency_s: float) -> None:
        """Record an agent's declared link; a changed declaration resets the estimates of its links
        (the declaration is newer information than the samples)."""
        new = (float(link_bps), float(latency_s))
        old = self.declared.get(agent)
        self.declared[agent] = new
        if old is not None and old != new:
            for key in [k for k in self.links if agent in k]:
                self.links[key].samples.clear()

    def link(self, src: str, dst: str) -> LinkEstimate:
        return self.links.setdefault((src, dst), LinkEstimate())

    declared: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per agent: (link bytes/s, one-way latency s) it declared in the directory (0 = unknown)."""

    def declared_bandwidth(self, src: str, dst: str) -> float:
        rates = [r for r in (self.declared.get(src, (0.0, 0.0))[0], self.declared.get(dst, (0.0, 0.0))[0]) if r > 0]
        return min(rates) if rates else 0.0

    def declared_latency(self, src: str, dst: str) -> float:
        return self.declared.get(src, (0.0, 0.0))[1] + self.declared.get(dst, (0.0, 0.0))[1]
