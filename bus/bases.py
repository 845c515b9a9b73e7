"""The delta bases a receiver keeps: a private copy of the last context from each sender.

A copy of a large context into fresh memory costs a page fault per 4 KB page (several times the
copy itself on some VMs); `base_copy` copies into the previous base of that sender when the
layout matches, else into huge-page-advised mappings. A context that came through a shared
segment needs no copy at all (`twin_base`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvbus.bus.paths.registry import HUGE_FROM, allocate_buffer
from kvbus.bus.paths.shm import address
from kvbus.kvcache import KVCache


def base_copy(kv: KVCache, old: KVCache | None = None) -> KVCache:
    """A private copy of ``kv`` to keep as a delta base: into ``old``'s tensors when they have the
    same layout (the previous base of that sender, which nothing else refers to), else into fresh
    memory, large tensors in huge-page-advised mappings (fresh 4 KB pages cost a fault each,
    several times the copy on some VMs)."""
    if old is not None and _same_layout(kv, old):
        # One call for every layer: half of what a copy_ per tensor costs on a small context.
        torch._foreach_copy_([*old.keys, *old.values], [*kv.keys, *kv.values])
        old.tokens.copy_(kv.tokens)
        if old.positions is not None and kv.positions is not None:
            old.positions.copy_(kv.positions)
        return dataclasses.replace(
            kv, tokens=old.tokens, keys=old.keys, values=old.values, positions=old.positions, segment=None
        )
    return dataclasses.replace(
        kv,
        segment=None,
        tokens=kv.tokens.clone(),
        keys=[_fresh_copy(t) for t in kv.keys],
        values=[_fresh_copy(t) for t in kv.values],
        positions=None if kv.positions is None else kv.positions.clone(),
    )


def twin_base(kv: KVCache, twins: Sequence[tuple[memoryview, memoryview]]) -> KVCache | None:
    """``kv`` as a delta base without copying its KV: each key and value tensor that lies in one
    of the ``(view, twin)`` mappings becomes the tensor at the same offset of ``twin`` (a second
    copy-on-write mapping of the same bytes, so the application may write the delivered tensors
    and the base stays as it arrived). None when any of them lies elsewhere (a decode made it)."""

    spans = [(address(view), view.nbytes, twin) for view, twin in twins]  # each address once, not per layer

    def twin_of(t: torch.Tensor) -> torch.Tensor | None:
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or not t.is_contiguous() or nbytes == 0:
            return None
        start = t.data_ptr()
        for lo, size, twin in spans:
            if lo <= start and start + nbytes <= lo + size:
                raw = torch.frombuffer(twin, dtype=torch.uint8, count=nbytes, offset=start - lo)
                return raw.view(t.dtype).reshape(t.shape)
        return None

    keys = [twin_of(t) for t in kv.keys]
    values = [twin_of(t) for t in kv.values]
    if not keys or any(t is None for t in (*keys, *values)):
        return None
    return dataclasses.replace(
        kv,
        segment=None,
        tokens=kv.tokens.clone(),
        keys=keys,  # type: ignore[arg-type]
        values=values,  # type: ignore[arg-type]
        positions=None if kv.positions is None else kv.positions.clone(),
    )


def _same_layout(a: KVCache, b: KVCache) -> bool:
    pairs = [(a.tokens, b.tokens), *zip(a.keys, b.keys), *zip(a.values, b.values)]
    if a.positions is not None or b.positions is not None:
        if a.positions is None or b.positions is None:
            return False
        pairs.append((a.positions, b.positions))
    return (
        len(a.keys) == len(b.keys)
        and len(a.values) == len(b.values)
        and all(x.shape == y.shape and x.dtype == y.dtype and y.is_contiguous() for x, y in pairs)
    )


def _fresh_copy(t: torch.Tensor) -> torch.Tensor:
    nbytes = t.numel() * t.element_size()
    if nbytes < HUGE_FROM or t.device.type != "cpu":
        return t.clone()
    out = torch.frombuffer(allocate_buffer(nbytes), dtype=torch.uint8).view(t.dtype).reshape(t.shape)
    out.copy_(t)
    return out
