"""`KVCache`: the context one agent hands to another."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvbus.errors import SignatureMismatch
from kvbus.signature import ModelSignature, dtype_name


@dataclass(eq=False)
class KVCache:
    """Per-layer key/value tensors of a context, with the tokens they were computed from.

    ``keys[i]`` and ``values[i]`` have shape ``[batch, kv_heads, seq, head_dim]``. ``tokens``
    has shape ``[batch, n_tokens]``; the KV may cover all of them or a prefix (a receiver that
    continues generation feeds the uncovered tail). A cache with no layers is a token-only
    context: its receiver must recompute the KV with its own model.
    """

    tokens: torch.Tensor
    """Token ids, int64 ``[batch, n_tokens]``."""
    signature: ModelSignature
    """Which models can reuse this KV."""
    keys: list[torch.Tensor] = field(default_factory=list)
    """Per-layer keys ``[batch, kv_heads, seq, head_dim]``."""
    values: list[torch.Tensor] = field(default_factory=list)
    """Per-layer values, same shape as the keys."""
    positions: torch.Tensor | None = None
    """Positions of the KV entries when they are not ``0..seq-1`` (sparsified caches)."""
    fidelity: float = 1.0
    """Product of the fidelity factors of every lossy hop this context took (1.0 = lossless)."""
    segment: Any = field(default=None, repr=False)
    """The shared segment the cache was built in, laid out as the ``full`` medium's payload
    (`Agent.kv_buffer`): sent on ``shm`` without a copy. None for a cache anywhere else; the
    caches derived from this one (slices, copies) have none."""

    def __post_init__(self) -> None:
        if self.tokens.dim() == 1:
            self.tokens = self.tokens.unsqueeze(0)

    # -- shape -----------------------------------------------------------------------------

    @property
    def has_kv(self) -> bool:
        """False for a token-only context."""
        return bool(self.keys)

    @property
    def n_layers(self) -> int:
        """Number of layers with KV (0 for a token-only context)."""
        return len(self.keys)

    @property
    def batch(self) -> int:
        """Batch size (rows of ``tokens``)."""
        return int(self.tokens.shape[0])

    @property
    def n_tokens(self) -> int:
        """Number of token ids per row (may exceed `seq_len` after sparsification)."""
        return int(self.tokens.shape[-1])

    @property
    def seq_len(self) -> int:
        """Number of KV positions held (0 for a token-only context)."""
        return int(self.keys[0].shape[2]) if self.keys else 0

    @property
    def dtype(self) -> torch.dtype:
        """The KV tensors' dtype; the signature's dtype for a token-only context."""
        return self.keys[0].dtype if self.keys else self.signature.torch_dtype

    @property
    def contiguous(self) -> bool:
        """Whether every key and value tensor is contiguous (a view-only encode copies nothing)."""
        return all(t.is_contiguous() for t in (*self.keys, *self.values))

    @property
    def nbytes(self) -> int:
        """Bytes of the KV tensors plus the token ids."""
        return sum(t.nbytes for t in (*self.keys, *self.values)) + self.tokens.nbytes

    def validate(self, signature: ModelSignature | None = None, *, dtype: bool = False) -> None:
        """Check every layer against ``signature`` (default: the cache's own).

        Args:
            signature: the model signature to check against (its compatibility, layer count and
                shapes; default: the cache's own).
            dtype: also require the keys and values to be in the cache's own signature's dtype
                (what the bus checks before it sends, and after it decodes).

        Raises:
            SignatureMismatch: a layer count, shape or dtype does not fit.
        """
        sig = signature or self.signature
        if signature is not None and not self.signature.compatible_with(signature):
            raise SignatureMismatch(
                f"a cache for {signature.model} ({signature.digest()})",
                f"one for {self.signature.model} ({self.signature.digest()})",
            )
        if self.tokens.dtype not in (torch.int64, torch.int32) or self.tokens.dim() != 2:
            raise SignatureMismatch("token ids int64 [batch, n]", f"{self.tokens.dtype} {list(self.tokens.shape)}")
        if not self.keys and not self.values:
            return
        if len(self.keys) != sig.n_layers or len(self.values) != sig.n_layers:
            raise SignatureMismatch(f"{sig.n_layers} layers", f"{len(self.keys)} keys / {len(self.values)} values")
        first = self.keys[0]
        want = (self.batch, sig.n_kv_heads, first.shape[2], sig.head_dim)
        # One set of (shape, dtype) pairs answers the common case: a transfer validates its KV
        # about four times, and a check per tensor costs half a microsecond (a hundred of them).
        layout = {(t.shape, t.dtype) for t in (*self.keys, *self.values)}
        if (
            len(layout) == 1
            and first.shape == want
            and first.dtype.is_floating_point
            and (not dtype or first.dtype == self.signature.torch_dtype)
        ):
            if first.shape[2] > self.n_tokens:
                raise SignatureMismatch(f"at most {self.n_tokens} KV positions (one per token)", str(first.shape[2]))
            return
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            for kind, t in (("keys", k), ("values", v)):
                if tuple(t.shape) != want:
                    raise SignatureMismatch(f"{kind}[{i}] of shape {list(want)}", str(list(t.shape)))
                if t.dtype != first.dtype or not t.dtype.is_floating_point:
                    raise SignatureMismatch(f"{kind}[{i}] in {first.dtype}", str(t.dtype))
                if dtype and t.dtype != self.signature.torch_dtype:
                    raise SignatureMismatch(
                        f"{kind}[{i}] in {self.signature.dtype} (the dtype of the cache's model signature)",
                        str(t.dtype),
                    )
        if first.shape[2] > self.n_tokens:
            raise SignatureMismatch(f"at most {self.n_tokens} KV positions (one per token)", str(first.shape[2]))

    # -- slicing and conversion --------------------------------------------------------------

    def slice(self, start: int, stop: int | None = None) -> KVCache:
        """The context of tokens ``[start, stop)``: views, no copies."""
        stop = self.n_tokens if stop is None else stop
        if not 0 <= start <= stop <= self.n_tokens:
            raise IndexError(f"token range [{start}, {stop}) is outside [0, {self.n_tokens}]")
        kv_stop = min(stop, self.seq_len)
        kv_start = min(start, kv_stop)
        return replace(
            self,
            segment=None,
            tokens=self.tokens[:, start:stop],
            keys=[k[:, :, kv_start:kv_stop] for k in self.keys],
            values=[v[:, :, kv_start:kv_stop] for v in self.values],
            positions=None if self.positions is None else self.positions[kv_start:kv_stop],
        )

    def token_only(self) -> KVCache:
        """The same context without its KV."""
        return replace(self, keys=[], values=[], positions=None, segment=None)

    def to(self, dtype: torch.dtype) -> KVCache:
        """A copy with keys and values in ``dtype`` (self when already there)."""
        if self.dtype == dtype:
            return self
        return replace(
            self, keys=[k.to(dtype) for k in self.keys], values=[v.to(dtype) for v in self.values], segment=None
        )

    def clone(self) -> KVCache:
        """A deep copy: every tensor cloned, so the copy can be modified without touching this one."""
        return replace(
            self,
            segment=None,
            tokens=self.tokens.clone(),
            keys=_clone_all(self.keys),
            values=_clone_all(self.values),
            positions=None if self.positions is None else self.positions.clone(),
        )

    def equal(self, other: KVCache) -> bool:
        """Bit-exact equality of tokens, keys and values."""
        return (
            torch.equal(self.tokens, other.tokens)
            and len(self.keys) == len(other.keys)
            and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(self.keys, other.keys))
            and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(self.values, other.values))
        )

    @classmethod
    def from_hf(cls, cache: Any, tokens: torch.Tensor, config: Any, *, model: str | None = None) -> KVCache:
        """Wrap a `transformers` cache (``DynamicCache``) and the token ids it was computed from.

        The tensors are shared, not copied.
        """
        layers = getattr(cache, "layers", None)
        if layers is None:
            raise TypeError(f"expected a transformers Cache with .layers, got {type(cache).__name__}")
        keys = [layer.keys for layer in layers]
        values = [layer.values for layer in layers]
        dtype = keys[0].dtype if keys else None
        signature = ModelSignature.from_hf_config(config, model=model, dtype=dtype)
        kv = cls(tokens=tokens.to(torch.int64), signature=signature, keys=keys, values=values)
        kv.validate()
        return kv

    def to_hf(self, config: Any = None) -> Any:
        """A `transformers` ``DynamicCache`` holding these tensors (the cache concatenates, so it copies them)."""
        from transformers import DynamicCache

        if self.positions is not None:
            raise ValueError("a sparsified cache (with explicit positions) cannot become a DynamicCache")
        cache = DynamicCache(config=config) if config is not None else DynamicCache()
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            cache.update(k, v, i)
        return cache

    def describe(self) -> dict[str, Any]:
        """A short summary for logs and reports."""
        return {
            "model": self.signature.model,
            "layers": self.n_layers,
            "tokens": self.n_tokens,
            "kv_positions": self.seq_len,
            "dtype": dtype_name(self.dtype),
            "bytes": self.nbytes,
            "fidelity": self.fidelity,
        }


def _clone_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors``; layers of one shape are copied in one call (`torch.stack`), which
    costs a fraction of a clone per layer for the small contexts most transfers carry."""
    if len(tensors) > 2 and len({t.dtype for t in tensors}) == 1:  # stack would promote mixed dtypes
        try:
            return list(torch.stack(tensors).unbind(0))
        except RuntimeError:
            pass  # shapes or devices differ
    return [t.clone() for t in tensors]
