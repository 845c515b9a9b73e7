"""The `int4` medium: KIVI-style 4-bit quantisation, keys per channel and values per token, in groups."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvbus.codecs._header import KVHeader
from kvbus.codecs._kernels import (
    int4_decode,
    int4_decode_layer,
    int4_encode,
    int4_encode_layer,
    int4_grouped_shape,
)
from kvbus.codecs._tensors import require_finite
from kvbus.codecs.base import register
from kvbus.codecs.errors import NonFiniteValues
from kvbus.codecs.layerwise import LayerBuffer, LayerwiseCodec
from kvbus.codecs.spec import Param
from kvbus.signature import ModelSignature

#: Default group size (tokens per key group, channels per value group).
DEFAULT_GROUP = 32


@register("int4")
class Int4Codec(LayerwiseCodec):
    """Asymmetric 4-bit codes (min and scale per group), two per byte.

    Keys are quantised per channel in groups of ``g`` tokens (their outlier channels get their
    own ranges, which per-token quantisation of keys would smear over every channel); values per
    token in groups of ``g`` channels (KIVI's split). Scales and minimums stay in the KV dtype.
    A cache shorter than ``g`` tokens uses one key group of its length; a head dimension that
    ``g`` does not divide uses one value group per token.

    Spec: ``int4`` or ``int4(g)`` / ``int4(g=64)``.

    Wire layout: ``[tokens, (positions), kscale0, klow0, vscale0, vlow0, ..., kcodes0, vcodes0, ...]``.
    """

    params = (Param("g", int, DEFAULT_GROUP, lo=2, hi=4096),)
    lossless = False
    fidelity = 0.95

    def _key_group(self, seq_len: int) -> int:
        return max(1, min(int(self.args["g"]), seq_len))

    def _groups(self, header: KVHeader) -> tuple[tuple[int, int], tuple[int, int]]:
        """``(axis, group)`` of the keys (groups of tokens) and of the values (groups of channels)."""
        return (2, self._key_group(header.seq_len)), (3, self.args["g"])

    def layer_layout(self, header: KVHeader) -> Sequence[LayerBuffer]:
        """Per tensor its packed codes, two per byte (section 1), then a scale and a minimum per
        group in the KV dtype (section 0)."""
        out: list[LayerBuffer] = []
        for what, (axis, group) in zip(("keys", "values"), self._groups(header)):
            grouped, red = int4_grouped_shape(header.layer_shape, axis, group)
            reduced = tuple(1 if j == red else n for j, n in enumerate(grouped))
            out += [
                LayerBuffer(what, torch.uint8, ((math.prod(grouped) + 1) // 2,), section=1),
                LayerBuffer(f"{what} scales", header.dtype, reduced),
                LayerBuffer(f"{what} mins", header.dtype, reduced),
            ]
        return out

    def encode_layer(
        self,
        header: KVHeader,
        keys: torch.Tensor,
        values: torch.Tensor,
        out: Sequence[torch.Tensor] | None = None,
    ) -> Sequence[torch.Tensor]:
        """Quantise keys per channel in groups of tokens, values per token in groups of channels.

        Raises:
            NonFiniteValues: ``keys`` or ``values`` hold NaN or inf (a group's scale is then not
                finite; the check reads the scales, not the data).
        """
        (k_axis, k_group), (v_axis, v_group) = self._groups(header)
        fused = int4_encode_layer(keys, values, k_group, v_group, out)
        if fused is not None:  # the C kernels: one call, the finiteness of the scales with it
            tensors, bad = fused
            if bad:
                raise NonFiniteValues(self.name, "keys" if bad & 1 else "values")
            return tensors
        kc, ks, kl = int4_encode(keys, k_axis, k_group, (out[0], out[1], out[2]) if out else None)
        vc, vs, vl = int4_encode(values, v_axis, v_group, (out[3], out[4], out[5]) if out else None)
        # A NaN or inf anywhere in a group makes its span, hence its scale, NaN or inf.
        require_finite(self.name, ("keys", ks), ("values", vs))
        return kc, ks, kl, vc, vs, vl

    def decode_layer(
        self,
        header: KVHeader,
        views: list[torch.Tensor],
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Unpack and dequantise straight to the KV dtype (into ``out`` when given)."""
        (k_axis, k_group), (v_axis, v_group) = self._groups(header)
        shape = header.layer_shape
        fused = int4_decode_layer(views, shape, k_group, v_group, out)
        if fused is not None:
            return fused
        kc, ks, kl, vc, vs, vl = views
        ko, vo = out if out else (None, None)
        return (
            int4_decode(kc, ks, kl, shape, k_axis, k_group, ko),
            int4_decode(vc, vs, vl, shape, v_axis, v_group, vo),
        )

    def estimate_nbytes(self, signature: ModelSignature, n_tokens: int, batch: int = 1) -> int:
        """Token ids, half a byte per KV element (keys padded to whole groups), scales and minimums."""
        item = signature.torch_dtype.itemsize
        h, d, s = signature.n_kv_heads, signature.head_dim, n_tokens
        group: int = self.args["g"]
        kg = max(1, min(group, s))
        key_groups = -(-s // kg) if s else 0
        vg = group if d % group == 0 else d
        keys = (h * key_groups * kg * d + 1) // 2 + 2 * h * key_groups * d * item
        values = (h * s * d + 1) // 2 + 2 * h * s * (d // vg) * item
        return int(batch * (s * 8 + signature.n_layers * (keys + values)))
