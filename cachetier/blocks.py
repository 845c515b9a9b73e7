"""A block as the tier holds it, and the tensor work on blocks that runs in worker threads."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbus.cachetier.errors import ContextMismatch
from kvbus.cachetier.keys import BlockSpan
from kvbus.cachetier.policy import Usage
from kvbus.cachetier.record import Stub
from kvbus.codecs import ModelRunner
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature


@dataclass(eq=False, slots=True)
class Block:
    """One block held by the tier."""

    key: str
    """Its content key."""
    tokens: torch.Tensor
    """Its token ids ``[batch, n]``, kept while only its stub is (they are small)."""
    kv: KVCache | None = None
    """Its KV when resident (tensors owned by the tier, never modified)."""
    stub: Stub | None = None
    """Its remote record, when the tier wrote, adopted or fetched one."""
    usage: Usage = field(default_factory=Usage)
    """Its decayed access count."""
    start: int = 0
    """First token of the block in the context it was stored from."""
    busy: bool = False
    """Being offloaded (not a candidate for another shed)."""

    @property
    def resident(self) -> bool:
        """Whether its KV is in memory (else only its token ids and, maybe, its stub are)."""
        return self.kv is not None

    @property
    def n_tokens(self) -> int:
        """Tokens in the block."""
        return int(self.tokens.shape[-1])

    @property
    def memory(self) -> int:
        """Bytes this block keeps in memory."""
        if self.kv is not None:
            return self.kv.nbytes
        return self.tokens.numel() * self.tokens.element_size()


def split_blocks(kv: KVCache, ids: torch.Tensor, spans: list[BlockSpan]) -> list[KVCache]:
    """Each span of ``kv`` as a block that owns contiguous copies of its tensors."""
    out = []
    for span in spans:
        out.append(
            KVCache(
                tokens=ids[:, span.start : span.stop].clone(),
                signature=kv.signature,
                keys=[k[:, :, span.start : span.stop].clone(memory_format=torch.contiguous_format) for k in kv.keys],
                values=[
                    v[:, :, span.start : span.stop].clone(memory_format=torch.contiguous_format) for v in kv.values
                ],
                fidelity=kv.fidelity,
            )
        )
    return out


def assemble(
    parts: list[KVCache | None],
    ids: torch.Tensor,
    signature: ModelSignature,
    dtype: torch.dtype,
    out: KVCache | None = None,
) -> KVCache:
    """One context from its blocks, in order (new tensors: the caller may keep or modify them).

    ``out``: an empty cache of exactly the context's shape to assemble into (a bus's
    ``kv_buffer``, from which a send copies nothing); ignored when its shape differs.
    """
    blocks = [p for p in parts if p is not None]
    if len(blocks) != len(parts):
        raise RuntimeError("a block left memory while pinned")  # a bug, not a user error
    if out is not None and blocks and _fits(out, blocks, ids):
        for i in range(out.n_layers):
            torch.cat([b.keys[i] for b in blocks], dim=2, out=out.keys[i])
            torch.cat([b.values[i] for b in blocks], dim=2, out=out.values[i])
        out.tokens.copy_(ids)
        out.fidelity = min(b.fidelity for b in blocks)
        return out
    if not blocks:
        shape = (ids.shape[0], signature.n_kv_heads, 0, signature.head_dim)
        empty = [torch.empty(shape, dtype=dtype) for _ in range(signature.n_layers)]
        return KVCache(tokens=ids.clone(), signature=signature, keys=empty, values=[e.clone() for e in empty])
    n = blocks[0].n_layers
    keys = [torch.cat([b.keys[i] for b in blocks], dim=2) for i in range(n)]
    values = [torch.cat([b.values[i] for b in blocks], dim=2) for i in range(n)]
    fidelity = min(b.fidelity for b in blocks)
    return KVCache(tokens=ids.clone(), signature=blocks[0].signature, keys=keys, values=values, fidelity=fidelity)


def _fits(out: KVCache, blocks: list[KVCache], ids: torch.Tensor) -> bool:
    """Whether ``out`` has the tokens, layers, shape and dtype the blocks assemble into."""
    first = blocks[0]
    if tuple(out.tokens.shape) != tuple(ids.shape) or out.positions is not None or out.n_layers != first.n_layers:
        return False
    seq = sum(b.seq_len for b in blocks)
    want = (*first.keys[0].shape[:2], seq, first.keys[0].shape[3])
    return out.seq_len == seq and tuple(out.keys[0].shape) == want and out.dtype == first.dtype


def prefill_blocks(runner: ModelRunner, ids: torch.Tensor, stop: int, spans: list[BlockSpan]) -> list[KVCache]:
    """Recompute ``spans`` with one prefill of ``ids[:, :stop]`` (causal: a block needs its whole prefix)."""
    kv = runner.prefill(ids[:, :stop])
    if kv.seq_len < stop:
        raise ContextMismatch(f"the runner to return KV for {stop} tokens", f"{kv.seq_len} positions")
    return split_blocks(kv, ids, spans)
