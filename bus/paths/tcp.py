"""The ``tcp`` path: a direct connection between two agents' processes.

One long-lived connection per pair of processes (sender to the receiver's data listener) carries
every transfer between them as a stream, bound by the transfer's one-time token. The sender
writes the frame header and the chunk's pieces (views of tensor storage) with one ``sendmsg``
(plain TCP) or through TLS (each piece encrypted in place, nothing joined); the receiver reads
each chunk straight into the transfer's final buffer (`kvbus.bus.paths.tcp_server`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time

from kvbus.bus.paths.base import OpenRequest
from kvbus.bus.paths.config import DataTls, PathsConfig
from kvbus.bus.paths.direct import Channel, DirectPath, DirectSendSession, SocketChannel, StreamChannel
from kvbus.bus.paths.errors import PathUnavailable
from kvbus.bus.paths.frames import FrameType, pack
from kvbus.bus.paths.registry import Expectations
from kvbus.bus.paths.tcp_server import TcpListener
from kvbus.errors import ConfigError
from kvbus.protocol import PathName, PathOffer

logger = logging.getLogger(__name__)

_ANY = ("", "0.0.0.0", "::")
LOOPBACK = "127.0.0.1"
#: Seconds an endpoint that could not be connected to is not tried again (each try may cost
#: ``connect_timeout_s`` before the transfer goes on NATS).
FAILED_ENDPOINT_S = 30.0
#: Wire bytes per payload byte of a full 1500-byte frame: Ethernet 14, IP 20, TCP 20 with
#: timestamps 12 around 1448 bytes of payload (1514 / 1448 = 1.046). The kernel paces a
#: connection at its transfers' granted payload rates times this (`TxConnection`).
WIRE_OVERHEAD = 1.05


class TcpSendSession(DirectSendSession):
    """One transfer's stream on a ``tcp`` connection."""

    kind = PathName.TCP

    async def _send(self, index: int, pieces: list[memoryview], digest: int, root: str) -> None:
        header = pack(FrameType.DATA, self.stream, self.spec.chunk_len(index), index=index, digest=digest, root=root)
        await self.conn.send([memoryview(header), *pieces])


def advertised_host(config: PathsConfig) -> str:
    """The address other agents should connect to: the configured one, else the bound one, else this host's."""
    if config.advertise_host:
        return config.advertise_host
    if config.tcp_host not in _ANY:
        return config.tcp_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return LOOPBACK


def bind_host(config: PathsConfig) -> str:
    """Where the data listener binds: `PathsConfig.tcp_host`, else where it is advertised (no other interface)."""
    return config.tcp_host or advertised_host(config)


class TcpPath(DirectPath[tuple[str, int]]):
    """The ``tcp`` path of one process: its listener (when it receives) and its connections to peers (`DirectPath`)."""

    kind = PathName.TCP
    wire_overhead = WIRE_OVERHEAD

    def __init__(self, registry: Expectations | None, *, config: PathsConfig, tls: DataTls | None = None) -> None:
        super().__init__()
        self.config = config
        self.tls = tls
        self.listener: TcpListener | None = None
        if registry is not None and (tls is None or tls.can_serve):
            self.listener = TcpListener(
                registry,
                host=bind_host(config),
                port=config.tcp_port,
                ssl_context=tls.server_context() if tls else None,
                bind_deadline=config.tcp_bind_deadline_s,
                max_connections=config.max_connections,
                max_unbound=config.tcp_max_unbound,
                max_unbound_per_source=config.tcp_max_unbound_per_source,
            )
        self._client_ssl = tls.client_context() if tls else None
        self._failed: dict[tuple[str, int], float] = {}
        """Endpoints a connection to failed, and when (not tried again for `FAILED_ENDPOINT_S`)."""
        self.advertise = ""

    async def start(self) -> None:
        """Start the listener, if this process receives on ``tcp``, where it is advertised (or
        at `PathsConfig.tcp_host`).

        Raises:
            ConfigError: the address to listen on is none of this machine's.
            OSError: the port is taken, or another reason it cannot listen.
        """
        if self.listener is None:
            return
        advertise = advertised_host(self.config)
        try:
            await self.listener.start()
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                raise
            if self.config.tcp_host or self.config.advertise_host:
                raise ConfigError(
                    f"paths: the tcp data listener cannot bind {self.listener.host}, none of this machine's "
                    "addresses; it binds where paths.advertise_host says unless paths.tcp_host names another "
                    "address (0.0.0.0: every interface)"
                ) from None
            # This host's name resolves elsewhere: listen (and be found) on loopback only.
            logger.warning("tcp data listener: %s is not an address of this machine, using %s", advertise, LOOPBACK)
            self.listener.host = advertise = LOOPBACK
            await self.listener.start()
        self.advertise = advertise

    @property
    def endpoint(self) -> tuple[str, int] | None:
        """(advertised host, port) of the listener, or None when not listening."""
        if self.listener is None or not self.advertise:
            return None
        return self.advertise, self.listener.port

    def reachable(self, offer: PathOffer | None, local_host: str) -> bool:
        """Whether ``offer`` names a TCP endpoint this process can use (TLS on both sides or neither)
        that it did not fail to connect to in the last `FAILED_ENDPOINT_S`."""
        if offer is None or not offer.tcp_host or offer.tls != (self.tls is not None):
            return False
        failed = self._failed.get((offer.tcp_host, offer.tcp_port))
        return failed is None or time.monotonic() - failed > FAILED_ENDPOINT_S

    async def open_session(self, request: OpenRequest) -> TcpSendSession:
        """Bind a stream for the spec on the connection to the offer's endpoint (connecting if needed).

        Raises:
            PathUnavailable: not offered, TLS mismatch, connection refused, token refused.
        """
        spec, offer = request.spec, request.offer
        if offer is None or not self.reachable(offer, ""):
            raise PathUnavailable("tcp", "not offered, TLS on one side only, or unreachable lately", peer=spec.receiver)
        conn = await self.connection((offer.tcp_host, offer.tcp_port))
        session = TcpSendSession(spec, conn, peer=conn.peer, on_control=request.on_control, on_lost=request.on_lost)
        await conn.bind(session, offer.token, timeout=self.config.connect_timeout_s)
        return session

    async def dial(self, endpoint: tuple[str, int]) -> tuple[Channel, str]:
        """A plain or TLS channel to ``endpoint`` (see `DirectPath.dial`); one that fails is not
        tried again for `FAILED_ENDPOINT_S`."""
        host, port = endpoint
        peer = f"{host}:{port}"
        timeout = self.config.connect_timeout_s
        try:
            channel: Channel
            if self._client_ssl is not None:
                name = self.config.tls_server_name or host
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(
                        host, port, ssl=self._client_ssl, server_hostname=name, ssl_handshake_timeout=timeout
                    ),
                    timeout,
                )
                _nodelay(writer.get_extra_info("socket"))
                channel = StreamChannel(reader, writer)
            else:
                loop = asyncio.get_running_loop()
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                family, kind, proto, _, addr = infos[0]
                sock = socket.socket(family, kind, proto)
                sock.setblocking(False)
                try:
                    _nodelay(sock)
                    await asyncio.wait_for(loop.sock_connect(sock, addr), timeout)
                except BaseException:
                    sock.close()
                    raise
                channel = SocketChannel(sock)
        except (OSError, TimeoutError, ConfigError) as exc:
            self._failed[endpoint] = time.monotonic()
            raise PathUnavailable("tcp", f"cannot connect ({type(exc).__name__}: {exc})", peer=peer) from None
        self._failed.pop(endpoint, None)
        return channel, peer

    async def close_listener(self) -> None:
        """Close the listener (`DirectPath.close` closed the connections)."""
        if self.listener is not None:
            await self.listener.close()


def _nodelay(sock: object) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # type: ignore[attr-defined]
    except (OSError, AttributeError):
        pass
