"""The `full` medium: the KV-cache as it is, bit for bit, with zero copies on both ends."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbus.codecs._header import KVHeader
from kvbus.codecs.base import register
from kvbus.codecs.layerwise import LayerBuffer, LayerwiseCodec


@register("full")
class FullCodec(LayerwiseCodec):
    """Send tokens and every layer's keys and values in the cache's own dtype.

    Wire layout: ``[tokens int64, (positions int64), k0, v0, k1, v1, ...]``. Encoding only
    calls ``.contiguous()`` (no copy for contiguous tensors); decoding builds tensors that view
    the received buffers (copied once if misaligned).
    """

    lossless = True
    cheap_decode = True
    cheap_encode = True
    fidelity = 1.0
    encode_arena = False  # the cache's own tensors travel
    decode_arena = False  # the decoded tensors view the payload

    def layer_layout(self, header: KVHeader) -> Sequence[LayerBuffer]:
        """Keys then values, each ``[batch, kv_heads, seq, head_dim]`` in the KV dtype."""
        shape = header.layer_shape
        return (LayerBuffer("keys", header.dtype, shape), LayerBuffer("values", header.dtype, shape))

    def encode_layer(
        self,
        header: KVHeader,
        keys: torch.Tensor,
        values: torch.Tensor,
        out: Sequence[torch.Tensor] | None = None,
    ) -> Sequence[torch.Tensor]:
        """The layer's keys and values themselves (contiguous)."""
        return keys.contiguous(), values.contiguous()

    def decode_layer(
        self,
        header: KVHeader,
        views: list[torch.Tensor],
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The views themselves: the decoded cache shares the received buffers."""
        return views[0], views[1]
