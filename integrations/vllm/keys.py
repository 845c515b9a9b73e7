"""Prefix keys: the content hash of a prompt's token blocks, identical in every process.

A key names a whole prefix: block ``i``'s key chains the previous key with the block's token
ids (BLAKE2b, `kvbus.cachetier.keys`), seeded by the model signature, the KV dtype and the block
size. Engines of the same model, dtype and vLLM ``block_size`` therefore agree on the keys of a
shared prefix, and keys of another model, dtype or block size never collide with them. The cache
tier keys its blocks the same way, so a block an engine saves is the cache tier's block.

A request's ``cache_salt`` (vLLM's prompt field that keeps tenants' prefix caches apart) seeds
the chain too, as its `salt_scope`: requests of different salts share no key, so no engine
loads, serves, pushes or indexes one tenant's KV for another. The raw salt never leaves the
engine's scheduler: the messages carry the scope, a hash of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from kvbus.cachetier.keys import BlockSpan, block_spans
from kvbus.signature import ModelSignature

#: Characters of a `salt_scope` (hex of a 16-byte BLAKE2b digest).
SCOPE_CHARS = 32


def salt_scope(cache_salt: str | None, *, tenant: str | None = None) -> str:
    """The scope a request keys its KV under: of its ``tenant`` when it names one (the
    ``kvbus_tenant`` request parameter), else of its ``cache_salt``; "" for neither. A hash, so
    that neither the salt nor the tenant's name is sent to other engines; a tenant's scope never
    equals a salt's."""
    if tenant:
        return hashlib.blake2b(tenant.encode(), digest_size=SCOPE_CHARS // 2, person=b"kvbus-tenant").hexdigest()
    if not cache_salt:
        return ""
    return hashlib.blake2b(cache_salt.encode(), digest_size=SCOPE_CHARS // 2, person=b"kvbus-salt").hexdigest()


def as_ids(tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Token ids as int64 ``[1, n]`` (what `KVCache` and the cache tier take).

    Raises:
        ValueError: the ids are not integers, or not one sequence.
    """
    ids = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(list(tokens), dtype=torch.int64)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"token ids must be integers, got {ids.dtype}")
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"expected one sequence of token ids, got shape {list(ids.shape)}")
    return ids.to(torch.int64).reshape(1, -1)


def matchable_tokens(n_prompt: int, block_size: int) -> int:
    """The longest prefix of an ``n_prompt``-token prompt that may come from outside.

    Whole blocks only, and at least one prompt token is left for the engine to compute (it
    needs the last position's logits to sample the first output token).
    """
    if n_prompt <= 1 or block_size <= 0:
        return 0
    return ((n_prompt - 1) // block_size) * block_size


def prefix_spans(
    tokens: Sequence[int] | torch.Tensor,
    signature: ModelSignature,
    dtype: torch.dtype,
    block_size: int,
    *,
    stop: int | None = None,
    salt: str = "",
) -> list[BlockSpan]:
    """The whole blocks of ``tokens[:stop]`` with their keys (a partial last block is left out),
    in the scope ``salt`` (a `salt_scope`)."""
    ids = as_ids(tokens)
    n = int(ids.shape[1]) if stop is None else min(int(stop), int(ids.shape[1]))
    n -= n % block_size
    if n <= 0:
        return []
    return block_spans(ids, signature, dtype, block_size, stop=n, salt=salt)


def prefix_keys(
    tokens: Sequence[int] | torch.Tensor,
    signature: ModelSignature,
    dtype: torch.dtype,
    block_size: int,
    *,
    stop: int | None = None,
    salt: str = "",
) -> list[str]:
    """Only the keys of `prefix_spans`: ``keys[i]`` names tokens ``[0, (i + 1) * block_size)``."""
    return [s.key for s in prefix_spans(tokens, signature, dtype, block_size, stop=stop, salt=salt)]
