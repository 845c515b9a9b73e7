"""The values one send hands through its stages (`Sender`): admit, grant, encode, route, stream, report.

A send starts as a `SendRequest` (admit: the receivers checked, the KV validated, the delta
base chosen), becomes a `TransferPlan` once granted and encoded, and is streamed by the
`OutgoingTransfer` the route stage builds from the plan. Each stage reads its settings from a
`SendSettings`, made once by the `Bus` when it registers the agent.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbus.bus.config import HEADER_ROOM, BusConfig
from kvbus.bus.paths import DataPlane
from kvbus.codecs import Codec, Encoded
from kvbus.kvcache import KVCache
from kvbus.protocol import Grant


@dataclass(frozen=True, slots=True)
class SendSettings:
    """What the send stages need from the bus an agent is registered on."""

    secure: bool
    """Per-agent permissions: every receiver of a broadcast gets its own stream."""
    direct_chunk_size: int
    """Chunk size of a transfer expected to take a direct path (`PathsConfig.direct_chunk_size`)."""
    plane: DataPlane | None
    """The process's data plane (started before the first agent registers), or None."""


@dataclass(frozen=True, slots=True)
class SendRequest:
    """One send as the admit stage accepted it."""

    transfer_id: str
    receivers: list[str]
    kv: KVCache
    medium: str | None
    """The medium asked for (the inner medium of a delta with no base to build on), or None."""
    deadline: float | None
    critical: bool
    key: str
    """The idempotency key ("" for none)."""
    label: str
    """The sender's label for the context ("" for none), for the `Open`."""
    base_tokens: int
    """Tokens at the start of ``kv`` every receiver holds from this agent, in a copy a delta may build on."""
    t0: float
    """When the send started (`time.perf_counter`)."""


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """A granted, encoded send, ready to be routed and streamed."""

    request: SendRequest
    grant: Grant
    t_grant: float
    """When the grant came."""
    codec: Codec
    """The codec that encoded the payload (``full`` when the granted lossy one met NaN or inf)."""
    encoded: Encoded
    t_enc: float
    """When the payload was encoded."""


def chunk_cap(config: BusConfig, max_payload: int) -> int:
    """The configured chunk size, capped so that payload + headers fit the server's ``max_payload``."""
    return max(1024, min(config.chunk_size, max_payload - HEADER_ROOM))
