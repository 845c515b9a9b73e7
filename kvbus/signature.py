"""`ModelSignature`: which models can reuse a KV-cache."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from kvbus.errors import WireFormatError

#: dtype names that may appear on the wire, mapped to torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a KV dtype; raises `ValueError` for a dtype KV-caches do not use."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; expected one of {sorted(DTYPES)}")


def dtype_from_name(name: object) -> torch.dtype:
    """The torch dtype for a wire name; raises `WireFormatError` for anything else."""
    if not isinstance(name, str) or name not in DTYPES:
        raise WireFormatError("dtype", f"{name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True, slots=True)
class ModelSignature:
    """What a KV-cache's layout depends on.

    Two agents can exchange KV-caches only if their signatures are compatible (same model,
    same attention geometry, same positional encoding); everything else must travel as tokens
    or a summary.
    """

    model: str
    """Name of the model weights (e.g. ``"SmolLM2-135M-Instruct"``)."""
    n_layers: int
    """Number of attention layers that hold a KV-cache."""
    n_kv_heads: int
    """Key/value heads per layer (after grouped-query sharing)."""
    head_dim: int
    """Dimension of one head."""
    dtype: str = "float32"
    """The dtype the model computes in. A KV-cache's tensors must be in its own signature's dtype
    (the bus refuses one that is not, on send and on receive); a receiver whose compatible model
    computes in another float dtype gets the KV cast to it."""
    vocab_size: int = 0
    """Vocabulary size; token ids must be below it (0 means unchecked)."""
    rope_theta: float = 10000.0
    """RoPE base; caches from another base would attend at the wrong positions."""

    @classmethod
    def from_hf_config(
        cls, config: Any, *, model: str | None = None, dtype: torch.dtype | None = None
    ) -> ModelSignature:
        """Build the signature of a Hugging Face `transformers` model config."""
        n_heads = int(config.num_attention_heads)
        n_kv_heads = int(getattr(config, "num_key_value_heads", None) or n_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // n_heads)
        rope = getattr(config, "rope_theta", None)
        if rope is None:
            params = getattr(config, "rope_parameters", None) or {}
            rope = params.get("rope_theta", 10000.0) if isinstance(params, dict) else 10000.0
        name = model or getattr(config, "name_or_path", "") or getattr(config, "model_type", "model")
        if dtype is None:
            dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = DTYPES.get(dtype.removeprefix("torch."), torch.float32)
        return cls(
            model=str(name),
            n_layers=int(config.num_hidden_layers),
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            dtype=dtype_name(dtype),
            vocab_size=int(getattr(config, "vocab_size", 0) or 0),
            rope_theta=float(rope),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype named by ``dtype``."""
        return DTYPES[self.dtype]

    def compatible_with(self, other: ModelSignature) -> bool:
        """True when a KV-cache made under ``self`` can be reused by a model with ``other``."""
        return (
            self.model == other.model
            and self.n_layers == other.n_layers
            and self.n_kv_heads == other.n_kv_heads
            and self.head_dim == other.head_dim
            and self.rope_theta == other.rope_theta
            and self.vocab_size == other.vocab_size
        )

    def digest(self) -> str:
        """A stable short hex id of the compatibility-relevant fields (not the dtype)."""
        key = f"{self.model}|{self.n_layers}|{self.n_kv_heads}|{self.head_dim}|{self.rope_theta}|{self.vocab_size}"
        return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()

    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token takes in the model's dtype."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.torch_dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        """The signature as a plain dict (the wire and directory form)."""
        # Every field is a scalar: no deep copy (`dataclasses.asdict` costs 10 us, once per transfer).
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_dict(cls, data: object) -> ModelSignature:
        """Decode a signature from wire data; raises `WireFormatError` when malformed."""
        if not isinstance(data, dict):
            raise WireFormatError("model signature", f"expected a map, got {type(data).__name__}")
        try:
            sig = cls(
                model=_field(data, "model", str),
                n_layers=_field(data, "n_layers", int),
                n_kv_heads=_field(data, "n_kv_heads", int),
                head_dim=_field(data, "head_dim", int),
                dtype=_field(data, "dtype", str),
                vocab_size=_field(data, "vocab_size", int),
                rope_theta=float(_field(data, "rope_theta", (int, float))),
            )
        except KeyError as exc:
            raise WireFormatError("model signature", f"missing field {exc}") from None
        dtype_from_name(sig.dtype)
        for name in ("n_layers", "n_kv_heads", "head_dim"):
            value = getattr(sig, name)
            if not 0 < value <= 1 << 16:
                raise WireFormatError("model signature", f"{name}={value} is out of range (1..65536)")
        if not 0 <= sig.vocab_size <= 1 << 24:
            raise WireFormatError("model signature", f"vocab_size={sig.vocab_size} is out of range")
        return sig


def _field(data: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    value = data[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise WireFormatError("model signature", f"field {name!r} has type {type(value).__name__}")
    return value
