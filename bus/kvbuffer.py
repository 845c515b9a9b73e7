"""`kv_buffer`: a KV-cache built in place, in a shared segment laid out as the ``full`` medium's payload.

A producer that writes its keys and values into such a cache (a prefill, a connector's save)
has already put them where a ``shm`` transfer needs them: sending it with ``full`` copies no
byte. The segment is frozen when it is first sent (`Segment.freeze`): from then on nobody can
change what a receiver verified and holds, the producer included, whose tensors keep their
contents and addresses but write to private copies of the pages they change.
"""

from __future__ import annotations

import torch

from kvbus.bus.paths.shm import Segment
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

#: Bytes per token id on the wire (``int64``).
TOKEN_BYTES = 8


def kv_buffer(signature: ModelSignature, n_tokens: int, *, batch: int = 1) -> KVCache:
    """An empty cache of ``n_tokens`` tokens for ``signature``'s model whose tokens, keys and values
    are views of one shared segment, in the order and at the offsets of the ``full`` medium's
    payload: ``[tokens int64, k0, v0, k1, v1, ...]`` (`KVCache.segment`).

    Fill ``tokens``, ``keys[i]`` and ``values[i]`` in place (``copy_``, an ``out=``); a cache
    rebuilt around other tensors (a slice, ``clone``, ``to``) is an ordinary one. The segment's
    pages are faulted in here, so the first transfer of it runs at the steady speed.

    Raises:
        ValueError: ``n_tokens`` or ``batch`` is not positive, or the signature has no KV.
        OSError: no memory for the segment.
    """
    if n_tokens <= 0 or batch <= 0:
        raise ValueError(f"a KV buffer needs at least one token and one row (got {n_tokens} x {batch})")
    if signature.n_layers <= 0 or signature.n_kv_heads <= 0 or signature.head_dim <= 0:
        raise ValueError(f"signature {signature.model!r} has no KV to hold")
    dtype = signature.torch_dtype
    shape = (batch, signature.n_kv_heads, n_tokens, signature.head_dim)
    token_bytes = batch * n_tokens * TOKEN_BYTES
    layer_bytes = shape[0] * shape[1] * shape[2] * shape[3] * dtype.itemsize
    seg = Segment(token_bytes + 2 * signature.n_layers * layer_bytes, name="kvbus-kv", freezable=True)
    raw = seg.tensor()
    tokens = raw[:token_bytes].view(torch.int64).view(batch, n_tokens)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    offset = token_bytes
    for _ in range(signature.n_layers):
        keys.append(raw[offset : offset + layer_bytes].view(dtype).view(shape))
        offset += layer_bytes
        values.append(raw[offset : offset + layer_bytes].view(dtype).view(shape))
        offset += layer_bytes
    return KVCache(tokens=tokens, signature=signature, keys=keys, values=values, segment=seg)
