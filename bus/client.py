"""The bus client: one NATS connection shared by the agents of a process, their registry and directory."""

from __future__ import annotations

import collections
import dataclasses
import logging
import warnings
from collections.abc import Sequence
from enum import Enum
from typing import Any

from kvbus import telemetry
from kvbus.bus.agent import Agent
from kvbus.bus.cache import CacheTier
from kvbus.bus.config import BusConfig
from kvbus.bus.endpoint import AgentOptions
from kvbus.bus.errors import BusClosed
from kvbus.bus.pacing import EmulatedLink
from kvbus.bus.paths import DataPlane, DataTls, PathsConfig
from kvbus.bus.stages import SendSettings, chunk_cap
from kvbus.codecs import ModelRunner
from kvbus.errors import ConfigError, CoordinatorUnavailable
from kvbus.net.auth import NatsAuth
from kvbus.net.buckets import key_value
from kvbus.net.coordinator_client import CoordinatorClient
from kvbus.net.transport import NatsTransport, Transport
from kvbus.protocol import AGENTS_BUCKET, check_name
from kvbus.signature import ModelSignature

logger = logging.getLogger(__name__)


class Status(Enum):
    """Whether a `Bus` is connected or closed."""

    CONNECTED = "connected"
    CLOSED = "closed"


class Bus:
    """A connection to the kvbus NATS, shared by the agents of one process.

    Create with ``await Bus.connect(url)``; use as ``async with``.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        config: BusConfig | None = None,
        secure: bool = False,
        paths: PathsConfig | None = None,
        data_tls: DataTls | None = None,
    ) -> None:
        self.transport = transport
        self.config = config or BusConfig.from_env()
        self.secure = secure
        """Agents have no JetStream access (per-agent permissions): they register through their
        group scheduler instead of writing the directory themselves."""
        self.paths_config = paths or PathsConfig.from_env()
        """Which data paths this process's transfers may take (``KVBUS_PATHS_ALLOWED``)."""
        if secure and not self.paths_config.shm_private:
            # A same-host sender must not change bytes after the receiver verified them.
            self.paths_config = dataclasses.replace(self.paths_config, shm_private=True)
        self._data_tls = data_tls or self._deployment_tls(transport)
        self.plane: DataPlane | None = None
        """The data plane (listeners and connections of the direct paths), started with the first agent."""
        self.status = Status.CONNECTED
        self._agents: dict[str, Agent] = {}
        self._directory: Any = None
        self._completed: dict[str, collections.OrderedDict[str, float]] = {}

    def _deployment_tls(self, transport: Transport) -> DataTls | None:
        """The ``tcp`` path's TLS when none was given and the NATS connection uses TLS: the
        deployment's certificate files (``KVBUS_NATS_TLS_*``, as `NatsAuth.from_env` reads them).
        Without them, this bus leaves the ``tcp`` path out: a deployment that encrypts its control
        plane never sends its KV-caches in the clear on the data plane."""
        if not transport.uses_tls:
            return None
        tls = DataTls.from_auth(NatsAuth.from_env())
        if tls is None and "tcp" in self.paths_config.allowed_paths:
            logger.warning(
                "the NATS connection uses TLS but no data_tls was given and KVBUS_NATS_TLS_* name no "
                "certificates: the tcp data path is off for this bus (pass data_tls=DataTls(...) to use it)"
            )
            kept = ",".join(p for p in self.paths_config.allowed_paths if p != "tcp")
            if not kept:
                raise ConfigError(
                    "paths.allowed is tcp only, the NATS connection uses TLS and no certificate for the "
                    "tcp path was given (data_tls or KVBUS_NATS_TLS_CERT/KEY/CA)"
                )
            self.paths_config = dataclasses.replace(self.paths_config, allowed=kept)
        return tls

    def completed_ids(self, agent: str) -> collections.OrderedDict[str, float]:
        """The ids of transfers delivered to ``agent`` on this bus (kept across the agent closing
        and registering again, so a sender's repeated `Open` is never delivered twice)."""
        return self._completed.setdefault(agent, collections.OrderedDict())

    @classmethod
    async def connect(
        cls,
        url: str | Sequence[str] = "nats://127.0.0.1:4222",
        *,
        config: BusConfig | None = None,
        secure: bool = False,
        paths: PathsConfig | None = None,
        data_tls: DataTls | None = None,
        **nats_options: Any,
    ) -> Bus:
        """Connect to NATS at ``url`` (extra keyword arguments go to `nats.connect`).

        ``url`` may name several servers (a comma-separated string or a list: every server of
        a cluster); the bus connects to one and reconnects to a survivor when it dies.

        Args:
            secure: the server enforces per-agent permissions (`kvbus up --secure`,
                `kvbus.security`): pass the agent's ``user``/``password`` (or ``token``,
                ``nkeys_seed``, ``user_credentials``, ``tls``) and ``inbox_prefix=f"_INBOX.{agent}"``
                in ``nats_options`` (`kvbus.security.agent_connect_options` builds them), and use
                one bus per agent.
            paths: the data paths transfers may take (default: ``KVBUS_PATHS_*``, all of them).
            data_tls: TLS of the ``tcp`` data path (`DataTls.from_auth` of the deployment's
                `NatsAuth`). Without it, a NATS connection over TLS gives the ``tcp`` path the
                certificates of ``KVBUS_NATS_TLS_*``, or, when those name none, leaves it out
                (never plain TCP under a TLS deployment); over plain NATS the path is plain TCP.

        Raises:
            ConfigError: the data paths cannot be configured (e.g. only ``tcp`` allowed under a
                TLS deployment without certificates for it).

        The first connect of a process also configures OpenTelemetry from the standard
        variables (`kvbus.telemetry.setup`): traces when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
        ``OTEL_TRACES_EXPORTER``) is set, a Prometheus endpoint when ``KVBUS_METRICS_PORT`` is;
        tracer and meter providers the application installed before are kept.
        """
        telemetry.setup()
        transport = await NatsTransport.connect(url, **nats_options)
        try:
            return cls(transport, config=config, secure=secure, paths=paths, data_tls=data_tls)
        except BaseException:
            await transport.close()
            raise

    async def data_plane(self) -> DataPlane:
        """The process's data plane for this bus (its listeners are started on first use).

        Raises:
            ConfigError: the paths configuration is invalid.
            OSError: a listener cannot bind (e.g. a fixed ``tcp_port`` in use).
        """
        if self.plane is None:
            plane = DataPlane(self.transport, config=self.paths_config, tls=self._data_tls)
            try:
                await plane.start()
            except OSError as exc:
                if not self.paths_config.tcp_port:
                    raise
                # Another bus of this process holds the fixed port: this one listens on any port.
                logger.warning("data port %d: %s; listening on a free port", self.paths_config.tcp_port, exc)
                await plane.close()
                config = dataclasses.replace(self.paths_config, tcp_port=0)
                plane = DataPlane(self.transport, config=config, tls=self._data_tls)
                await plane.start()
            self.plane = plane
            logger.info("data paths: %s", ",".join(p.kind.value for p in plane.paths))
        return self.plane

    @property
    def chunk_size(self) -> int:
        """The configured chunk size, capped so that payload + headers fit the server's max_payload."""
        return chunk_cap(self.config, self.transport.max_payload)

    async def directory(self) -> Any:
        """The JetStream KV bucket of agent records (created on first use)."""
        if self._directory is None:
            js = self.transport.jetstream()
            if js is None or self.secure:
                return None
            self._directory = await key_value(js, AGENTS_BUCKET)
        return self._directory

    async def agent(
        self,
        name: str,
        *,
        group: str | None = "default",
        role: str = "agent",
        priority: float = 1.0,
        signature: ModelSignature | None = None,
        runner: ModelRunner | None = None,
        cache: CacheTier | None = None,
        link: EmulatedLink | None = None,
    ) -> Agent:
        """Register an agent on this bus and start its inbox.

        Args:
            name: unique agent name (letters, digits, ``-``, ``_``).
            group: the group whose scheduler grants its transfers; None asks the coordinator to
                place it (raises `CoordinatorUnavailable` when none answers or no group is live).
            role: free-form role (``coordinator``, ``executor``, ``verifier`` ...).
            priority: role priority used in scheduling weights.
            signature: the model signature KV sent to this agent must match; taken from
                ``runner`` when not given; None accepts only token-only contexts as-is.
            runner: the agent's model, used to recompute KV for media that carry none.
            cache: the agent's cache tier (`kvbus.cachetier`), if it has one: its memory use
                is reported in probes and `Agent.prefetch` goes to it.
            link: an emulated link (bandwidth, latency) for tests and benchmarks: declared to the
                schedulers, which pace this agent's transfers to it. Real deployments leave it
                None and the schedulers measure the real links.
        """
        if self.status is Status.CLOSED:
            raise BusClosed()
        check_name("agent", name)
        await self.data_plane()
        if group is None:
            group = await self._place(name)
        check_name("group", group)
        if name in self._agents:
            raise ValueError(f"agent {name!r} is already registered on this bus")
        if signature is None and runner is not None:
            signature = runner.signature
        options = AgentOptions(
            name=name,
            group=group,
            role=role,
            priority=priority,
            signature=signature,
            runner=runner,
            cache=cache,
            link=link,
        )
        agent = Agent(
            options,
            transport=self.transport,
            config=self.config,
            settings=SendSettings(
                secure=self.secure, direct_chunk_size=self.paths_config.direct_chunk_size, plane=self.plane
            ),
            directory=self.directory,
            completed=self.completed_ids(name),
            forget=self._forget,
        )
        await agent._start()
        self._agents[name] = agent
        return agent

    def _forget(self, name: str) -> None:
        """Let go of a closed agent (its name may register again)."""
        self._agents.pop(name, None)

    async def _place(self, name: str) -> str:
        reply = await CoordinatorClient(self.transport).place(name)
        if not reply.group:
            raise CoordinatorUnavailable(f"placement of {name}: {reply.reason}")
        return reply.group

    async def close(self) -> None:
        """Close every agent of this bus, then the connection."""
        if self.status is Status.CLOSED:
            return
        self.status = Status.CLOSED
        for agent in list(self._agents.values()):
            await agent.close()
        plane, self.plane = self.plane, None
        if plane is not None:
            await plane.close()
        await self.transport.close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __del__(self) -> None:
        if getattr(self, "status", Status.CLOSED) is not Status.CLOSED:
            warnings.warn("kvbus Bus was not closed", ResourceWarning, stacklevel=1)


__all__ = ["Bus", "Status"]
