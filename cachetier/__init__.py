"""The cache tier: an agent's KV memory manager and the compressed remote tier on Redis.

`CacheTier` holds KV in fixed token blocks keyed by a content hash of their token prefix,
scores them by decayed access frequency, and above its memory watermark drops low-utility
blocks (recomputed from tokens when needed) and compresses the others into a Redis-protocol
server, leaving stubs that are fetched on access or ahead of time on a workflow hint.
"""

from kvbus.cachetier.config import CacheTierConfig
from kvbus.cachetier.errors import (
    BlockUnavailable,
    CacheTierError,
    ContextMismatch,
    RecordFormatError,
    RemoteUnavailable,
    TierClosed,
    UnsuitableCodec,
)
from kvbus.cachetier.keys import BlockSpan, block_spans
from kvbus.cachetier.policy import Action, BlockInfo, ShedPolicy, Usage, UtilityPolicy
from kvbus.cachetier.record import Stub, parse_record
from kvbus.cachetier.remote import RemoteStore
from kvbus.cachetier.tier import CacheTier
from kvbus.cachetier.types import ShedReport, Status, TierEvents, TierListener, TierStats

__all__ = [
    "Action",
    "BlockInfo",
    "BlockSpan",
    "BlockUnavailable",
    "CacheTier",
    "CacheTierConfig",
    "CacheTierError",
    "ContextMismatch",
    "RecordFormatError",
    "RemoteStore",
    "RemoteUnavailable",
    "ShedPolicy",
    "ShedReport",
    "Status",
    "Stub",
    "TierClosed",
    "TierEvents",
    "TierListener",
    "TierStats",
    "UnsuitableCodec",
    "Usage",
    "UtilityPolicy",
    "block_spans",
    "parse_record",
]
