"""The `tokens` medium: send only the token ids; the receiver recomputes the KV."""

from __future__ import annotations

from kvbus.codecs._header import KVHeader, encode_buffers
from kvbus.codecs._tensors import check_buffer_count, check_tokens, require_map
from kvbus.codecs.base import Codec, Encoded, ModelRunner, register
from kvbus.codecs.errors import DecodeError
from kvbus.codecs.spec import Param
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

#: The largest padding a ``tokens`` payload may carry (a probe needs far less).
MAX_PAD_BYTES = 16 << 20


@register("tokens")
class TokensCodec(Codec):
    """Send the token ids (int64) and nothing else.

    Lossless for the context, and usable between any two models; the receiver pays a prefill.

    Spec: ``tokens``, or ``tokens(pad)`` / ``tokens(pad=65536)``: the ids and ``pad`` bytes of
    zeros after them, which the receiver checks for their length and drops. A payload of ids is
    too small to tell the link's speed; a padded one is the scheduler's cheap probe of a link it
    has only sent ids over since the link slowed down (`AdaptiveSelector`): the padding costs its
    bytes' time, where a probe of the context in a KV medium costs the whole KV's.
    """

    stage = "tokens"
    params = (Param("pad", int, 0, lo=0, hi=MAX_PAD_BYTES),)
    lossless = True
    needs_kv = False
    fidelity = 1.0

    def encode(self, kv: KVCache, *, base: KVCache | None = None, runner: ModelRunner | None = None) -> Encoded:
        """Encode the token ids of ``kv`` (zero copy when they are contiguous int64), then the padding."""
        header = KVHeader.of(kv.token_only())
        tensors = header.prefix_tensors(kv)
        buffers = encode_buffers(tensors)
        pad = int(self.args["pad"])
        if pad:
            buffers = [*buffers, memoryview(bytes(pad))]
        return Encoded(codec=self.name, meta=header.to_meta(), buffers=buffers, keepalive=tensors)

    def decode(self, encoded: Encoded, *, base: KVCache | None = None, runner: ModelRunner | None = None) -> KVCache:
        """Rebuild the context: recomputed by ``runner`` if given, else token-only.

        A token-only result (no layers) tells the receiver to recompute the KV later; it keeps
        the sender's fidelity (a later recompute resets it). KV recomputed here from the exact
        tokens is exact: its fidelity is 1.0, which is what makes ``tokens`` a precision refresh.

        Raises:
            DecodeError: the metadata or the buffer is malformed, or a token id is outside the
                receiver's vocabulary.
        """
        header = KVHeader.from_meta(require_map(encoded.meta, self.name), self.name)
        if header.n_layers:
            raise DecodeError(self.name, f"carries no KV, but the metadata says layers={header.n_layers}")
        pad = int(self.args["pad"])
        buffers = check_buffer_count(encoded.buffers, header.n_prefix + (1 if pad else 0), self.name)
        if pad and len(buffers[-1]) != pad:
            raise DecodeError(self.name, f"padding of {len(buffers[-1])} bytes, the medium says {pad}")
        tokens, _ = header.read_prefix(buffers[: header.n_prefix], self.name)
        if runner is None:
            kv = KVCache(tokens=tokens, signature=header.signature, fidelity=header.fidelity)
            return header.finish(kv, self.name)
        check_tokens(tokens, runner.signature.vocab_size, self.name)
        kv = runner.prefill(tokens)
        kv.fidelity = 1.0
        return kv

    def estimate_nbytes(self, signature: ModelSignature, n_tokens: int, batch: int = 1) -> int:
        """Eight bytes per token id, and the padding."""
        return batch * n_tokens * 8 + int(self.args["pad"])
