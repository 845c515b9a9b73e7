"""The coordinator, first cut: group membership from scheduler heartbeats, kept in JetStream KV.

The coordinator issue adds inter-group bandwidth leases, the reservation table and agent
placement; this part already gives every deployment one place that knows which groups are
alive, and keeps it in a JetStream KV bucket so a restarted coordinator starts from it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from nats.aio.msg import Msg
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NoKeysError

from kvbus.bus.transport import NatsTransport, Transport
from kvbus.errors import WireFormatError
from kvbus.protocol import COORD_GROUPS, COORD_REGISTER, GROUPS_BUCKET, GroupHeartbeat, packb

logger = logging.getLogger(__name__)

#: A group whose scheduler has not been heard from for this long is considered gone.
GROUP_TTL_S = 10.0


class Coordinator:
    """Tracks the live groups of a deployment."""

    def __init__(self, transport: Transport, *, group_ttl: float = GROUP_TTL_S) -> None:
        self.transport = transport
        self.group_ttl = group_ttl
        self.groups: dict[str, GroupHeartbeat] = {}
        self._bucket: Any = None
        self._subs: list[Any] = []
        self.closed = False

    @classmethod
    async def connect(cls, url: str, **kwargs: Any) -> Coordinator:
        coord = cls(await NatsTransport.connect(url, name="kvbus-coordinator"), **kwargs)
        await coord.start()
        return coord

    async def start(self) -> None:
        nc = getattr(self.transport, "nc", None)
        if nc is not None:
            js = nc.jetstream()
            try:
                self._bucket = await js.key_value(GROUPS_BUCKET)
            except BucketNotFoundError:
                self._bucket = await js.create_key_value(bucket=GROUPS_BUCKET, history=1)
            await self._restore()
        self._subs = [
            await self.transport.subscribe(COORD_REGISTER, self._on_heartbeat),
            await self.transport.subscribe(COORD_GROUPS, self._on_groups, queue="kvbus-coordinator"),
        ]
        await self.transport.flush()

    async def _restore(self) -> None:
        try:
            keys = await self._bucket.keys()
        except NoKeysError:
            return
        for key in keys:
            try:
                entry = await self._bucket.get(key)
                self.groups[key] = GroupHeartbeat.decode(entry.value)
            except (KeyNotFoundError, WireFormatError):
                continue
        logger.info("coordinator restored %d group(s) from JetStream", len(self.groups))

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = GroupHeartbeat.decode(msg.data)
        except WireFormatError:
            logger.warning("malformed group heartbeat dropped")
            return
        is_new = hb.group not in self.groups
        self.groups[hb.group] = hb
        if is_new:
            logger.info("group %s joined (scheduler %s)", hb.group, hb.scheduler)
        if self._bucket is not None:
            await self._bucket.put(hb.group, hb.encode())

    def live_groups(self) -> dict[str, GroupHeartbeat]:
        now = time.time()
        return {g: hb for g, hb in self.groups.items() if now - hb.ts <= self.group_ttl}

    async def _on_groups(self, msg: Msg) -> None:
        body = {g: {"scheduler": hb.scheduler, "agents": hb.agents, "age_s": round(time.time() - hb.ts, 3)}
                for g, hb in self.live_groups().items()}
        await self.transport.reply(msg, packb(body))

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001
                logger.debug("unsubscribe failed", exc_info=True)
        close = getattr(self.transport, "close", None)
        if close is not None:
            await close()

    async def run_forever(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()
