"""Block keys: a stable content hash of the token prefix chain and the model.

Block ``i`` of a context covers tokens ``[i * block_tokens, (i + 1) * block_tokens)`` (the last
block may be shorter). Its key hashes the previous block's key with its own token ids, so a key
names the whole prefix up to the end of the block: two contexts share block ``i`` exactly when
they share every token before its end. The chain starts from a seed that binds the model
signature's digest, the KV dtype, the block length and the batch size, so keys from another
model, dtype or blocking never collide with ours. A salt (a tenant's secret, vLLM's
``cache_salt``) goes into the seed too: contexts of different salts share no key, so a tier
never hands one tenant's blocks to another, and a key tells nothing of the salt.

BLAKE2b (from `hashlib`) is used rather than Python's ``hash``: keys must agree between
processes and machines.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from kvbus.signature import ModelSignature, dtype_name

#: Version of the key derivation; bump it when the derivation changes.
KEY_VERSION = 1
#: Bytes of a key digest (hex strings twice as long).
KEY_BYTES = 16


@dataclass(frozen=True, slots=True)
class BlockSpan:
    """One block of a context: its key and the token range it covers."""

    key: str
    """Hex content hash of the prefix up to the end of this block."""
    index: int
    """Position of the block in its context (0 for the first)."""
    start: int
    """First token of the block."""
    stop: int
    """One past the last token of the block."""

    @property
    def n_tokens(self) -> int:
        """Tokens the block covers (``stop - start``)."""
        return self.stop - self.start


def chain_seed(signature: ModelSignature, dtype: torch.dtype, block_tokens: int, batch: int, salt: str = "") -> bytes:
    """The digest every key chain of this model, dtype, block length, batch and salt starts from
    (no salt: the keys of an unsalted context, the same as before salts existed)."""
    text = f"kvbus-block-v{KEY_VERSION}|{signature.digest()}|{dtype_name(dtype)}|{block_tokens}|{batch}"
    if salt:
        text += f"|salt={len(salt)}:{salt}"
    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


def block_spans(
    tokens: torch.Tensor,
    signature: ModelSignature,
    dtype: torch.dtype,
    block_tokens: int,
    *,
    stop: int | None = None,
    salt: str = "",
) -> list[BlockSpan]:
    """The blocks covering ``tokens[:, :stop]`` (all of them by default), with their keys.

    Args:
        tokens: token ids ``[batch, n]`` (or ``[n]``), any integer dtype.
        signature: the model the KV comes from.
        dtype: the KV dtype.
        block_tokens: tokens per block.
        stop: cover only the first ``stop`` tokens.
        salt: the context's salt (a tenant's): keys of different salts never match.
    """
    ids = tokens if tokens.dim() == 2 else tokens.reshape(1, -1)
    ids = ids.to(torch.int64)
    n = int(ids.shape[1]) if stop is None else min(int(stop), int(ids.shape[1]))
    # Each row's ids as little-endian int64 bytes: a block hashes the same slice of every row.
    rows = [ids[b, :n].contiguous().numpy().astype("<i8", copy=False).tobytes() for b in range(ids.shape[0])]
    prev = chain_seed(signature, dtype, block_tokens, int(ids.shape[0]), salt)
    spans: list[BlockSpan] = []
    for index, start in enumerate(range(0, n, block_tokens)):
        end = min(start + block_tokens, n)
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
        h.update((end - start).to_bytes(4, "little"))
        for row in rows:
            h.update(row[start * 8 : end * 8])
        prev = h.digest()
        spans.append(BlockSpan(key=prev.hex(), index=index, start=start, stop=end))
    return spans
