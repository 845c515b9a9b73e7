"""Data paths: how a transfer's chunk bytes travel once the `Open` is answered (shared memory,
a direct TCP connection, or NATS), each behind the same seam (`DataPath`, `SendSession`,
`ReceiveSession`, `ChunkSink`), and the `DataPlane` that offers them and picks one per transfer."""

from kvbus.bus.paths.base import (
    ChunkSink,
    DataPath,
    OpenRequest,
    Pacer,
    ReceiveSession,
    SendSession,
    TransferSpec,
    chunk_digest,
)
from kvbus.bus.paths.config import DataTls, PathsConfig
from kvbus.bus.paths.errors import PathBroken, PathError, PathProtocolError, PathUnavailable, TokenRefused
from kvbus.bus.paths.host import host_identity
from kvbus.bus.paths.nats import NatsPath
from kvbus.bus.paths.plane import DataPlane
from kvbus.bus.paths.shm import Segment, SegmentPool, ShmPath
from kvbus.bus.paths.tcp import TcpPath
from kvbus.bus.paths.tokens import Claim, TokenTable

__all__ = [
    "ChunkSink",
    "Claim",
    "DataPath",
    "DataPlane",
    "DataTls",
    "NatsPath",
    "OpenRequest",
    "Pacer",
    "PathBroken",
    "PathError",
    "PathProtocolError",
    "PathUnavailable",
    "PathsConfig",
    "ReceiveSession",
    "Segment",
    "SegmentPool",
    "SendSession",
    "ShmPath",
    "TcpPath",
    "TokenRefused",
    "TokenTable",
    "TransferSpec",
    "chunk_digest",
    "host_identity",
]
