"""The cache tier as the bus sees it: the seam `Bus.agent(..., cache=tier)` takes.

The bus never imports `kvbus.cachetier` (the parts talk by messages, never by imports): it
names here exactly what it calls on an agent's tier, and `kvbus.cachetier.CacheTier` has that
shape (mypy checks it where both meet, e.g. the vLLM connector hands its tier to `Bus.agent`).
Every member is used on the agent's event loop.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import torch

from kvbus.kvcache import KVCache


class CacheListener(Protocol):
    """The tier's event hooks (`kvbus.cachetier.TierListener` has this shape). The bus wraps the
    tier's listener in a `kvbus.telemetry.CacheMetrics`, which counts each event and passes it on."""

    def offloaded(self, keys: list[str]) -> None:
        """Blocks were written to the remote tier and confirmed."""

    def fetched(self, keys: list[str]) -> None:
        """Blocks were read back, verified and decoded."""

    def missed(self, keys: list[str]) -> None:
        """Remote reads found no usable record for these blocks."""

    def dropped(self, keys: list[str]) -> None:
        """Blocks were freed with no remote copy."""

    def recomputed(self, keys: list[str]) -> None:
        """Blocks were rebuilt from their tokens."""


class CacheTier(Protocol):
    """What the bus calls on an agent's cache tier, and when."""

    listener: CacheListener
    """Read and replaced once, when the agent registers: the bus wraps it to count the tier's events."""

    @property
    def memory_bytes(self) -> int:
        """Resident KV bytes: read for every probe (the agent's reported memory use)."""
        ...

    @property
    def stats(self) -> object:
        """The tier's counters: read for every probe (`CacheMetrics.observe` counts the growth of
        its ``hits`` and ``prefetch_hits``)."""
        ...

    async def shed(self, target_bytes: int | None = None) -> object:
        """The group scheduler's memory hint: shed down to ``target_bytes`` (None: the tier's own
        low watermark). Run in a task of its own; its result is not used, a failure is logged."""
        ...

    def prefetch(self, context: KVCache | torch.Tensor) -> asyncio.Task[int]:
        """`Agent.prefetch`: ``context`` is needed soon; returns the background load's task."""
        ...


__all__ = ["CacheListener", "CacheTier"]
