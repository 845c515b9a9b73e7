"""The delta bases a receiver keeps: a private copy of the last context from each sender.

A copy of a large context into fresh memory costs a page fault per 4 KB page (several times the
copy itself on some VMs); `base_copy` copies into the previous base of that sender when the
layout matches, else into huge-page-advised mappings.
"""

from __future__ import annotations

import dataclasses

import torch

from kvbus.bus.paths.registry import HUGE_FROM, allocate_buffer
from kvbus.kvcache import KVCache


def base_copy(kv: KVCache, old: KVCache | None = None) -> KVCache:
    """A private copy of ``kv`` to keep as a delta base: into ``old``'s tensors when they have the
    same layout (the previous base of that sender, which nothing else refers to), else into fresh
    memory, large tensors in huge-page-advised mappings (fresh 4 KB pages cost a fault each,
    several times the copy on some VMs)."""
    if old is not None and _same_layout(kv, old):
        for dst, src in zip((*old.keys, *old.values), (*kv.keys, *kv.values)):
            dst.copy_(src)
        old.tokens.copy_(kv.tokens)
        if old.positions is not None and kv.positions is not None:
            old.positions.copy_(kv.positions)
        return dataclasses.replace(kv, tokens=old.tokens, keys=old.keys, values=old.values, positions=old.positions)
    return dataclasses.replace(
        kv,
        tokens=kv.tokens.clone(),
        keys=[_fresh_copy(t) for t in kv.keys],
        values=[_fresh_copy(t) for t in kv.values],
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
