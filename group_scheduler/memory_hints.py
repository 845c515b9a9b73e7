"""Memory hints: an agent whose cache is over its watermark is told to shed (a ``shed`` control).

The pressure (how far past its watermark, 0..1) also goes into the agent's state, where the
cost model charges media that make a pressed receiver hold more.
"""

from __future__ import annotations

from kvbus.group_scheduler.config import SchedulerConfig
from kvbus.group_scheduler.state import AgentState
from kvbus.protocol import Control, ControlAction


class MemoryHints:
    """Per-agent cache watermarks and the shed hints they call for.

    Args:
        config: the default watermark, the per-agent table, the shed target and interval.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.watermarks = config.watermarks()
        """Per agent: its cache watermark in bytes (others: ``memory_watermark_bytes``)."""
        self.sheds = 0
        """Shed hints given."""

    def set_watermark(self, agent: str, nbytes: int) -> None:
        """Set (or, with 0, clear) an agent's cache watermark."""
        if nbytes > 0:
            self.watermarks[agent] = int(nbytes)
        else:
            self.watermarks.pop(agent, None)

    def on_probe(self, agent: AgentState, now: float) -> Control | None:
        """Update ``agent``'s memory pressure from its last probe; the shed hint to send it, if one is due."""
        watermark = self.watermarks.get(agent.name, self.config.memory_watermark_bytes)
        if watermark <= 0:
            return None
        agent.memory_pressure = min(1.0, max(0.0, (agent.cache_bytes - watermark) / watermark))
        if agent.cache_bytes <= watermark or now - agent.last_shed < self.config.shed_interval_s:
            return None
        agent.last_shed = now
        target = int(watermark * self.config.shed_target)
        hint = Control(
            transfer_id="",
            action=ControlAction.SHED,
            nbytes=target,
            reason=f"cache {agent.cache_bytes} B is over its watermark {watermark} B",
        )
        self.sheds += 1
        return hint
