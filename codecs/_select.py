"""Selecting and joining KV entries by position (shared by `topk` and `delta`)."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvbus.codecs.errors import DecodeError
from kvbus.kvcache import KVCache


def kv_positions(kv: KVCache) -> torch.Tensor:
    """The token position of every KV entry, int64 ``[seq]`` (``0..seq-1`` for a dense cache)."""
    if kv.positions is not None:
        return kv.positions.to(torch.int64)
    return torch.arange(kv.seq_len, dtype=torch.int64)


def coverage(kv: KVCache) -> int:
    """How many leading tokens the KV accounts for: a dense cache's length, a sparse one's last position + 1.

    A sparse cache's missing entries before its last position were dropped on purpose (they
    are not a gap to recompute); tokens from `coverage` on are an uncovered tail.
    """
    if not kv.has_kv or kv.seq_len == 0:
        return 0
    if kv.positions is None:
        return kv.seq_len
    return int(kv.positions.max()) + 1


def densify(positions: torch.Tensor | None) -> torch.Tensor | None:
    """``None`` when ``positions`` is exactly ``0..n-1`` (a dense cache), else ``positions``."""
    if positions is None:
        return None
    n = positions.numel()
    if n == 0 or (int(positions[0]) == 0 and int(positions[-1]) == n - 1 and bool((positions.diff() == 1).all())):
        return None
    return positions


def select_entries(kv: KVCache, idx: torch.Tensor, *, tokens: torch.Tensor | None = None, offset: int = 0) -> KVCache:
    """The cache holding only the KV entries ``idx`` (sorted, int64) of ``kv``.

    Args:
        kv: the cache.
        idx: which entries to keep, ascending.
        tokens: the token ids of the result (default: ``kv``'s).
        offset: subtracted from the kept positions (to make them relative to ``tokens``).
    """
    pos = kv_positions(kv).index_select(0, idx) - offset
    keys = [k.index_select(2, idx) for k in kv.keys]
    values = [v.index_select(2, idx) for v in kv.values]
    return replace(kv, tokens=kv.tokens if tokens is None else tokens, keys=keys, values=values, positions=densify(pos))


def check_positions(kv: KVCache, codec: str) -> None:
    """Reject KV positions that are not strictly increasing or not below the token count.

    Raises:
        DecodeError: the positions cannot belong to a (sparsified) prefix of the tokens.
    """
    if kv.positions is None or kv.positions.numel() == 0:
        return
    pos = kv.positions
    if int(pos.max()) >= kv.n_tokens or (pos.numel() > 1 and not bool((pos.diff() > 0).all())):
        raise DecodeError(codec, f"KV positions must increase strictly and stay below {kv.n_tokens} tokens")
