"""Talking to engines' connectors from outside vLLM: build their config, push contexts, watch events.

`connector_config` builds the ``kv_transfer_config`` dict for an engine. `AsyncControl` (asyncio)
and `KVBusControl` (synchronous, for scripts) ask an engine's agent to push a context it holds to
other agents, ask what it holds, and collect the connectors' events.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from kvbus.errors import WireFormatError
from kvbus.integrations.vllm.keys import as_ids, salt_scope
from kvbus.integrations.vllm.loop import LoopThread
from kvbus.integrations.vllm.protocol import (
    Event,
    HaveReply,
    HaveRequest,
    PushReply,
    PushRequest,
    events_subject,
    subject,
)

#: Seconds a push may take before the control gives up waiting (the transfer may still finish).
PUSH_TIMEOUT_S = 120.0


def connector_config(
    agent: str,
    *,
    nats_url: str,
    group: str = "default",
    kv_role: str = "kv_both",
    failure_policy: str = "recompute",
    **extra: Any,
) -> dict[str, Any]:
    """The ``kv_transfer_config`` of an engine whose connector is kvbus agent ``agent``.

    ``kv_role`` and ``failure_policy`` are vLLM's (``kv_role``, ``kv_load_failure_policy``);
    ``extra`` goes into ``kv_connector_extra_config`` (see `ConnectorConfig`; ``role`` there is
    the agent's kvbus role).
    """
    return {
        "kv_connector": "KVBusConnector",
        "kv_connector_module_path": "kvbus.integrations.vllm",
        "kv_role": kv_role,
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": {"nats_url": nats_url, "agent": agent, "group": group, **extra},
    }


class AsyncControl:
    """Control messages to engines' agents over a NATS connection (create with `connect`)."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.events: collections.deque[Event] = collections.deque(maxlen=10_000)
        self._subs: list[Any] = []

    @classmethod
    async def connect(cls, nats_url: str, **role_options: Any) -> AsyncControl:
        """Connect to ``nats_url`` with the ``KVBUS_NATS_*`` identity and TLS of the environment,
        or under ``role_options`` (in secure mode an agent's, ``creds.agent_options(agent)``:
        the control may then push that agent's contexts and ask any agent what it holds, but not
        watch events, which only the agents' own users publish)."""
        from kvbus.net.auth import NatsAuth
        from kvbus.net.transport import NatsTransport

        return cls(await NatsTransport.connect(nats_url, **NatsAuth.from_env().connect_options(role_options or None)))

    async def push(
        self,
        src: str,
        to: str | list[str],
        tokens: Any,
        *,
        medium: str | None = None,
        cache_salt: str | None = None,
        timeout: float = PUSH_TIMEOUT_S,
    ) -> PushReply:
        """Ask agent ``src`` to send the context it holds for ``tokens`` to ``to``; returns once the
        receivers verified the transfer (each stores it from its inbox moments later). A context
        computed for requests with a ``cache_salt`` is found, and kept by the receivers, only
        with that salt."""
        receivers = [to] if isinstance(to, str) else list(to)
        msg = PushRequest(to=receivers, tokens=as_ids(tokens)[0].tolist(), medium=medium, salt=salt_scope(cache_salt))
        return PushReply.decode(await self.transport.request(subject(src, "push"), msg.encode(), timeout))

    async def have(self, agent: str, tokens: Any, *, cache_salt: str | None = None, timeout: float = 5.0) -> int:
        """How many leading tokens of ``tokens`` agent ``agent`` holds (for requests of ``cache_salt``)."""
        msg = HaveRequest(tokens=as_ids(tokens)[0].tolist(), salt=salt_scope(cache_salt))
        return HaveReply.decode(await self.transport.request(subject(agent, "have"), msg.encode(), timeout)).tokens

    async def watch(self, agent: str = "*") -> None:
        """Collect the events of ``agent`` (``*``: all agents) into `events` from now on."""

        async def on_event(msg: Any) -> None:
            try:
                self.events.append(Event.decode(msg.data))
            except WireFormatError:
                pass

        self._subs.append(await self.transport.subscribe(events_subject(agent), on_event))
        await self.transport.flush()

    async def wait_event(self, predicate: Any, *, timeout: float = 30.0, since: int = 0) -> Event:
        """The first event collected (after the first ``since``) for which ``predicate(event)`` is true."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            for ev in list(self.events)[since:]:
                if predicate(ev):
                    return ev
            if loop.time() > deadline:
                raise TimeoutError(f"no matching connector event within {timeout} s")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        """Stop every `watch` subscription (best effort) and close the NATS connection."""
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        await self.transport.close()


class KVBusControl:
    """`AsyncControl` for synchronous code: its own event loop in a background thread."""

    def __init__(self, nats_url: str, **role_options: Any) -> None:
        self._loop = LoopThread(name="kvbus-control")
        self._control = self._loop.run(AsyncControl.connect(nats_url, **role_options), timeout=30.0)

    @property
    def events(self) -> list[Event]:
        """A copy of the events collected so far (oldest first, the last 10,000 at most)."""
        return list(self._control.events)

    def push(
        self,
        src: str,
        to: str | list[str],
        tokens: Any,
        *,
        medium: str | None = None,
        cache_salt: str | None = None,
        timeout: float = PUSH_TIMEOUT_S,
    ) -> PushReply:
        """See `AsyncControl.push`."""
        coro = self._control.push(src, to, tokens, medium=medium, cache_salt=cache_salt, timeout=timeout)
        return self._loop.run(coro, timeout + 5)

    def have(self, agent: str, tokens: Any, *, cache_salt: str | None = None, timeout: float = 5.0) -> int:
        """See `AsyncControl.have`."""
        return self._loop.run(self._control.have(agent, tokens, cache_salt=cache_salt, timeout=timeout), timeout + 5)

    def watch(self, agent: str = "*") -> None:
        """See `AsyncControl.watch`."""
        self._loop.run(self._control.watch(agent), 10.0)

    def wait_event(self, predicate: Any, *, timeout: float = 30.0, since: int = 0) -> Event:
        """See `AsyncControl.wait_event`."""
        return self._loop.run(self._control.wait_event(predicate, timeout=timeout, since=since), timeout + 5)

    def close(self) -> None:
        """Close the control's connection, then stop its event-loop thread."""
        try:
            self._loop.run(self._control.close(), 10.0)
        finally:
            self._loop.stop()

    def __enter__(self) -> KVBusControl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
