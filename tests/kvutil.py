"""Test data: KV-caches of a given size, fast to make."""

from __future__ import annotations

import torch

from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature


def random_kv(signature: ModelSignature, n_tokens: int, *, seed: int = 0, batch: int = 1) -> KVCache:
    """Random keys and values (random bit patterns, any float dtype) for ``n_tokens`` tokens."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, signature.n_kv_heads, n_tokens, signature.head_dim)
    dtype = signature.torch_dtype

    def one() -> torch.Tensor:
        # Finite values with a realistic spread, made without a slow per-element float path.
        return torch.randint(-1000, 1000, shape, generator=g, dtype=torch.int16).to(dtype) / 256

    keys = [one() for _ in range(signature.n_layers)]
    values = [one() for _ in range(signature.n_layers)]
    tokens = torch.randint(0, max(2, signature.vocab_size or 2), (batch, n_tokens), generator=g)
    return KVCache(tokens, signature, keys, values)


def kv_of_bytes(signature: ModelSignature, nbytes: int, *, seed: int = 0) -> KVCache:
    """A KV-cache with about ``nbytes`` bytes of keys and values (at least one token)."""
    return random_kv(signature, max(1, nbytes // signature.kv_bytes_per_token()), seed=seed)
