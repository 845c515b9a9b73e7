"""The `full` medium: the KV-cache as it is, bit for bit, with zero copies on both ends."""

from __future__ import annotations

from kvbus.codecs._header import KVHeader, encode_buffers
from kvbus.codecs._tensors import check_buffer_count, require_map, tensor_from
from kvbus.codecs.base import Codec, Encoded, ModelRunner, register
from kvbus.kvcache import KVCache


@register("full")
class FullCodec(Codec):
    """Send tokens and every layer's keys and values in the cache's own dtype.

    Wire layout: ``[tokens int64, (positions int64), k0, v0, k1, v1, ...]``. Encoding only
    calls ``.contiguous()`` (no copy for contiguous tensors); decoding builds tensors that view
    the received buffers.
    """

    lossless = True
    cheap_decode = True
    fidelity = 1.0

    def encode(self, kv: KVCache, *, base: KVCache | None = None, runner: ModelRunner | None = None) -> Encoded:
        """Encode ``kv``; the buffers share memory with its (contiguous) tensors.

        Raises:
            SignatureMismatch: ``kv`` does not fit its own signature.
        """
        header = KVHeader.of(kv)
        tensors = header.prefix_tensors(kv)
        for k, v in zip(kv.keys, kv.values):
            tensors += [k.contiguous(), v.contiguous()]
        return Encoded(codec=self.name, meta=header.to_meta(), buffers=encode_buffers(tensors), keepalive=tensors)

    def decode(self, encoded: Encoded, *, base: KVCache | None = None,
               runner: ModelRunner | None = None) -> KVCache:
        """Rebuild the cache; its tensors view ``encoded``'s buffers (copied once if read-only).

        Raises:
            DecodeError: the metadata or a buffer is malformed.
        """
        header = KVHeader.from_meta(require_map(encoded.meta, self.name), self.name)
        buffers = check_buffer_count(encoded.buffers, header.n_prefix + 2 * header.n_layers, self.name)
        tokens, positions = header.read_prefix(buffers, self.name)
        layers = buffers[header.n_prefix:]
        shape = header.layer_shape
        keys = [tensor_from(layers[2 * i], header.dtype, shape, self.name, f"keys[{i}]")
                for i in range(header.n_layers)]
        values = [tensor_from(layers[2 * i + 1], header.dtype, shape, self.name, f"values[{i}]")
                  for i in range(header.n_layers)]
        kv = KVCache(tokens=tokens, signature=header.signature, keys=keys, values=values,
                     positions=positions, fidelity=header.fidelity)
        return header.finish(kv, self.name)
