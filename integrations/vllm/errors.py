"""Errors of the vLLM connector."""

from __future__ import annotations

from kvbus.errors import KVBusError


class LoadFailed(KVBusError):
    """KV that the scheduler counted on did not arrive (its blocks go back to vLLM for recompute).

    Attributes:
        tokens: how many tokens the load was for.
        reason: what went wrong (holder gone, refused, timed out, wrong context, store lost it).
    """

    def __init__(self, tokens: int, reason: str) -> None:
        self.tokens = tokens
        self.reason = reason
        super().__init__(f"kvbus load of {tokens} tokens failed: {reason}")
