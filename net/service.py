"""The replicated-service base: a leader-elected replica that serves while it leads.

The group scheduler and the coordinator both run as replicas: each campaigns for a lease in a
JetStream KV bucket (`kvbus.net.leader.LeaderLease`); the holder subscribes to the service's
subjects and serves, the others stand by warm (a subclass keeps whatever state it learns
without serving: the scheduler's probes, for one) and take over when the lease goes stale. On
close a replica stops serving before it gives the lease up, so two never serve at once, and
every step of closing is bounded: closing never hangs on a peer or on the server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Awaitable
from typing import Any, NamedTuple, Self

from kvbus.net.leader import LeaderLease
from kvbus.net.transport import Handler, Transport

logger = logging.getLogger(__name__)

__all__ = ["Endpoint", "ReplicatedService", "bounded", "replica_name"]

#: How long one step of closing may take before it is given up.
CLOSE_STEP_S = 5.0


class Endpoint(NamedTuple):
    """A subject the service answers while it leads, its handler and its queue group ("" for none)."""

    subject: str
    handler: Handler
    queue: str = ""


def replica_name(service: str) -> str:
    """A name unique per replica (``<service>@<host>:<pid>:<random>``): the lease tells holders apart by it."""
    return f"{service}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


async def bounded(aw: Awaitable[Any], what: str, timeout: float = CLOSE_STEP_S) -> None:
    """Await ``aw`` for at most ``timeout`` seconds while closing; log and go on otherwise."""
    try:
        await asyncio.wait_for(aw, timeout)
    except asyncio.CancelledError:
        pass
    except TimeoutError:
        # said at INFO: a close that waits out its bounds is what makes a shutdown slow
        logger.info("closing: could not %s within %.0f s; going on", what, timeout)
    except Exception:
        logger.debug("closing: could not %s", what, exc_info=True)


class ReplicatedService:
    """One replica of a leader-elected service.

    A subclass names what it serves (`endpoints`) and may hook `prepare_to_serve` (restore
    state before the first request), `now_serving`, `closing` (first thing in `close`, while it
    may still serve) and `closed_down` (after the lease is given up). It calls `campaign` from
    its ``start``.

    Args:
        transport: the NATS seam.
        name: this replica's unique name (`replica_name`).
    """

    def __init__(self, transport: Transport, name: str) -> None:
        self.transport = transport
        self.name = name
        self.closed = False
        """`close` has begun: the replica does not serve again."""
        self._subs: list[Any] = []
        self._leader: LeaderLease | None = None

    # -- what a subclass says ----------------------------------------------------------------------

    def endpoints(self) -> list[Endpoint]:
        """The subjects answered while leading."""
        return []

    async def prepare_to_serve(self) -> None:
        """Called on election, before the subscriptions (restore durable state here)."""

    async def now_serving(self) -> None:
        """Called once the subscriptions are in place and flushed."""

    async def closing(self) -> None:
        """Called first in `close`, while the replica may still serve."""

    async def closed_down(self) -> None:
        """Called in `close` once it stopped serving and gave the lease up, before the transport closes."""

    # -- leadership ----------------------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        """Whether this replica answers the service's requests (the leader, or the only one)."""
        return bool(self._subs)

    @property
    def leader(self) -> LeaderLease | None:
        """The lease this replica campaigns for (None when it serves without an election)."""
        return self._leader

    async def campaign(self, bucket: Any | None, key: str, *, ttl: float, try_now: bool = True) -> None:
        """Serve at once without ``bucket``; else campaign for lease ``key`` in it and serve while it is held.

        With ``try_now`` the first attempt happens here (a lone replica serves when this returns);
        otherwise the renewal loop makes it.
        """
        if bucket is None:
            await self._serve()
            return
        self._leader = LeaderLease(bucket, key, self.name, ttl=ttl, on_elected=self._serve, on_lost=self._stop_serving)
        if try_now:
            if await self._leader.try_acquire():
                self._leader.is_leader = True
                await self._serve()
            else:
                logger.info("%s is a standby", self.name)
        self._leader.start()

    async def _serve(self) -> None:
        if self._subs or self.closed:
            return
        await self.prepare_to_serve()
        t = self.transport
        subs = []
        for ep in self.endpoints():
            subs.append(await t.subscribe(ep.subject, ep.handler, queue=ep.queue))
        self._subs = subs
        await t.flush()
        await self.now_serving()

    async def _stop_serving(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            await bounded(sub.unsubscribe(), "unsubscribe")

    # -- lifecycle -----------------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop serving, give the lease up, close the transport; every step bounded."""
        if self.closed:
            return
        self.closed = True
        await self.closing()
        await self._stop_serving()
        if self._leader is not None:
            await bounded(self._leader.release(), "release the leader lease")
        await self.closed_down()
        await self.transport.close()  # `NatsTransport.close` bounds its drain and close itself

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def run_forever(self) -> None:
        """Run until cancelled (Ctrl-C in the CLI), then close."""
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()
