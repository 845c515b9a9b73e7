"""The `delta` medium: only the tokens (and KV) after the prefix the receiver already holds.

Versions are a hash chain over the token prefix: blocks of `BLOCK` tokens (int64, all batch
rows) are hashed in turn with xxh3-128, each block's digest seeded by the previous one, so a
version names exactly one token prefix and a receiver can check its base in one pass. The
sender only needs the token ids it last delivered to that receiver (``base``); the receiver
checks that its own last context from the sender has the same prefix version and enough KV,
and otherwise raises `DeltaBaseMismatch` (never a wrong cache): the sender then falls back to
a non-delta medium.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import xxhash

from kvbus.codecs._select import coverage, densify, kv_positions, select_entries
from kvbus.codecs._tensors import meta_int, meta_str
from kvbus.codecs.base import Codec, Encoded, ModelRunner, register
from kvbus.codecs.errors import DecodeError, DeltaBaseMismatch
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature, dtype_name

#: Metadata key of this stage.
META_KEY = "delta"
#: Tokens per link of the version hash chain.
BLOCK = 1024
#: Seed of the chain (changing it changes every version).
_SEED = b"kvbus-delta-v1"


def prefix_version(tokens: torch.Tensor, n: int | None = None) -> str:
    """The version (32 hex digits) of the first ``n`` token ids of ``tokens`` ``[batch, m]``.

    A hash chain over blocks of `BLOCK` tokens: ``h_0 = xxh3_128(seed, batch, n)``,
    ``h_i = xxh3_128(h_{i-1} || tokens[:, block_i] as little-endian int64)``.
    """
    t = tokens if tokens.dim() == 2 else tokens.view(1, -1)
    n = t.shape[1] if n is None else n
    t = t[:, :n].to(torch.int64)
    digest = xxhash.xxh3_128(_SEED + f"|{t.shape[0]}|{n}".encode()).digest()
    for start in range(0, n, BLOCK):
        block = t[:, start : start + BLOCK].contiguous()
        digest = xxhash.xxh3_128(digest + block.numpy().tobytes()).digest()
    return digest.hex()


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest token prefix ``a`` and ``b`` ``[batch, *]`` share in every row (0 if batches differ)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        return 0
    m = min(a.shape[1], b.shape[1])
    if m == 0:
        return 0
    differ = (a[:, :m].to(torch.int64) != b[:, :m].to(torch.int64)).any(dim=0)
    idx = torch.nonzero(differ)
    return int(idx[0]) if idx.numel() else m


def join_prefix(base: KVCache, p: int, new: KVCache) -> KVCache:
    """``base``'s first ``p`` tokens (and their KV) followed by ``new`` (its positions relative to
    ``p``): the whole context as one cache, in the base's dtype. Used by ``delta`` (the base the
    receiver holds) and ``split`` (the prefix the receiver recomputed).

    Raises:
        DeltaBaseMismatch: the base's KV does not reach ``p``, or does not fit ``new``'s model.
    """
    tokens = torch.cat([base.tokens[:, :p].to(torch.int64), new.tokens.to(torch.int64)], dim=1)
    fidelity = min(base.fidelity, new.fidelity)
    if new.seq_len and coverage(base) < p:
        raise DeltaBaseMismatch(f"the base has KV for {coverage(base)} tokens, the delta's KV follows {p}")
    if not base.has_kv and not new.seq_len:
        return KVCache(tokens=tokens, signature=new.signature, fidelity=fidelity)
    base_pos = kv_positions(base)
    head = torch.nonzero(base_pos < p).view(-1)
    dtype = base.dtype if base.has_kv else new.dtype
    if not new.has_kv:  # delta+tokens: the base's KV covers the prefix, the new tokens are a tail
        kept = select_entries(base, head, tokens=tokens)
        signature = replace(new.signature, dtype=dtype_name(kept.dtype)) if kept.has_kv else new.signature
        return replace(kept, signature=signature, fidelity=fidelity)
    keys, values = [], []
    for i in range(new.n_layers):
        bk = base.keys[i].index_select(2, head) if base.has_kv else new.keys[i][:, :, :0]
        bv = base.values[i].index_select(2, head) if base.has_kv else new.values[i][:, :, :0]
        keys.append(torch.cat([bk.to(dtype), new.keys[i].to(dtype)], dim=2))
        values.append(torch.cat([bv.to(dtype), new.values[i].to(dtype)], dim=2))
    positions = torch.cat([base_pos.index_select(0, head), kv_positions(new) + p])
    out = KVCache(
        tokens=tokens,
        # The joined KV is in the base's dtype (the receiver's model's): say so.
        signature=replace(new.signature, dtype=dtype_name(dtype)),
        keys=keys,
        values=values,
        positions=densify(positions),
        fidelity=fidelity,
    )
    try:
        out.validate()
    except ValueError as exc:
        raise DeltaBaseMismatch(f"the base's KV does not fit the delta's model ({exc})") from None
    return out


@register("delta")
class DeltaCodec(Codec):
    """Send only what follows the prefix the receiver holds; the receiver joins it to its base.

    Composes with any KV medium (``delta+int8``, ``delta+topk(0.25)+int4``) and with ``tokens``
    (``delta+tokens``: new token ids only; the receiver's KV then covers the old prefix and
    generation feeds the new tail). Alone it is ``delta+full``. With no base, or a base that
    shares no prefix, it sends everything (still a valid delta, against the empty prefix).

    Lossless exactly when the inner medium is. The decoded context's fidelity is the lower of
    the base's and the new part's (different tokens took different hops: they do not multiply).
    """

    stage = "delta"
    lossless = True
    fidelity = 1.0

    inner: Codec
    """The wrapped codec (``full`` unless one is given): never None for a wrapper."""

    def __init__(self, *, inner: Codec | None = None, **args: Any) -> None:
        from kvbus.codecs.base import get_codec

        super().__init__(inner=inner if inner is not None else get_codec("full"), **args)

    def encode(self, kv: KVCache, *, base: KVCache | None = None, runner: ModelRunner | None = None) -> Encoded:
        """Encode the part of ``kv`` after its common prefix with ``base`` (what the receiver holds).

        Raises:
            SignatureMismatch: ``kv`` does not fit its own signature.
        """
        kv.validate()
        p = 0
        if base is not None and base.signature.compatible_with(kv.signature):
            p = common_prefix(kv.tokens, base.tokens)
        pos = kv_positions(kv)
        idx = torch.nonzero(pos >= p).view(-1)
        new = select_entries(kv, idx, tokens=kv.tokens[:, p:], offset=p)
        inner = self.inner.encode(new, runner=runner)
        meta = dict(inner.meta)
        meta[META_KEY] = {"prefix": p, "version": prefix_version(kv.tokens, p)}
        return Encoded(codec=self.name, meta=meta, buffers=inner.buffers, keepalive=inner.keepalive)

    def decode(self, encoded: Encoded, *, base: KVCache | None = None, runner: ModelRunner | None = None) -> KVCache:
        """Decode the new part and join it to ``base``'s prefix: the whole context as one cache.

        Raises:
            DecodeError: the payload or metadata is malformed.
            DeltaBaseMismatch: ``base`` is missing, of another model or batch, shorter than the
                prefix, holds another prefix (version), or lacks the KV the new part follows.
        """
        meta = encoded.meta
        own = meta.get(META_KEY) if isinstance(meta, dict) else None
        if not isinstance(own, dict):
            raise DecodeError(self.name, f"metadata field {META_KEY!r} is missing or not a map")
        p = meta_int(own, "prefix", self.name, 0, 1 << 24)
        version = meta_str(own, "version", self.name)
        inner_meta = {k: v for k, v in meta.items() if k != META_KEY}
        # tokens are decoded without a runner: the receiver's KV for the prefix is reused, not recomputed
        inner = self.inner
        assert inner is not None
        new = inner.decode(
            replace(encoded, codec=inner.name, meta=inner_meta),
            runner=None if not self.needs_kv else runner,
        )
        if new.has_kv and self.inner.fidelity > 0:
            new.fidelity = min(1.0, new.fidelity / self.inner.fidelity * self.fidelity)
        if p == 0:
            if version != prefix_version(new.tokens, 0):
                raise DeltaBaseMismatch(f"version {version[:16]}... is not the empty prefix's")
            return new
        if base is None:
            raise DeltaBaseMismatch(f"the payload follows a prefix of {p} tokens and the receiver holds no base")
        if not base.signature.compatible_with(new.signature):
            raise DeltaBaseMismatch(
                f"the base is a {base.signature.model} context, the delta is for {new.signature.model}"
            )
        if base.batch != new.batch:
            raise DeltaBaseMismatch(f"the base has batch {base.batch}, the delta {new.batch}")
        if base.n_tokens < p:
            raise DeltaBaseMismatch(f"the base holds {base.n_tokens} tokens, the delta follows {p} (stale base)")
        mine = prefix_version(base.tokens, p)
        if mine != version:
            raise DeltaBaseMismatch(
                f"the base's first {p} tokens differ from the sender's (version {mine[:16]}... vs {version[:16]}...)"
            )
        return join_prefix(base, p, new)

    def estimate_nbytes(self, signature: ModelSignature, n_tokens: int, batch: int = 1) -> int:
        """The inner medium's size for all ``n_tokens`` (the new part is not known in advance)."""
        return self.inner.estimate_nbytes(signature, n_tokens, batch)
