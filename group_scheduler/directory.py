"""The agent directory as a group scheduler sees it: a cache of the JetStream KV bucket
``kvbus_agents`` that a watch keeps current, and receiver lookups.

A request is answered without a directory round trip: the request handler runs one message at a
time, so a lookup per request on the wire would cap a large group's throughput at one round trip
per lookup. What a record says also goes into the group's state: which agents are in other groups
(transfers to them are inter-group), role priorities, and the declared links of agents that do not
probe this group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from nats.js.errors import KeyNotFoundError

from kvbus.errors import WireFormatError
from kvbus.group_scheduler.config import SchedulerConfig
from kvbus.group_scheduler.state import GroupState
from kvbus.net.buckets import transport_bucket
from kvbus.net.transport import Transport
from kvbus.protocol import AGENTS_BUCKET, AgentRecord

logger = logging.getLogger(__name__)

#: After the watch stops (the server restarted, the bucket went away), start it again this much later.
REWATCH_S = 1.0


class Directory:
    """Agent records for one group scheduler.

    Args:
        transport: the NATS seam (a transport without a NATS connection has no directory).
        state: the group's S(t), which learns from every record.
        config: the cache TTLs (``directory_ttl``, ``directory_watch_ttl``).
    """

    def __init__(self, transport: Transport, state: GroupState, config: SchedulerConfig) -> None:
        self.transport = transport
        self.state = state
        self.group = state.group
        self.config = config
        self.cache: dict[str, tuple[float, AgentRecord | None]] = {}
        """Per agent: (monotonic time it was learnt, its record or None if it has none)."""
        self.live = False
        """The watch has delivered the bucket's current values and keeps the cache current."""
        self.stopped = False
        """Set when the scheduler closes: the watch is not started again."""
        self._bucket: Any = None

    async def bucket(self) -> Any:
        """The directory bucket (created on first use), or None for a transport without NATS."""
        if self._bucket is None:
            self._bucket = await transport_bucket(self.transport, AGENTS_BUCKET)
        return self._bucket

    async def watch(self) -> None:
        """Keep the cache current from a JetStream watch of the bucket, until stopped or cancelled."""
        while not self.stopped:
            try:
                bucket = await self.bucket()
                if bucket is None:
                    return  # not on NATS (a test transport): lookups only
                watcher = await bucket.watchall()
                async for entry in watcher:
                    if entry is None:  # the bucket's current values are in
                        self.live = True
                        continue
                    try:
                        record = AgentRecord.decode(entry.value) if entry.value and not entry.operation else None
                    except WireFormatError:
                        logger.warning("directory entry of %s is malformed", entry.key)
                        record = None
                    self.remember(entry.key, record, time.monotonic())
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.debug("group %s: directory watch stopped; restarting", self.group, exc_info=True)
            finally:
                self.live = False
            await asyncio.sleep(REWATCH_S)

    def cached(self, agent: str) -> AgentRecord | None:
        """An agent's record from the cache, when the cache may be trusted for it (kept current by
        the watch, or looked up within ``directory_ttl``); None otherwise (then ask `lookup_many`)."""
        hit = self.cache.get(agent)
        ttl = self.config.directory_watch_ttl if self.live else self.config.directory_ttl
        if hit is not None and hit[1] is not None and time.monotonic() - hit[0] < ttl:
            return hit[1]
        return None

    async def lookup(self, agent: str) -> AgentRecord | None:
        """An agent's record: from the cache the watch keeps current, else a lookup cached for
        ``directory_ttl``; None when it has none."""
        record = self.cached(agent)
        if record is not None:
            return record
        return (await self.lookup_many([agent])).get(agent)

    async def lookup_many(self, agents: Sequence[str]) -> dict[str, AgentRecord | None]:
        """The records of ``agents`` from the bucket, looked up together (one round trip of latency,
        however many), and remembered; None for an agent that has none."""
        bucket = await self.bucket()
        if bucket is None:
            return dict.fromkeys(agents)
        names = list(dict.fromkeys(agents))
        now = time.monotonic()
        records = await asyncio.gather(*(self._get(bucket, name) for name in names))
        return {name: self.remember(name, record, now) for name, record in zip(names, records)}

    @staticmethod
    async def _get(bucket: Any, agent: str) -> AgentRecord | None:
        try:
            entry = await bucket.get(agent)
            return AgentRecord.decode(entry.value) if entry.value else None
        except KeyNotFoundError:
            return None
        except WireFormatError:
            logger.warning("directory entry of %s is malformed", agent)
            return None

    def remember(self, agent: str, record: AgentRecord | None, now: float) -> AgentRecord | None:
        """Cache ``agent``'s record and what the group state learns from it."""
        self.cache[agent] = (now, record)
        left = self.state.left.get(agent)
        if record is not None and left is not None and record.ts > left:
            self.state.returned(agent)  # registered again after it left: a new incarnation
        if record is not None and record.group != self.group:
            self.state.remote[agent] = record.group
        else:
            self.state.remote.pop(agent, None)
        if record is not None:
            self.state.priorities[agent] = record.priority
            if agent not in self.state.agents:
                # Agents of this group declare their links in probes; others only in the directory.
                self.state.declare(agent, record.link_bps, record.latency_s)
        return record

    async def write(self, record: AgentRecord) -> None:
        """Write an agent's record for it (an agent without JetStream rights, in secure mode)."""
        bucket = await self.bucket()
        if bucket is not None:
            await bucket.put(record.name, record.encode())
        self.cache.pop(record.name, None)
