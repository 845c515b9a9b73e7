"""One agent on the bus: the facade over its sender, receiver, inbox, scheduler link and probes."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import torch

from kvbus.bus.config import BusConfig
from kvbus.bus.endpoint import AgentOptions, Endpoint
from kvbus.bus.inbox import Inbox
from kvbus.bus.kvbuffer import kv_buffer
from kvbus.bus.pacing import EmulatedLink
from kvbus.bus.probes import Probes
from kvbus.bus.receiver import Receiver, ReceiveSettings
from kvbus.bus.scheduling import SchedulerLink
from kvbus.bus.sender import Sender
from kvbus.bus.stages import SendSettings
from kvbus.bus.types import Delivery, TransferReport
from kvbus.kvcache import KVCache
from kvbus.net.transport import Transport
from kvbus.protocol import (
    MAX_IDEMPOTENCY_KEY,
    MAX_LABEL,
    AgentLeave,
    Probe,
    ack_subject,
    agent_subject,
    inbox_subject,
    sched_subject,
)
from kvbus.signature import ModelSignature

logger = logging.getLogger(__name__)


class Agent(Endpoint):
    """One agent on the bus: sends contexts, receives them in its inbox, reports its state.

    Made by `Bus.agent`. The work is done by its parts, each of which sees the agent as an
    `Endpoint`: `Sender` (grant, encode, stream), `Receiver` (Open, reassembly, decode),
    `Inbox`, `SchedulerLink` (grants, controls, reservations, registration) and `Probes`.
    """

    def __init__(
        self,
        options: AgentOptions,
        *,
        transport: Transport,
        config: BusConfig,
        settings: SendSettings,
        directory: Callable[[], Awaitable[Any]],
        completed: collections.OrderedDict[str, float],
        forget: Callable[[str], None],
    ) -> None:
        """Made by `Bus.agent`, which hands it what its parts need from the bus.

        Args:
            options: who the agent is and what it brings.
            transport: the bus's NATS connection.
            config: the bus's settings.
            settings: what the send stages need (secure mode, direct chunk size, data plane).
            directory: opens the JetStream KV bucket of agent records (`Bus.directory`).
            completed: the ids of transfers delivered to this agent's name on the bus.
            forget: called with the agent's name when it closes (the bus lets go of it).
        """
        super().__init__(options, transport, config)
        self._forget = forget
        self._scheduler = SchedulerLink(
            self, secure=settings.secure, directory=directory, host=settings.plane.host if settings.plane else ""
        )
        self._sender = Sender(self, self._scheduler, settings)
        self._inbox = Inbox()
        receiving = ReceiveSettings(secure=settings.secure, plane=settings.plane, server=transport)
        self._receiver = Receiver(self, self._inbox, receiving, completed)
        self._probes = Probes(self, lambda: self._scheduler.queue_size)
        self._subs: list[Any] = []
        self._tasks: list[asyncio.Task[None]] = []
        """The probe loop, then the janitor of partial transfers."""

    # -- lifecycle --------------------------------------------------------------------------

    async def _start(self) -> None:
        t = self.transport
        self._subs = [
            await t.subscribe(inbox_subject(self.name, "*"), self._receiver.on_open),
            await t.subscribe(ack_subject(self.name, "*"), self._sender.on_ack),
            await t.subscribe(agent_subject(self.name, "ctl"), self._scheduler.on_ctl),
        ]
        await t.flush()
        await self._scheduler.register()
        self._tasks.append(asyncio.create_task(self._probes.loop(), name=f"kvbus-probe-{self.name}"))
        self._tasks.append(asyncio.create_task(self._receiver.janitor(), name=f"kvbus-janitor-{self.name}"))

    async def set_link(self, link: EmulatedLink | None) -> None:
        """Change the emulated link (e.g. to replay a bandwidth trace); schedulers see it within a second or two."""
        self.link = link
        await self._scheduler.register()
        await self._probes.publish()

    async def close(self) -> None:
        """Leave the bus: tell the scheduler (`AgentLeave`, bounded by ``request_timeout``), stop the
        inbox and the probes, fail pending sends."""
        if self.closed:
            return
        self.closed = True
        await self._say_leave()
        for task in self._tasks:
            task.cancel()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:
                logger.debug("unsubscribe failed", exc_info=True)
        await self._receiver.stop()
        await self._scheduler.close()
        self._forget(self.name)

    async def _say_leave(self) -> None:
        """Publish `AgentLeave` on this agent's own leave subject, and flush it within a bounded time.

        Best effort: a scheduler that misses it marks the agent down when its probes expire.
        """
        leave = AgentLeave(agent=self.name, group=self.group, reason="closed")
        try:
            await asyncio.wait_for(
                self._leave(sched_subject(self.group, "leave", self.name), leave.encode()),
                timeout=min(self.config.request_timeout, 2.0),
            )
        except Exception:  # closing goes on whatever the connection does
            logger.debug("agent %s: could not say it leaves", self.name, exc_info=True)

    async def _leave(self, subject: str, payload: bytes) -> None:
        await self.transport.publish(subject, payload)
        await self.transport.flush()

    async def __aenter__(self) -> Agent:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- sending ------------------------------------------------------------------------------

    def kv_buffer(self, n_tokens: int, *, batch: int = 1, signature: ModelSignature | None = None) -> KVCache:
        """An empty cache of ``n_tokens`` tokens to build a context in, in memory the bus shares:
        sent with ``full`` to an agent of this host, it moves no byte (`kvbus.bus.kvbuffer`).

        Fill its ``tokens``, ``keys[i]`` and ``values[i]`` in place, then `send` it. Its first
        send freezes it: later writes through its tensors change this process's copy only.

        Args:
            signature: the model whose KV it holds (default: this agent's).

        Raises:
            ValueError: no signature (a token-only agent), or ``n_tokens`` or ``batch`` not positive.
            OSError: no memory for it.
        """
        signature = signature or self.signature
        if signature is None:
            raise ValueError(f"agent {self.name!r} has no model signature: pass the one the KV is for")
        return kv_buffer(signature, n_tokens, batch=batch)

    async def send(
        self,
        to: str,
        kv: KVCache,
        *,
        medium: str | None = None,
        deadline: float | None = None,
        critical: bool = False,
        idempotency_key: str | None = None,
        label: str = "",
    ) -> TransferReport:
        """Send a context to agent ``to`` and wait until it arrived whole and verified.

        Args:
            to: the receiving agent.
            kv: the context.
            medium: insist on a medium (e.g. ``"int8"``); None lets the scheduler choose.
            deadline: seconds from now by which the transfer should be done (raises urgency;
                also bounds the wait for a grant).
            critical: mark as critical traffic.
            idempotency_key: the caller's name for this send (1 to `MAX_IDEMPOTENCY_KEY`
                characters). Sent again with the same key after a `TransferInDoubt`, it is
                answered with the first one's verdict by a receiver that delivered it (the
                receiver's bus remembers the keys of its last deliveries while it runs).
            label: the caller's word on what the context is (at most `MAX_LABEL` characters,
                e.g. a tenant's scope), handed to the receiver as `Delivery.label`; the bus
                gives it no meaning.

        Raises:
            UnknownCodec: ``medium`` is not a registered codec (a `ValueError`).
            SignatureMismatch: ``kv`` does not fit its own model signature.
            ValueError: ``idempotency_key`` is empty or too long, or ``label`` is too long.
            TransferInDoubt: the transfer failed after its bytes may have arrived (the receiver
                may have it); ``cause`` says how it failed.
            TransferError: the transfer failed and nothing was delivered; the subclass says why
                (a `TransferRejected` has the `Reason` in ``code``).
        """
        if idempotency_key is not None and not 1 <= len(idempotency_key) <= MAX_IDEMPOTENCY_KEY:
            raise ValueError(f"idempotency_key must be 1 to {MAX_IDEMPOTENCY_KEY} characters")
        _check_label(label)
        return await self._sender.send(
            [to],
            kv,
            medium=medium,
            deadline=deadline,
            critical=critical,
            idempotency_key=idempotency_key or "",
            label=label,
        )

    async def broadcast(
        self,
        to: Iterable[str],
        kv: KVCache,
        *,
        medium: str | None = None,
        deadline: float | None = None,
        critical: bool = False,
        label: str = "",
    ) -> TransferReport:
        """Send one context to several agents; its bytes leave this agent once and NATS fans them out.

        ``label`` is as for `send`.

        Raises:
            TransferError: at least one receiver did not get it; ``failed`` maps those to their errors.
        """
        receivers = list(dict.fromkeys(to))
        if not receivers:
            raise ValueError("broadcast needs at least one receiver")
        _check_label(label)
        return await self._sender.send(receivers, kv, medium=medium, deadline=deadline, critical=critical, label=label)

    async def reserve(self, to: str | Iterable[str], *, period: float, size: int, deadline: float) -> str:
        """Reserve bandwidth for a periodic critical flow from this agent: ``size`` bytes every
        ``period`` seconds, each due ``deadline`` seconds after its period starts.

        Critical sends (``critical=True``) to exactly ``to`` then use the bandwidth set aside.

        Returns:
            The reservation id (for `unreserve`).

        Raises:
            ReservationRefused: admission control said no; ``reason`` says why.
            SchedulerUnavailable: no scheduler answers for this agent's group.
        """
        return await self._scheduler.reserve(to, period=period, size=size, deadline=deadline)

    async def unreserve(self, reservation_id: str) -> None:
        """Release a reservation made with `reserve`."""
        await self._scheduler.unreserve(reservation_id)

    # -- receiving ------------------------------------------------------------------------------

    async def receive(self, timeout: float | None = None) -> Delivery:
        """The next delivery in the inbox.

        Raises:
            ReceiveTimeout: nothing arrived within ``timeout`` seconds.
        """
        return await self._inbox.receive(timeout)

    async def inbox(self) -> AsyncIterator[Delivery]:
        """Deliveries as they arrive, until the agent closes."""
        while not self.closed:
            yield await self.receive()

    async def gather(self, from_: Iterable[str], *, timeout: float | None = None) -> dict[str, Delivery]:
        """Wait for one delivery from each of ``from_``; others stay in the inbox for `receive`.

        Raises:
            ReceiveTimeout: not all arrived within ``timeout`` seconds.
        """
        return await self._inbox.gather(from_, timeout=timeout)

    @property
    def partial_transfers(self) -> int:
        """Incoming transfers still being reassembled."""
        return self._receiver.partial_transfers

    # -- memory and probes --------------------------------------------------------------------

    @property
    def cache_bytes(self) -> int:
        """KV bytes this agent holds: its cache tier's resident bytes, or what the owner set."""
        return self._probes.cache_bytes

    @cache_bytes.setter
    def cache_bytes(self, value: int) -> None:
        self._probes.cache_bytes = value

    def prefetch(self, context: KVCache | torch.Tensor) -> asyncio.Task[int] | None:
        """Workflow hint: ``context`` (token ids or a `KVCache`) will be needed soon.

        With a cache tier, its remote blocks start loading in the background; returns the tier's
        handle (an awaitable task; its result is the number of blocks loaded) or None without a tier.
        """
        if self.cache is None:
            return None
        return self.cache.prefetch(context)

    def compute_load(self) -> float:
        """This process's CPU use since the last probe, as a fraction of the machine's cores."""
        return self._probes.compute_load()

    def probe(self) -> Probe:
        """The agent's state as its next probe reports it."""
        return self._probes.probe()


def _check_label(label: str) -> None:
    if not isinstance(label, str) or len(label) > MAX_LABEL:
        raise ValueError(f"label must be a string of at most {MAX_LABEL} characters")
