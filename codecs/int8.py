"""The `int8` medium: KIVI-style 8-bit quantisation (keys per channel, values per token)."""

from __future__ import annotations

import torch

from kvbus.codecs._header import KVHeader, encode_buffers
from kvbus.codecs._kernels import int8_decode, int8_encode
from kvbus.codecs._tensors import check_buffer_count, require_map, tensor_from
from kvbus.codecs.base import Codec, Encoded, ModelRunner, register
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

#: Largest quantised magnitude (symmetric: -127..127, so -128 is never used).
QMAX = 127
#: Axis the key scales reduce over: the sequence, giving one scale per channel ``[b, h, 1, d]``.
KEY_AXIS = 2
#: Axis the value scales reduce over: the head dimension, one scale per token ``[b, h, s, 1]``.
VALUE_AXIS = 3


def quantise(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantisation of ``x`` to int8 along ``axis``.

    Returns ``(q, scale)`` with ``q`` int8 of ``x``'s shape and ``scale`` in ``x``'s dtype with
    ``axis`` reduced to 1, such that ``|x - q * scale| <= scale / 2`` element-wise. A slice that
    is all zeros gets scale 1. ``x`` is never modified. (`kvbus.codecs._kernels.int8_encode`.)
    """
    return int8_encode(x, axis)


def dequantise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` computed in ``scale``'s dtype (one new tensor)."""
    return int8_decode(q, scale)


@register("int8")
class Int8Codec(Codec):
    """Keys quantised per channel, values per token, to int8 with scales in the KV dtype.

    Wire layout: ``[tokens, (positions), kscale0, vscale0, kscale1, ..., kq0, vq0, kq1, ...]``;
    the scales come before the int8 tensors so that every buffer stays aligned to its dtype.
    Each element comes back within half a quantisation step (plus one rounding in the KV
    dtype). Magnitudes within 0.1% of the dtype's largest finite value may decode to inf.
    """

    lossless = False
    fidelity = 0.99

    def encode(self, kv: KVCache, *, base: KVCache | None = None, runner: ModelRunner | None = None) -> Encoded:
        """Quantise ``kv`` (its tensors are not modified).

        Raises:
            SignatureMismatch: ``kv`` does not fit its own signature.
        """
        header = KVHeader.of(kv)
        scales: list[torch.Tensor] = []
        quants: list[torch.Tensor] = []
        for k, v in zip(kv.keys, kv.values):
            kq, ks = quantise(k, KEY_AXIS)
            vq, vs = quantise(v, VALUE_AXIS)
            scales += [ks, vs]
            quants += [kq, vq]
        tensors = header.prefix_tensors(kv) + scales + quants
        return Encoded(codec=self.name, meta=header.to_meta(), buffers=encode_buffers(tensors), keepalive=tensors)

    def decode(self, encoded: Encoded, *, base: KVCache | None = None,
               runner: ModelRunner | None = None) -> KVCache:
        """Dequantise straight to the KV dtype; the result's fidelity is the sender's times ours.

        Raises:
            DecodeError: the metadata or a buffer is malformed.
        """
        header = KVHeader.from_meta(require_map(encoded.meta, self.name), self.name)
        n = header.n_layers
        buffers = check_buffer_count(encoded.buffers, header.n_prefix + 4 * n, self.name)
        tokens, positions = header.read_prefix(buffers, self.name)
        scale_bufs = buffers[header.n_prefix:header.n_prefix + 2 * n]
        quant_bufs = buffers[header.n_prefix + 2 * n:]
        b, h, s, d = header.layer_shape
        # Every buffer is checked (views, no allocation) before anything is computed from one.
        views = [(tensor_from(quant_bufs[2 * i], torch.int8, (b, h, s, d), self.name, f"keys[{i}]"),
                  tensor_from(scale_bufs[2 * i], header.dtype, (b, h, 1, d), self.name, f"key scales[{i}]"),
                  tensor_from(quant_bufs[2 * i + 1], torch.int8, (b, h, s, d), self.name, f"values[{i}]"),
                  tensor_from(scale_bufs[2 * i + 1], header.dtype, (b, h, s, 1), self.name, f"value scales[{i}]"))
                 for i in range(n)]
        keys = [dequantise(kq, ks) for kq, ks, _, _ in views]
        values = [dequantise(vq, vs) for _, _, vq, vs in views]
        kv = KVCache(tokens=tokens, signature=header.signature, keys=keys, values=values,
                     positions=positions, fidelity=header.fidelity * self.fidelity if n else header.fidelity)
        return header.finish(kv, self.name)

    def estimate_nbytes(self, signature: ModelSignature, n_tokens: int, batch: int = 1) -> int:
        """Token ids, one byte per KV element, and the per-channel and per-token scales."""
        itemsize = signature.torch_dtype.itemsize
        per_layer = signature.n_kv_heads * (2 * n_tokens * signature.head_dim
                                            + signature.head_dim * itemsize + n_tokens * itemsize)
        return batch * (n_tokens * 8 + signature.n_layers * per_layer)
