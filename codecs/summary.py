"""The `summary` medium, the most lossy of all: the sender's model writes a short summary, the receiver prefills it.

Nothing of the original context travels, only the summary's token ids (and its text, when the
summariser has a tokenizer, so that a receiver with another tokenizer can re-tokenise it). Use
it between models that cannot share KV and when the context is far longer than what the
receiver needs; its fidelity factor is the lowest of all media.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from kvbus.codecs._header import KVHeader, encode_buffers
from kvbus.codecs._tensors import check_buffer_count, check_tokens, meta_int, require_map
from kvbus.codecs.base import Codec, Encoded, GeneratingRunner, ModelRunner, register
from kvbus.codecs.errors import DecodeError, SummaryUnavailable
from kvbus.codecs.spec import Param
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

#: Metadata key of this medium.
META_KEY = "summary"
#: What the default summariser appends to the context to ask for a summary.
INSTRUCTION = "\n\nSummarize everything above in a few short sentences, keeping names, numbers and decisions.\nSummary:"
#: What the summary sent is prefixed with, so the receiver's model reads it as a summary.
PREFIX = "Summary of the earlier context: "
#: Longest summary text carried (bytes of UTF-8).
MAX_TEXT_BYTES = 1 << 16


@runtime_checkable
class Summarizer(Protocol):
    """Writes a summary of a context as token ids (the receiver prefills exactly these)."""

    def summarize(self, kv: KVCache, runner: ModelRunner | None, max_tokens: int) -> tuple[torch.Tensor, str | None]:
        """Return ``(token ids [batch, m] int64 with m <= max_tokens, text or None)``.

        Raises:
            SummaryUnavailable: this summariser cannot work with ``runner``.
        """
        ...


class ModelSummarizer:
    """The default: the sender's own model, asked in plain words, generates the summary greedily.

    Appends `INSTRUCTION` to the context (its KV is reused: only the instruction is prefilled)
    and generates up to ``max_tokens`` tokens, stopping at the end-of-sequence token. Needs a
    runner with ``generate`` and a ``tokenizer`` (an `HFRunner`), or explicit instruction ids.
    """

    def __init__(
        self,
        instruction: str = INSTRUCTION,
        prefix: str = PREFIX,
        *,
        instruction_ids: torch.Tensor | None = None,
        prefix_ids: torch.Tensor | None = None,
    ) -> None:
        self.instruction = instruction
        self.prefix = prefix
        self.instruction_ids = instruction_ids
        self.prefix_ids = prefix_ids

    def summarize(self, kv: KVCache, runner: ModelRunner | None, max_tokens: int) -> tuple[torch.Tensor, str | None]:
        """Append the instruction to the context, generate greedily and return the prefixed summary.

        Raises:
            SummaryUnavailable: no runner with ``generate``, or no tokenizer for a text that has no ids.
        """
        if runner is None or not isinstance(runner, GeneratingRunner):
            raise SummaryUnavailable("the default summariser needs the sender's model runner (with generate)")
        tokenizer = getattr(runner, "tokenizer", None)
        if self.instruction_ids is None and tokenizer is None:
            raise SummaryUnavailable("the sender's runner has no tokenizer to phrase the request")

        def ids(text: str, given: torch.Tensor | None) -> torch.Tensor:
            if given is not None:
                return given.to(torch.int64).view(1, -1)
            if tokenizer is None:  # instruction ids given, but the prefix is text
                raise SummaryUnavailable("the sender's runner has no tokenizer to phrase the summary's prefix")
            return torch.tensor([tokenizer.encode(text, add_special_tokens=False)], dtype=torch.int64)

        batch = kv.batch
        ask = ids(self.instruction, self.instruction_ids).expand(batch, -1)
        context = KVCache(
            tokens=torch.cat([kv.tokens.to(torch.int64), ask], dim=1),
            signature=kv.signature,
            keys=kv.keys,
            values=kv.values,
            positions=kv.positions,
            fidelity=kv.fidelity,
        )
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        prefix = ids(self.prefix, self.prefix_ids).expand(batch, -1)
        budget = max(1, max_tokens - prefix.shape[1])
        new = runner.generate(context, budget, eos_token_id=eos)
        if eos is not None and batch == 1:
            hits = torch.nonzero(new[0] == eos)
            if hits.numel():
                new = new[:, : int(hits[0])]
        out = torch.cat([prefix, new], dim=1)[:, :max_tokens]
        text = tokenizer.decode(out[0], skip_special_tokens=True) if tokenizer is not None and batch == 1 else None
        return out, text


class TailSummarizer:
    """A model-free stand-in: the last ``max_tokens`` tokens of the context (for tests and token-only senders)."""

    def summarize(self, kv: KVCache, runner: ModelRunner | None, max_tokens: int) -> tuple[torch.Tensor, str | None]:
        """The last ``max_tokens`` token ids of the context, and no text."""
        return kv.tokens[:, max(0, kv.n_tokens - max_tokens) :].to(torch.int64), None


@register("summary")
class SummaryCodec(Codec):
    """A short summary by the sender's model, prefilled by the receiver. The most lossy medium.

    Encoding needs the sender's runner (``encode(kv, runner=...)``) for the default
    `ModelSummarizer`; pass another `Summarizer` to the constructor to change how summaries are
    written. Decoding with a runner prefills the summary; without one it gives a token-only
    context of the summary.

    Spec: ``summary`` or ``summary(tokens)`` / ``summary(tokens=128)`` (the longest summary).

    Wire layout: ``[summary token ids int64, summary text utf-8]``.
    """

    stage = "summary"
    params = (Param("tokens", int, 64, lo=1, hi=4096),)
    lossless = False
    needs_kv = False
    fidelity = 0.05

    def __init__(self, *, summarizer: Summarizer | None = None, **args: Any) -> None:
        super().__init__(**args)
        self.summarizer: Summarizer = summarizer if summarizer is not None else ModelSummarizer()

    def encode(self, kv: KVCache, *, base: KVCache | None = None, runner: ModelRunner | None = None) -> Encoded:
        """Summarise ``kv`` with the sender's ``runner``.

        Raises:
            SummaryUnavailable: the summariser cannot run (no runner, no tokenizer).
            SignatureMismatch: ``kv`` does not fit its own signature.
        """
        kv.validate()
        if kv.n_tokens == 0:
            ids, text = kv.tokens.to(torch.int64), None
        else:
            ids, text = self.summarizer.summarize(kv, runner, self.args["tokens"])
        ids = ids[:, : self.args["tokens"]].to(torch.int64).contiguous()
        raw = (text or "").encode("utf-8")[:MAX_TEXT_BYTES]
        summary = KVCache(tokens=ids, signature=kv.signature, fidelity=kv.fidelity)
        header = KVHeader.of(summary)
        tensors = header.prefix_tensors(summary)
        meta = header.to_meta()
        meta[META_KEY] = {"source_tokens": kv.n_tokens}
        buffers = [*encode_buffers(tensors), memoryview(raw)]
        return Encoded(codec=self.name, meta=meta, buffers=buffers, keepalive=[*tensors, raw])

    def decode(self, encoded: Encoded, *, base: KVCache | None = None, runner: ModelRunner | None = None) -> KVCache:
        """The summary as the receiver's context: prefilled by ``runner`` if given, else token-only.

        When the receiver's model differs from the sender's and has a tokenizer, the summary
        text is re-tokenised with it.

        Raises:
            DecodeError: the metadata or a buffer is malformed.
        """
        meta = require_map(encoded.meta, self.name)
        own = meta.get(META_KEY)
        if not isinstance(own, dict):
            raise DecodeError(self.name, f"metadata field {META_KEY!r} is missing or not a map")
        meta_int(own, "source_tokens", self.name, 0, 1 << 40)
        header = KVHeader.from_meta(meta, self.name)
        if header.n_layers:
            raise DecodeError(self.name, f"carries no KV, but the metadata says layers={header.n_layers}")
        if header.n_tokens > self.args["tokens"]:
            raise DecodeError(
                self.name, f"{header.n_tokens} summary tokens, more than the {self.args['tokens']} the spec allows"
            )
        buffers = check_buffer_count(encoded.buffers, 2, self.name)
        tokens, _ = header.read_prefix(buffers[:1], self.name)
        if buffers[1].nbytes > MAX_TEXT_BYTES:
            raise DecodeError(self.name, f"summary text of {buffers[1].nbytes} bytes, more than {MAX_TEXT_BYTES}")
        try:
            text = bytes(buffers[1]).decode("utf-8")
        except UnicodeDecodeError:
            raise DecodeError(self.name, "summary text is not UTF-8") from None
        fidelity = header.fidelity * self.fidelity
        if runner is None:
            return header.finish(KVCache(tokens=tokens, signature=header.signature, fidelity=fidelity), self.name)
        tokenizer = getattr(runner, "tokenizer", None)
        if text and tokenizer is not None and not header.signature.compatible_with(runner.signature):
            tokens = torch.tensor([tokenizer.encode(text, add_special_tokens=False)], dtype=torch.int64)
            tokens = tokens.expand(header.batch, -1).contiguous()
        check_tokens(tokens, runner.signature.vocab_size, self.name)
        kv = runner.prefill(tokens)
        kv.fidelity = fidelity
        return kv

    def estimate_nbytes(self, signature: ModelSignature, n_tokens: int, batch: int = 1) -> int:
        """At most ``tokens`` token ids (8 bytes each) plus about 4 bytes of text per token."""
        tokens: int = self.args["tokens"]
        return batch * min(n_tokens, tokens) * 12
