"""The data plane of one process: its paths, the transfers it offered them for, and the choice
of path per transfer.

Receiver, on an `Open`::

    offer = await plane.accept(spec, sink, peer_paths=open.paths, peer_host=open.host)
    reply = OpenReply(tid, True, paths=plane.accepted_paths(open.paths, open.host),
                      **(offer.reply_fields() if offer else {}))
    ...                                    # chunks reach ``sink`` from whichever path
    await plane.withdraw(tid)              # done or abandoned: tokens revoked, sessions closed

Sender, on the reply::

    session = await plane.connect(spec, reply.paths, reply.offer, on_control=..., on_lost=...)
    await session.send_chunk(i, pieces, digest, root=...)
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

from kvbus.bus.paths.base import (
    ChunkSink,
    ControlHandler,
    DataPath,
    LostHandler,
    OpenRequest,
    SendSession,
    TransferSpec,
)
from kvbus.bus.paths.config import DataTls, PathsConfig
from kvbus.bus.paths.errors import PathUnavailable
from kvbus.bus.paths.host import host_identity
from kvbus.bus.paths.nats import NatsPath, NatsReceiveSession
from kvbus.bus.paths.registry import Expectations
from kvbus.bus.paths.shm import Segment, ShmPath
from kvbus.bus.paths.tcp import TcpPath
from kvbus.net.transport import Transport
from kvbus.protocol import PathName, PathOffer

logger = logging.getLogger(__name__)


class DataPlane:
    """The paths of one process (`PathsConfig.allowed` restricts them), as sender and receiver.

    Args:
        transport: the bus's NATS transport (the ``nats`` path); None: direct paths only.
        config: which paths, listener settings (default: from ``KVBUS_PATHS_*``).
        tls: the ``tcp`` path's TLS (`DataTls.from_auth` of the deployment's `NatsAuth`); when
            the deployment uses TLS and this process has no certificate, it receives nothing on ``tcp``.
        receive: start listeners (a process that only sends needs none).
    """

    def __init__(
        self,
        transport: Transport | None = None,
        *,
        config: PathsConfig | None = None,
        tls: DataTls | None = None,
        receive: bool = True,
    ) -> None:
        self.config = config or PathsConfig.from_env()
        allowed = self.config.allowed_paths
        self.host = host_identity()
        self.registry = Expectations(pool_bytes=self.config.recv_pool_bytes) if receive else None
        self.shm = ShmPath(self.registry, config=self.config) if PathName.SHM in allowed else None
        self.tcp = TcpPath(self.registry, config=self.config, tls=tls) if PathName.TCP in allowed else None
        self.nats = NatsPath(transport) if PathName.NATS in allowed and transport is not None else None
        self._nats_rx: dict[str, NatsReceiveSession] = {}

    @property
    def paths(self) -> list[DataPath]:
        """The paths this process may use, fastest first."""
        return [p for p in (self.shm, self.tcp, self.nats) if p is not None]

    async def start(self) -> None:
        """Start the listeners."""
        for path in self.paths:
            await path.start()

    async def close(self) -> None:
        """Close listeners and connections; open sessions fail with `PathBroken`."""
        for session in self._nats_rx.values():
            session.close()
        self._nats_rx.clear()
        for path in self.paths:
            await path.close()

    async def __aenter__(self) -> DataPlane:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- what goes into the Open ---------------------------------------------------------------

    def open_fields(self) -> dict[str, object]:
        """``paths`` and ``host`` for the sender's `Open`."""
        return {"paths": [p.kind.value for p in self.paths], "host": self.host}

    # -- receiving -----------------------------------------------------------------------------

    def accepted_paths(self, peer_paths: Sequence[str], peer_host: str) -> list[str]:
        """The paths this receiver takes a transfer on from a sender that offered ``peer_paths`` (``[]``: nats only)."""
        wanted = set(peer_paths or [PathName.NATS.value])
        out = []
        if self.shm is not None and self.shm.endpoint and PathName.SHM in wanted and peer_host == self.host:
            out.append(PathName.SHM.value)
        if self.tcp is not None and self.tcp.endpoint and PathName.TCP in wanted:
            out.append(PathName.TCP.value)
        if self.nats is not None and PathName.NATS in wanted:
            out.append(PathName.NATS.value)
        return out

    async def accept(
        self,
        spec: TransferSpec,
        sink: ChunkSink,
        *,
        peer_paths: Sequence[str],
        peer_host: str,
        buffer: memoryview | None = None,
    ) -> PathOffer | None:
        """Take ``spec`` on every path both sides allow; the offer for the reply (None: NATS only).

        Args:
            buffer: the final receive buffer for the ``tcp`` path (``spec.total`` bytes); default:
                one allocated when a ``tcp`` stream binds.

        Raises:
            PathUnavailable: no path in common.
        """
        paths = self.accepted_paths(peer_paths, peer_host)
        if not paths:
            raise PathUnavailable(
                "any",
                f"no data path in common (sender: {list(peer_paths) or ['nats']}, "
                f"receiver: {[p.kind.value for p in self.paths]})",
                peer=spec.sender,
            )
        if PathName.NATS in paths and spec.transfer_id not in self._nats_rx:
            assert self.nats is not None
            self._nats_rx[spec.transfer_id] = await self.nats.receive(spec, sink)
        direct = frozenset(PathName(p) for p in paths if p != PathName.NATS)
        if not direct or self.registry is None:
            return None
        token = self.registry.expect(spec, sink, paths=direct, ttl=self.config.token_ttl_s, buffer=buffer)
        return self._offer(direct, token)

    def offer_direct(self, spec: TransferSpec, sink: ChunkSink, paths: Sequence[str]) -> PathOffer | None:
        """Offer ``spec`` on the direct paths among ``paths`` (from `accepted_paths`), for a sink that
        takes NATS chunks itself; the offer for the reply (None: no direct path).

        Raises:
            ValueError: the spec's ranges do not fit it.
        """
        direct = frozenset(PathName(p) for p in paths if p != PathName.NATS)
        if not direct or self.registry is None:
            return None
        token = self.registry.expect(spec, sink, paths=direct, ttl=self.config.token_ttl_s)
        return self._offer(direct, token)

    def reoffer(self, transfer_id: str) -> PathOffer | None:
        """A fresh offer (new token; the old one stops working) for a transfer whose sender re-sent its `Open`."""
        if self.registry is None:
            return None
        expected = self.registry.get(transfer_id)
        token = self.registry.reissue(transfer_id, self.config.token_ttl_s)
        if expected is None or token is None:
            return None
        return self._offer(expected.paths, token)

    def _offer(self, kinds: frozenset[PathName], token: str) -> PathOffer:
        tcp = self.tcp.endpoint if self.tcp is not None and PathName.TCP in kinds else None
        shm = self.shm.endpoint if self.shm is not None and PathName.SHM in kinds else ""
        return PathOffer(
            host=self.host,
            token=token,
            shm=shm,
            tcp_host=tcp[0] if tcp else "",
            tcp_port=tcp[1] if tcp else 0,
            tls=bool(tcp and self.tcp and self.tcp.tls),
            token_ttl_s=self.config.token_ttl_s,
        )

    async def withdraw(self, transfer_id: str) -> None:
        """The transfer is over (delivered, refused or abandoned): revoke its token, close its sessions."""
        if self.registry is not None:
            self.registry.withdraw(transfer_id)
        session = self._nats_rx.pop(transfer_id, None)
        if session is not None:
            session.close()

    # -- sending ---------------------------------------------------------------------------------

    def segment(self, nbytes: int) -> Segment | None:
        """A shared segment to encode a payload of ``nbytes`` into, when ``shm`` is allowed (else
        None); the caller holds it until it gives it back with `release`.

        Raises:
            OSError: no memory.
        """
        return self.shm.segment(nbytes) if self.shm is not None and nbytes > 0 else None

    def release(self, segment: Segment) -> None:
        """A transfer that staged its payload in ``segment`` (`segment`) is done with it: it goes
        back to the pool once no receiver maps it either."""
        if self.shm is not None:
            self.shm.pool.release(segment)

    async def connect(
        self,
        spec: TransferSpec,
        peer_paths: Sequence[str],
        offer: PathOffer | None,
        *,
        on_control: ControlHandler | None = None,
        on_lost: LostHandler | None = None,
        segment: Segment | None = None,
        exclude: Collection[PathName] = (),
    ) -> SendSession:
        """A session on the fastest path both sides allow that opens, trying the next when one is unavailable.

        Args:
            peer_paths: the paths the receiver's reply accepts (``[]``: an older receiver, NATS only).
            offer: the reply's direct-path offer.
            segment: where the payload already is (``shm``: nothing to copy).
            exclude: paths not to try (one that broke mid-transfer).

        Raises:
            PathUnavailable: no path could be opened (the last reason).
        """
        accepted = set(peer_paths or [PathName.NATS.value])
        request = OpenRequest(spec, offer, on_control, on_lost, segment)  # only shm reads the segment
        why: list[str] = []
        for path in self.paths:
            name = path.kind.value
            if path.kind in exclude or name not in accepted:
                continue
            if not path.reachable(offer, self.host):
                why.append(
                    f"{name}: not usable with the receiver's offer"
                    + (" (TLS on one side only)" if path.kind is PathName.TCP and offer and offer.tcp_host else "")
                )
                continue
            try:
                return await path.open_session(request)
            except PathUnavailable as exc:
                logger.info("transfer %s: %s, trying the next path", spec.transfer_id, exc)
                why.append(str(exc))
        raise PathUnavailable(
            "any",
            "no data path could be opened" + (": " + "; ".join(why) if why else " (none in common)"),
            peer=spec.receiver,
        )
