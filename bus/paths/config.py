"""Settings of the data paths, and their TLS (the deployment's certificates)."""

from __future__ import annotations

import math
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbus.config import from_env
from kvbus.errors import ConfigError
from kvbus.protocol import MAX_TOKEN_TTL_S, PATH_NAMES

if TYPE_CHECKING:
    from kvbus.net.auth import NatsAuth

DEFAULT_ALLOWED = ",".join(PATH_NAMES)


@dataclass(frozen=True, slots=True)
class PathsConfig:
    """Which data paths a process may use and how its listeners run. Override any field with ``KVBUS_PATHS_<FIELD>``."""

    allowed: str = DEFAULT_ALLOWED
    """Comma-separated paths this process may send and receive on, of ``shm``, ``tcp``, ``nats``
    (``KVBUS_PATHS_ALLOWED=nats``: every byte through NATS)."""
    tcp_host: str = ""
    """Address the TCP data listener binds; empty: the address it is advertised at, so that it
    listens on no other interface. ``0.0.0.0`` (or ``::``) listens on every interface, for an
    advertised address no interface has (behind a NAT or a node port)."""
    tcp_port: int = 0
    """Port of the TCP data listener (0: any free port; a chart sets a fixed one)."""
    advertise_host: str = ""
    """Address other agents reach the TCP listener at (a pod's IP: the chart and the testbed set
    ``KVBUS_PATHS_ADVERTISE_HOST``); empty: `tcp_host` when it names one address, else this
    host's address (its host name's, or ``127.0.0.1`` when that is none of this machine's)."""
    shm_private: bool = False
    """A receiver copies each chunk out of the shared segment before verifying it (one copy):
    the sending process then cannot change bytes after they were verified. (No other process
    can, in either mode: segments are sealed against writes by anyone but their maker.)"""
    shm_pool_bytes: int = 1 << 30
    """Bytes of released shared segments a sender keeps for reuse (0: none)."""
    shm_map_cache_bytes: int = 1 << 30
    """Bytes of senders' segments a receiver keeps mapped between transfers, to verify chunks
    through page tables already filled (a fresh mapping of 64 MB faults 16,384 pages in, about as
    long as hashing them); 0: map each segment anew."""
    recv_pool_bytes: int = 1 << 30
    """Bytes of receive buffers a receiver keeps for reuse once nothing refers to them (0: none)."""
    direct_chunk_size: int = 4 << 20
    """Chunk size of a transfer expected to take ``shm`` or ``tcp`` when the bus's chunk size is
    left at its default (0: the bus's); capped below the NATS max_payload, so that a transfer
    that falls back to NATS can carry the same chunks there."""
    token_ttl_s: float = 30.0
    """Seconds a transfer token stays valid unused."""
    connect_timeout_s: float = 5.0
    """Seconds to connect and bind a stream (TLS handshake included) before the path counts as unavailable."""
    max_connections: int = 1024
    """Direct connections a receiving process accepts at once (more are closed at once)."""
    tcp_max_unbound: int = 64
    """Of those, ``tcp`` connections that have not bound a stream yet (TLS handshake included),
    kept at once: a sender binds as soon as it is connected, so only strangers wait here. Each
    costs a few hundred bytes (with TLS, also asyncio's 256 KB TLS buffer); more are closed at
    once."""
    tcp_max_unbound_per_source: int = 32
    """Of those, the most from one source address."""
    tcp_bind_deadline_s: float = 3.0
    """Seconds a ``tcp`` connection has to bind its first stream (TLS handshake included) before
    the receiver closes it (a client that connects and then trickles bytes holds nothing longer)."""
    tls_server_name: str = ""
    """Name the receiver's certificate must carry on the ``tcp`` path; empty: its advertised address."""

    def __post_init__(self) -> None:
        names = self.allowed_paths
        if not names:
            raise ConfigError("paths.allowed names no path; use any of " + DEFAULT_ALLOWED)
        if not 0 <= self.tcp_port <= 65535:
            raise ConfigError(f"paths.tcp_port {self.tcp_port} must be within 0..65535")
        for name in ("token_ttl_s", "connect_timeout_s", "tcp_bind_deadline_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"paths.{name} must be positive and finite")
        if self.token_ttl_s > MAX_TOKEN_TTL_S:
            raise ConfigError(f"paths.token_ttl_s must be at most {MAX_TOKEN_TTL_S:g}")
        if self.shm_pool_bytes < 0 or self.recv_pool_bytes < 0 or self.shm_map_cache_bytes < 0:
            raise ConfigError(
                "paths.shm_pool_bytes, paths.shm_map_cache_bytes and paths.recv_pool_bytes must not be negative"
            )
        if self.direct_chunk_size and not 1024 <= self.direct_chunk_size <= 1 << 30:
            raise ConfigError("paths.direct_chunk_size must be 0 or within 1 KB..1 GB")
        for name in ("max_connections", "tcp_max_unbound", "tcp_max_unbound_per_source"):
            if getattr(self, name) < 1:
                raise ConfigError(f"paths.{name} must be at least 1")

    @property
    def allowed_paths(self) -> tuple[str, ...]:
        """The allowed path names, fastest first.

        Raises:
            ConfigError: an unknown name.
        """
        names = [n.strip().lower() for n in self.allowed.split(",") if n.strip()]
        for n in names:
            if n not in PATH_NAMES:
                raise ConfigError(f"paths.allowed: unknown path {n!r}; known: {DEFAULT_ALLOWED}")
        return tuple(p for p in PATH_NAMES if p in names)

    @classmethod
    def from_env(cls, **overrides: Any) -> PathsConfig:
        """Defaults, then ``KVBUS_PATHS_*``, then ``overrides``."""
        return from_env(cls, "paths", **overrides)


@dataclass(frozen=True, slots=True)
class DataTls:
    """TLS of the ``tcp`` path, from the deployment's certificates.

    A receiving process serves its certificate (``cert``/``key``) and, with ``verify_peers``,
    requires one signed by ``ca`` from the sender (mutual TLS); a sender verifies the receiver's
    against ``ca`` and presents its own. One certificate serves both roles, so it needs both the
    serverAuth and clientAuth extended key usages (or none), and the receiver's must name the
    address it advertises (or `PathsConfig.tls_server_name`).
    """

    ca: str = ""
    """PEM file of the CA(s) that sign agent certificates; empty: the system's trusted CAs."""
    cert: str = ""
    """This process's certificate (PEM); without it the process can send over TLS but not listen."""
    key: str = ""
    """Its private key (PEM)."""
    verify_peers: bool = True
    """A listener requires a client certificate signed by ``ca``."""

    @classmethod
    def from_auth(cls, auth: NatsAuth) -> DataTls | None:
        """The data-path TLS of a deployment whose NATS connection uses ``auth``; None when it uses no TLS."""
        if not auth.tls:
            return None
        return cls(ca=auth.tls_ca, cert=auth.tls_cert, key=auth.tls_key)

    @property
    def can_serve(self) -> bool:
        """Whether this process has a certificate to listen with."""
        return bool(self.cert and self.key)

    def server_context(self) -> ssl.SSLContext:
        """The listener's context.

        Raises:
            ConfigError: no certificate, or a file that does not load.
        """
        if not self.can_serve:
            raise ConfigError("the tcp data path needs a certificate and key to listen with TLS")
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.cert, self.key)
            if self.verify_peers:
                if self.ca:
                    ctx.load_verify_locations(self.ca)
                else:
                    ctx.load_default_certs(ssl.Purpose.CLIENT_AUTH)
                ctx.verify_mode = ssl.CERT_REQUIRED
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"data path TLS files do not load ({exc})") from None
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """The sender's context (verifies the receiver, presents this process's certificate).

        Raises:
            ConfigError: a file that does not load.
        """
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca or None)
            if self.can_serve:
                ctx.load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"data path TLS files do not load ({exc})") from None
        return ctx
