"""`KVHeader`: the metadata every KV medium sends, and the token / position buffers it implies.

Every medium's payload starts with the token ids (int64 ``[batch, n_tokens]``) and, for a
sparsified cache, the KV positions (int64 ``[seq]``); the header says how big they are and how
big each layer is, so that a decoder can check every buffer before it builds a tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvbus.codecs._tensors import byte_views, check_tokens, meta_bool, meta_float, meta_int, meta_str, tensor_from
from kvbus.codecs.errors import DecodeError
from kvbus.errors import SignatureMismatch, WireFormatError
from kvbus.kvcache import KVCache
from kvbus.signature import DTYPES, ModelSignature, dtype_name

#: Largest batch a decoder accepts.
MAX_BATCH = 1 << 16
#: Largest number of tokens (and KV positions) a decoder accepts.
MAX_TOKENS = 1 << 24


@dataclass(frozen=True, slots=True)
class KVHeader:
    """The shape of a KV-cache as it travels, validated on both ends."""

    signature: ModelSignature
    """The sender's model signature."""
    batch: int
    """Number of sequences."""
    n_tokens: int
    """Token ids per sequence."""
    seq_len: int
    """KV positions per layer (0 when no KV travels)."""
    n_layers: int
    """Layers that travel: 0 (token-only) or ``signature.n_layers``."""
    dtype: torch.dtype
    """The dtype of the KV tensors (may differ from the model's)."""
    fidelity: float
    """The sender's fidelity (lineage of earlier lossy hops)."""
    positions: bool
    """Whether a positions buffer follows the tokens."""

    @classmethod
    def of(cls, kv: KVCache) -> KVHeader:
        """The header of a local cache, which is validated first.

        Raises:
            SignatureMismatch: the cache does not fit its own signature.
            ValueError: the positions are not an int ``[seq]`` tensor.
        """
        kv.validate()
        if kv.positions is not None and (
            kv.positions.dim() != 1 or kv.positions.shape[0] != kv.seq_len or kv.positions.dtype.is_floating_point
        ):
            raise ValueError(
                f"positions must be an integer tensor [{kv.seq_len}], "
                f"got {kv.positions.dtype} {list(kv.positions.shape)}"
            )
        return cls(
            signature=kv.signature,
            batch=kv.batch,
            n_tokens=kv.n_tokens,
            seq_len=kv.seq_len,
            n_layers=kv.n_layers,
            dtype=kv.dtype,
            fidelity=float(kv.fidelity),
            positions=kv.positions is not None,
        )

    @property
    def n_prefix(self) -> int:
        """Buffers before the layers: tokens, then positions if present."""
        return 2 if self.positions else 1

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        """``[batch, kv_heads, seq, head_dim]`` of one layer's keys or values."""
        return (self.batch, self.signature.n_kv_heads, self.seq_len, self.signature.head_dim)

    def to_meta(self) -> dict[str, Any]:
        """The header as msgpack-able metadata."""
        return {
            "signature": self.signature.to_dict(),
            "batch": self.batch,
            "n_tokens": self.n_tokens,
            "seq_len": self.seq_len,
            "layers": self.n_layers,
            "dtype": dtype_name(self.dtype),
            "fidelity": self.fidelity,
            "positions": self.positions,
        }

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], codec: str) -> KVHeader:
        """Decode and validate a header from untrusted metadata.

        Raises:
            DecodeError: a field is missing, of the wrong type, or out of range.
        """
        try:
            signature = ModelSignature.from_dict(meta.get("signature"))
        except WireFormatError as exc:
            raise DecodeError(codec, f"bad model signature: {exc}") from None
        batch = meta_int(meta, "batch", codec, 0, MAX_BATCH)
        n_tokens = meta_int(meta, "n_tokens", codec, 0, MAX_TOKENS)
        seq_len = meta_int(meta, "seq_len", codec, 0, n_tokens)
        n_layers = meta_int(meta, "layers", codec, 0, signature.n_layers)
        if n_layers not in (0, signature.n_layers):
            raise DecodeError(codec, f"layers={n_layers}, expected 0 or the signature's {signature.n_layers}")
        if n_layers == 0 and seq_len != 0:
            raise DecodeError(codec, f"seq_len={seq_len} without any layer")
        dtype = DTYPES[meta_str(meta, "dtype", codec, list(DTYPES))]
        fidelity = meta_float(meta, "fidelity", codec, 0.0, 1.0)
        positions = meta_bool(meta, "positions", codec)
        if positions and n_layers == 0:
            raise DecodeError(codec, "positions without any layer")
        return cls(
            signature=signature,
            batch=batch,
            n_tokens=n_tokens,
            seq_len=seq_len,
            n_layers=n_layers,
            dtype=dtype,
            fidelity=fidelity,
            positions=positions,
        )

    def prefix_tensors(self, kv: KVCache) -> list[torch.Tensor]:
        """The tokens (and positions) of ``kv`` as int64, contiguous (no copy when already so)."""
        out = [kv.tokens.to(torch.int64).contiguous()]
        if self.positions and kv.positions is not None:
            out.append(kv.positions.to(torch.int64).contiguous())
        return out

    def read_prefix(self, buffers: list[memoryview], codec: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens and positions from the first buffers (views, no copies).

        Raises:
            DecodeError: a buffer has the wrong size or a token id is out of the vocabulary.
        """
        tokens = tensor_from(buffers[0], torch.int64, (self.batch, self.n_tokens), codec, "tokens")
        check_tokens(tokens, self.signature.vocab_size, codec)
        positions = None
        if self.positions:
            positions = tensor_from(buffers[1], torch.int64, (self.seq_len,), codec, "positions")
            if positions.numel() and int(positions.min()) < 0:
                raise DecodeError(codec, "negative KV position")
        return tokens, positions

    def finish(self, kv: KVCache, codec: str) -> KVCache:
        """``kv`` after a last consistency check.

        Raises:
            DecodeError: the rebuilt cache does not fit its signature.
        """
        try:
            kv.validate()
        except SignatureMismatch as exc:
            raise DecodeError(codec, str(exc)) from None
        return kv


def encode_buffers(tensors: list[torch.Tensor]) -> list[memoryview]:
    """Byte views of ``tensors`` (zero copy for contiguous tensors)."""
    return byte_views(tensors)
