"""The `int4` medium: KIVI-style 4-bit quantisation, keys per channel and values per token, in groups."""

from __future__ import annotations

import math

import torch

from kvbus.codecs._header import KVHeader, encode_buffers
from kvbus.codecs._kernels import int4_decode, int4_encode, int4_grouped_shape
from kvbus.codecs._tensors import check_buffer_count, require_map, tensor_from
from kvbus.codecs.base import Codec, Encoded, ModelRunner, register
from kvbus.codecs.spec import Param
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

#: Default group size (tokens per key group, channels per value group).
DEFAULT_GROUP = 32


@register("int4")
class Int4Codec(Codec):
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
        return max(1, min(self.args["g"], seq_len))

    def encode(self, kv: KVCache, *, base: KVCache | None = None, runner: ModelRunner | None = None) -> Encoded:
        """Quantise ``kv`` (its tensors are not modified).

        Raises:
            SignatureMismatch: ``kv`` does not fit its own signature.
        """
        header = KVHeader.of(kv)
        g, kg = self.args["g"], self._key_group(kv.seq_len)
        params: list[torch.Tensor] = []
        codes: list[torch.Tensor] = []
        for k, v in zip(kv.keys, kv.values):
            kq, ks, kl = int4_encode(k, 2, kg)
            vq, vs, vl = int4_encode(v, 3, g)
            params += [ks, kl, vs, vl]
            codes += [kq, vq]
        tensors = header.prefix_tensors(kv) + params + codes
        return Encoded(codec=self.name, meta=header.to_meta(), buffers=encode_buffers(tensors), keepalive=tensors)

    def decode(self, encoded: Encoded, *, base: KVCache | None = None,
               runner: ModelRunner | None = None) -> KVCache:
        """Dequantise straight to the KV dtype; the result's fidelity is the sender's times ours.

        Raises:
            DecodeError: the metadata or a buffer is malformed.
        """
        header = KVHeader.from_meta(require_map(encoded.meta, self.name), self.name)
        n = header.n_layers
        buffers = check_buffer_count(encoded.buffers, header.n_prefix + 6 * n, self.name)
        tokens, positions = header.read_prefix(buffers, self.name)
        param_bufs = buffers[header.n_prefix:header.n_prefix + 4 * n]
        code_bufs = buffers[header.n_prefix + 4 * n:]
        shape = header.layer_shape
        g, kg = self.args["g"], self._key_group(header.seq_len)
        layouts = []
        for axis, group in ((2, kg), (3, g)):
            grouped, red = int4_grouped_shape(shape, axis, group)
            reduced = list(grouped)
            reduced[red] = 1
            layouts.append((axis, group, reduced, (math.prod(grouped) + 1) // 2))
        views = []
        for i in range(n):
            layer = []
            for j, (axis, group, reduced, n_codes) in enumerate(layouts):
                what = ("keys", "values")[j]
                layer.append((
                    tensor_from(code_bufs[2 * i + j], torch.uint8, (n_codes,), self.name, f"{what}[{i}]"),
                    tensor_from(param_bufs[4 * i + 2 * j], header.dtype, reduced, self.name, f"{what} scales[{i}]"),
                    tensor_from(param_bufs[4 * i + 2 * j + 1], header.dtype, reduced, self.name, f"{what} mins[{i}]"),
                    axis, group))
            views.append(layer)
        keys, values = [], []
        for (kc, ks, kl, ka, kgroup), (vc, vs, vl, va, vgroup) in views:
            keys.append(int4_decode(kc, ks, kl, shape, ka, kgroup))
            values.append(int4_decode(vc, vs, vl, shape, va, vgroup))
        kv = KVCache(tokens=tokens, signature=header.signature, keys=keys, values=values,
                     positions=positions, fidelity=header.fidelity * self.fidelity if n else header.fidelity)
        return header.finish(kv, self.name)

    def estimate_nbytes(self, signature: ModelSignature, n_tokens: int, batch: int = 1) -> int:
        """Token ids, half a byte per KV element (keys padded to whole groups), scales and minimums."""
        item = signature.torch_dtype.itemsize
        h, d, s = signature.n_kv_heads, signature.head_dim, n_tokens
        kg = max(1, min(self.args["g"], s))
        key_groups = -(-s // kg) if s else 0
        vg = self.args["g"] if d % self.args["g"] == 0 else d
        keys = (h * key_groups * kg * d + 1) // 2 + 2 * h * key_groups * d * item
        values = (h * s * d + 1) // 2 + 2 * h * s * (d // vg) * item
        return batch * (s * 8 + signature.n_layers * (keys + values))
