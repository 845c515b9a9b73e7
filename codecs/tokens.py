"""The `tokens` medium: send only the token ids; the receiver recomputes the KV."""

from __future__ import annotations

from kvbus.codecs._header import KVHeader, encode_buffers
from kvbus.codecs._tensors import check_buffer_count, check_tokens, require_map
from kvbus.codecs.base import Codec, Encoded, ModelRunner, register
from kvbus.codecs.errors import DecodeError
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature


@register("tokens")
class TokensCodec(Codec):
    """Send the token ids (int64) and nothing else.

    Lossless for the context, and usable between any two models; the receiver pays a prefill.
    """

    stage = "tokens"
    lossless = True
    needs_kv = False
    fidelity = 1.0

    def encode(self, kv: KVCache, *, base: KVCache | None = None, runner: ModelRunner | None = None) -> Encoded:
        """Encode the token ids of ``kv`` (zero copy when they are contiguous int64)."""
        header = KVHeader.of(kv.token_only())
        tensors = header.prefix_tensors(kv)
        return Encoded(codec=self.name, meta=header.to_meta(), buffers=encode_buffers(tensors), keepalive=tensors)

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
        buffers = check_buffer_count(encoded.buffers, header.n_prefix, self.name)
        tokens, _ = header.read_prefix(buffers, self.name)
        if runner is None:
            kv = KVCache(tokens=tokens, signature=header.signature, fidelity=header.fidelity)
            return header.finish(kv, self.name)
        check_tokens(tokens, runner.signature.vocab_size, self.name)
        kv = runner.prefill(tokens)
        kv.fidelity = 1.0
        return kv

    def estimate_nbytes(self, signature: ModelSignature, n_tokens: int, batch: int = 1) -> int:
        """Eight bytes per token id."""
        return batch * n_tokens * 8
