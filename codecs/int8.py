"""The `int8` medium: KIVI-style 8-bit quantisation (keys per channel, values per token)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbus.codecs._header import KVHeader
from kvbus.codecs._kernels import int8_decode, int8_decode_layer, int8_encode, int8_encode_layer
from kvbus.codecs._tensors import require_finite
from kvbus.codecs.base import register
from kvbus.codecs.errors import NonFiniteValues
from kvbus.codecs.layerwise import LayerBuffer, LayerwiseCodec
from kvbus.signature import ModelSignature

#: Largest quantised magnitude (symmetric: -127..127, so -128 is never used).
QMAX = 127
#: Axis the key scales reduce over: the sequence, giving one scale per channel ``[b, h, 1, d]``.
KEY_AXIS = 2
#: Axis the value scales reduce over: the head dimension, one scale per token ``[b, h, s, 1]``.
VALUE_AXIS = 3


def quantise(
    x: torch.Tensor, axis: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantisation of ``x`` to int8 along ``axis``.

    Returns ``(q, scale)`` with ``q`` int8 of ``x``'s shape and ``scale`` in ``x``'s dtype with
    ``axis`` reduced to 1, such that ``|x - q * scale| <= scale / 2`` element-wise. A slice that
    is all zeros gets scale 1. ``x`` is never modified. ``out``: ``(q, scale)`` tensors to write
    into (`kvbus.codecs._kernels.int8_encode`).
    """
    return int8_encode(x, axis, out=out)


def dequantise(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q * scale`` computed in ``scale``'s dtype (one new tensor, or written into ``out``)."""
    return int8_decode(q, scale, out=out)


@register("int8")
class Int8Codec(LayerwiseCodec):
    """Keys quantised per channel, values per token, to int8 with scales in the KV dtype.

    Wire layout: ``[tokens, (positions), kscale0, vscale0, kscale1, ..., kq0, vq0, kq1, ...]``;
    the scales come before the int8 tensors so that every buffer stays aligned to its dtype.
    Each element comes back within half a quantisation step (plus one rounding in the KV
    dtype). Magnitudes within 0.1% of the dtype's largest finite value may decode to inf. A KV
    holding NaN or inf is refused (`NonFiniteValues`): its scales would be NaN or inf; the check
    reads the scales, not the data.
    """

    lossless = False
    fidelity = 0.99

    def layer_layout(self, header: KVHeader) -> Sequence[LayerBuffer]:
        """Per tensor its int8 codes (section 1) and its scales in the KV dtype (section 0): per
        channel ``[b, h, 1, d]`` for keys, per token ``[b, h, s, 1]`` for values."""
        b, h, s, d = header.layer_shape
        return (
            LayerBuffer("keys", torch.int8, (b, h, s, d), section=1),
            LayerBuffer("key scales", header.dtype, (b, h, 1, d)),
            LayerBuffer("values", torch.int8, (b, h, s, d), section=1),
            LayerBuffer("value scales", header.dtype, (b, h, s, 1)),
        )

    def encode_layer(
        self,
        header: KVHeader,
        keys: torch.Tensor,
        values: torch.Tensor,
        out: Sequence[torch.Tensor] | None = None,
    ) -> Sequence[torch.Tensor]:
        """Quantise keys per channel and values per token (into ``out`` when given).

        Raises:
            NonFiniteValues: ``keys`` or ``values`` hold NaN or inf (their scales are not finite).
        """
        fused = int8_encode_layer(keys, values, out)
        if fused is not None:  # the C kernels: one call, the finiteness of the scales with it
            tensors, bad = fused
            if bad:
                raise NonFiniteValues(self.name, "keys" if bad & 1 else "values")
            return tensors
        kq, ks = quantise(keys, KEY_AXIS, (out[0], out[1]) if out else None)
        vq, vs = quantise(values, VALUE_AXIS, (out[2], out[3]) if out else None)
        require_finite(self.name, ("keys", ks), ("values", vs))
        return kq, ks, vq, vs

    def decode_layer(
        self,
        header: KVHeader,
        views: list[torch.Tensor],
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantise straight to the KV dtype (into ``out`` when given)."""
        fused = int8_decode_layer(views, out)
        if fused is not None:
            return fused
        kq, ks, vq, vs = views
        return dequantise(kq, ks, out[0] if out else None), dequantise(vq, vs, out[1] if out else None)

    def estimate_nbytes(self, signature: ModelSignature, n_tokens: int, batch: int = 1) -> int:
        """Token ids, one byte per KV element, and the per-channel and per-token scales."""
        itemsize = signature.torch_dtype.itemsize
        per_layer = signature.n_kv_heads * (
            2 * n_tokens * signature.head_dim + signature.head_dim * itemsize + n_tokens * itemsize
        )
        return batch * (n_tokens * 8 + signature.n_layers * per_layer)
