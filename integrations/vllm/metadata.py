"""What the scheduler-side connector tells the worker-side one each step (pickled by vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

#: Where a load's KV comes from.
SOURCE_LOCAL = "local"
"""This engine's own block store (a pushed context, or one it pulled or computed before)."""
SOURCE_AGENT = "agent"
"""Another agent, by a pull (a kvbus transfer; asynchronous)."""
SOURCE_TIER = "tier"
"""The shared cache tier (Redis; asynchronous)."""


@dataclass
class LoadSpec:
    """Load tokens ``[start, stop)`` of ``tokens`` into ``block_ids`` (one block id per block of that range)."""

    request_id: str
    tokens: list[int]
    """The prompt's tokens ``[0, stop)`` (the key of the prefix)."""
    start: int
    stop: int
    block_ids: list[int]
    source: str
    holder: str = ""
    medium: str | None = None
    """The medium to ask the holder for (None: its config's, else the cost model's choice)."""
    salt: str = ""
    """The request's salt scope (`keys.salt_scope`; "" for none): the KV is looked for in it."""


@dataclass
class SaveSpec:
    """Store tokens ``[0, len(tokens))`` of a request, read from ``block_ids`` (whole blocks)."""

    request_id: str
    tokens: list[int]
    block_ids: list[int]
    salt: str = ""
    """The request's salt scope: the blocks are stored and indexed in it."""


@dataclass
class PushSpec:
    """After the saves of this step: send the stored context of ``tokens`` to ``to``."""

    request_id: str
    tokens: list[int]
    to: list[str]
    medium: str | None = None
    salt: str = ""
    """The request's salt scope: the receivers keep the context in it."""


@dataclass
class KVBusConnectorMetadata(KVConnectorMetadata):
    """One step's loads, saves and pushes."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    pushes: list[PushSpec] = field(default_factory=list)
    step_tokens: int = 0
    """Tokens the step's forward computes (all requests): with its duration, the engine's prefill speed."""
