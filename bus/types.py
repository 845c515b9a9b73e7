"""What `send` returns and what an inbox yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbus.kvcache import KVCache


@dataclass(frozen=True)
class TransferReport:
    """The sender's record of one finished transfer."""

    transfer_id: str
    src: str
    dst: tuple[str, ...]
    medium: str
    nbytes: int
    """Payload bytes that left the sender (once, also for a broadcast)."""
    context_bytes: int
    """Bytes of the context uncompressed (`full`), for the compression ratio."""
    chunks: int
    retransmits: int
    queued_s: float
    """From `send` to the grant."""
    encode_s: float
    transfer_s: float
    """From the first `Open` to the last receiver's verdict (includes its decode)."""
    decode_s: dict[str, float]
    """Per receiver: decode (and recompute, for media without KV) time."""
    total_s: float
    rate_bps: float
    """Rate the scheduler allocated (0 = unpaced)."""
    decision: dict[str, Any] = field(default_factory=dict)
    """The scheduler's reasons: candidates and predicted costs, when it reports them."""
    fidelity: float = 1.0
    """The lineage of the context the receivers now hold: the sender's times this hop's factor,
    and, for a delta, no more than the base it was joined to (1.0 = lossless all the way)."""
    path: str = "nats"
    """The data path the payload took (``shm``, ``tcp`` or ``nats``; the last one when a direct
    path failed and the transfer went on over NATS). Inline payloads and broadcasts: ``nats``."""
    paths: tuple[str, ...] = ("nats",)
    """Every path the payload took, in order (e.g. ``("tcp", "nats")`` after a fall back)."""

    @property
    def throughput_bps(self) -> float:
        """Payload bytes per second over the transfer (0 when it took no measurable time)."""
        return self.nbytes / self.transfer_s if self.transfer_s > 0 else 0.0


@dataclass
class Delivery:
    """A context that arrived whole and verified."""

    transfer_id: str
    sender: str
    kv: KVCache
    medium: str
    nbytes: int
    transfer_s: float
    """From the `Open` to the last chunk."""
    decode_s: float
    """Decode, and recompute for media without KV."""
    label: str = ""
    """The sender's label for the context (`Agent.send`'s ``label``; "" for none)."""
