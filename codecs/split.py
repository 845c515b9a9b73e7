"""The `split` medium: the receiver recomputes a prefix from its token ids while the rest arrives as KV.

``tokens`` makes the receiver wait for a prefill of the whole context; a KV medium makes it wait
for the whole payload on the link. ``split(f)+X`` does both at once on different parts: the first
``f`` of the context's tokens travel as ids in the `Open`'s metadata, and the receiver prefills
them (`SplitCodec.prepare`, in a worker thread) while the KV of the rest streams in medium ``X``;
decoding joins the two. A prefix's KV depends only on the prefix, so the joined cache is the one
the sender holds (exactly, when ``X`` is lossless). The transfer then takes about the longer of
the prefill of ``f`` and the link time of ``1 - f``, where ``tokens`` and ``X`` take one of them
whole; the scheduler picks ``f`` where the two meet (`kvbus.group_scheduler.cost_model`).

Wire form: the inner medium's metadata and buffers for the suffix (positions relative to the
prefix, as ``delta`` sends them), plus ``meta["split"] = {"prefix": k, "batch": b, "ids": bytes}``
with the prefix's ids as little-endian int32, ``b`` rows of ``k``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from kvbus.codecs._select import coverage, kv_positions, select_entries
from kvbus.codecs._tensors import check_tokens, meta_int
from kvbus.codecs.base import Codec, Encoded, ModelRunner, register
from kvbus.codecs.delta import join_prefix
from kvbus.codecs.errors import DecodeError, DeltaBaseMismatch, RecomputeUnavailable
from kvbus.codecs.spec import Param
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

#: Metadata key of this stage.
META_KEY = "split"
#: Most prefix tokens (all batch rows) one transfer may ask its receiver to prefill: their ids
#: ride in the `Open`'s metadata (4 bytes each, within its 64 KiB).
MAX_PREFIX_IDS = 8192
#: Largest batch a split transfer may carry.
MAX_BATCH = 64


def prefix_length(fraction: float, n_tokens: int, batch: int = 1) -> int:
    """The prefix a ``split(fraction)`` transfer of ``n_tokens`` recomputes (within `MAX_PREFIX_IDS`)."""
    k = round(fraction * n_tokens)
    return max(0, min(n_tokens, k, MAX_PREFIX_IDS // max(1, batch)))


@register("split")
class SplitCodec(Codec):
    """The first ``prefix`` of the tokens as ids (the receiver prefills them while the rest streams),
    the rest as KV in the inner medium (``full`` unless one is given): ``split(0.6)+int4``.

    Lossless exactly when the inner medium is; the receiver needs the sender's model. The decoded
    context's fidelity is the inner medium's on the suffix (the prefix is recomputed exactly).
    """

    stage = "split"
    params = (Param("prefix", float, 0.5, lo=0.0, hi=1.0),)
    lossless = True
    fidelity = 1.0
    recomputes = True

    inner: Codec
    """The wrapped codec (``full`` unless one is given): never None for a wrapper."""

    def __init__(self, *, inner: Codec | None = None, **args: Any) -> None:
        from kvbus.codecs.base import get_codec

        super().__init__(inner=inner if inner is not None else get_codec("full"), **args)
        self.recomputes = True

    def encode(self, kv: KVCache, *, base: KVCache | None = None, runner: ModelRunner | None = None) -> Encoded:
        """The prefix's ids in the metadata, the rest of ``kv`` in the inner medium.

        Raises:
            SignatureMismatch: ``kv`` does not fit its own signature.
            DecodeError: ``kv`` has no KV (a token-only context: send ``tokens``).
        """
        kv.validate()
        if not kv.has_kv:
            raise DecodeError(self.name, "a token-only context has no KV to split: send it as tokens")
        k = prefix_length(float(self.args["prefix"]), kv.n_tokens, kv.batch)
        idx = torch.nonzero(kv_positions(kv) >= k).view(-1)
        rest = select_entries(kv, idx, tokens=kv.tokens[:, k:], offset=k)
        inner = self.inner.encode(rest, runner=runner)
        ids = kv.tokens[:, :k].to(torch.int32).contiguous()
        meta = dict(inner.meta)
        meta[META_KEY] = {"prefix": k, "batch": kv.batch, "ids": ids.numpy().astype("<i4").tobytes()}
        return Encoded(codec=self.name, meta=meta, buffers=inner.buffers, keepalive=inner.keepalive)

    def prefix_ids(self, meta: Any, vocab_size: int = 0) -> torch.Tensor:
        """The prefix's token ids ``[batch, prefix]`` (int64) named by ``meta``, checked.

        Raises:
            DecodeError: the field is missing or malformed, sizes disagree, or an id is outside
                ``vocab_size`` (0: unchecked).
        """
        own = meta.get(META_KEY) if isinstance(meta, Mapping) else None
        if not isinstance(own, Mapping):
            raise DecodeError(self.name, f"metadata field {META_KEY!r} is missing or not a map")
        k = meta_int(own, "prefix", self.name, 0, MAX_PREFIX_IDS)
        batch = meta_int(own, "batch", self.name, 1, MAX_BATCH)
        raw = own.get("ids")
        if not isinstance(raw, (bytes, bytearray)):
            raise DecodeError(self.name, f"metadata field 'ids' must be bytes, got {type(raw).__name__}")
        if k * batch > MAX_PREFIX_IDS:
            raise DecodeError(self.name, f"a prefix of {batch} x {k} ids is over the limit of {MAX_PREFIX_IDS}")
        if len(raw) != 4 * k * batch:
            raise DecodeError(self.name, f"'ids' holds {len(raw)} bytes, {batch} x {k} int32 ids take {4 * k * batch}")
        if k:
            tokens = torch.frombuffer(bytearray(raw), dtype=torch.int32).to(torch.int64).view(batch, k)
        else:  # frombuffer refuses an empty buffer
            tokens = torch.zeros((batch, 0), dtype=torch.int64)
        check_tokens(tokens, vocab_size, self.name)
        return tokens

    def prepare(self, meta: Any, runner: ModelRunner | None) -> Callable[[], KVCache] | None:
        """The prefill of the prefix, to run while the suffix streams in (None without a runner
        or for an empty prefix: `decode` then does what is needed). The metadata is checked either way.

        Raises:
            DecodeError: the metadata is malformed.
        """
        tokens = self.prefix_ids(meta, runner.signature.vocab_size if runner is not None else 0)
        if runner is None or tokens.shape[1] == 0:
            return None
        return lambda: _prefill(runner, tokens)

    def decode(self, encoded: Encoded, *, base: KVCache | None = None, runner: ModelRunner | None = None) -> KVCache:
        """Decode the suffix and join it to the prefix's KV: ``base`` when it holds exactly the
        prefix's tokens with their KV (the receiver's prefill from `prepare`, or an earlier context
        from the sender that starts the same way), else a prefill by ``runner`` now.

        Raises:
            DecodeError: the payload or metadata is malformed.
            RecomputeUnavailable: the prefix must be recomputed and there is no ``runner``.
        """
        vocab = runner.signature.vocab_size if runner is not None else 0
        prefix = self.prefix_ids(encoded.meta, vocab)
        k, batch = prefix.shape[1], prefix.shape[0]
        inner_meta = {key: v for key, v in encoded.meta.items() if key != META_KEY}
        rest = self.inner.decode(replace(encoded, codec=self.inner.name, meta=inner_meta))
        if rest.batch != batch:
            raise DecodeError(self.name, f"the prefix has batch {batch}, the rest {rest.batch}")
        if k == 0:
            return rest
        if not _holds(base, prefix):
            if runner is None:
                raise RecomputeUnavailable(self.name)
            base = _prefill(runner, prefix)
        assert base is not None
        if not base.signature.compatible_with(rest.signature):
            raise DecodeError(
                self.name, f"the prefix was computed by {base.signature.model}, the rest is for {rest.signature.model}"
            )
        try:
            return join_prefix(base, k, rest)
        except DeltaBaseMismatch as exc:
            raise DecodeError(self.name, str(exc)) from None

    def estimate_nbytes(self, signature: ModelSignature, n_tokens: int, batch: int = 1) -> int:
        """The inner medium's size for the tokens after the prefix, and the prefix's ids."""
        k = prefix_length(float(self.args["prefix"]), n_tokens, batch)
        return self.inner.estimate_nbytes(signature, n_tokens - k, batch) + 4 * k * batch


def _prefill(runner: ModelRunner, tokens: torch.Tensor) -> KVCache:
    kv = runner.prefill(tokens)
    kv.fidelity = 1.0
    return kv


def _holds(base: KVCache | None, prefix: torch.Tensor) -> bool:
    """Whether ``base`` starts with exactly ``prefix``'s tokens and has their KV."""
    if base is None or not base.has_kv or base.batch != prefix.shape[0]:
        return False
    k = prefix.shape[1]
    return base.n_tokens >= k and coverage(base) >= k and torch.equal(base.tokens[:, :k].to(torch.int64), prefix)
