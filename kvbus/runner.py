"""`HFRunner`: a `transformers` causal LM behind the `ModelRunner` protocol.

Note on `transformers` 5: the forward keyword for a KV-cache is ``cache=`` and the model output
holds it under ``.cache`` (``past_key_values`` is gone).
"""

from __future__ import annotations

from typing import Any

import torch

from kvbus.errors import GenerationError
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature


class HFRunner:
    """Prefill and greedy generation for a `transformers` causal LM, in `KVCache` terms.

    Implements `kvbus.codecs.ModelRunner`. Results computed under ``torch.inference_mode``
    are inference tensors: read them freely, but do not modify them in place.
    """

    def __init__(self, model: Any, *, name: str, tokenizer: Any = None) -> None:
        """Wrap ``model``.

        Args:
            model: a `transformers` causal LM (``...ForCausalLM``), in eval mode.
            name: the model name in its signature: caches are exchanged only between runners
                with the same name and geometry, so it must identify the weights.
            tokenizer: the model's tokenizer, kept for callers (the runner itself works on ids).
        """
        self.model = model
        self.name = name
        self.tokenizer = tokenizer
        self.signature: ModelSignature = ModelSignature.from_hf_config(model.config, model=name, dtype=model.dtype)

    def __repr__(self) -> str:
        return f"<HFRunner {self.name!r} {self.signature.n_layers}x{self.signature.n_kv_heads}x{self.signature.head_dim}>"

    def _ids(self, tokens: torch.Tensor) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point or tokens.dim() not in (1, 2):
            raise GenerationError(f"token ids must be an integer tensor [batch, n], got {tokens!r:.80}")
        ids = tokens.to(torch.int64)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        vocab = self.signature.vocab_size
        if ids.numel() and (int(ids.min()) < 0 or (vocab and int(ids.max()) >= vocab)):
            raise GenerationError(f"token ids must lie in 0..{vocab - 1}")
        return ids

    def prefill(self, tokens: torch.Tensor) -> KVCache:
        """Run the model over ``tokens`` ``[batch, n]`` (or ``[n]``) and return their KV-cache.

        An empty sequence gives a token-only cache.

        Raises:
            GenerationError: the token ids are not integers in the vocabulary.
        """
        ids = self._ids(tokens)
        if ids.shape[1] == 0:
            return KVCache(tokens=ids, signature=self.signature)
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True)
        return KVCache.from_hf(out.cache, ids, self.model.config, model=self.name)

    def generate(self, kv: KVCache, max_new_tokens: int, *, eos_token_id: int | None = None) -> torch.Tensor:
        """Greedy continuation of the context ``kv``.

        Whatever KV ``kv`` holds is reused: if it covers every token, its last position is
        dropped and the last token fed again (its logits are needed); if it covers a prefix, the
        uncovered tail is fed; a token-only context is prefilled in full.

        Args:
            kv: the context; its KV, if any, must fit this runner's signature.
            max_new_tokens: how many tokens to generate.
            eos_token_id: stop early once every sequence has produced it (``None``: never).

        Returns:
            The new token ids ``[batch, k]`` (int64), ``k <= max_new_tokens``.

        Raises:
            GenerationError: the context has no tokens, holds a sparsified KV, or the count is negative.
            SignatureMismatch: the KV was made by an incompatible model.
        """
        if max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens={max_new_tokens} is negative")
        ids = self._ids(kv.tokens)
        batch, n = ids.shape
        if n == 0:
            raise GenerationError("the context has no tokens to continue from")
        if kv.positions is not None:
            raise GenerationError("a sparsified cache (with explicit positions) cannot be continued")
        if kv.has_kv:
            kv.validate(self.signature)
        if max_new_tokens == 0:
            return ids.new_empty((batch, 0))
        covered = min(kv.seq_len, n - 1)
        cache = None
        if covered:
            cache = kv.slice(0, covered).to(self.model.dtype).to_hf(self.model.config)
        feed = ids[:, covered:]
        new: list[torch.Tensor] = []
        done = torch.zeros(batch, dtype=torch.bool)
        with torch.inference_mode():
            for _ in range(max_new_tokens):
                out = self.model(input_ids=feed, cache=cache, use_cache=True, logits_to_keep=1)
                cache = out.cache
                feed = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
                new.append(feed)
                if eos_token_id is not None:
                    done |= feed[:, 0] == eos_token_id
                    if bool(done.all()):
                        break
        return torch.cat(new, dim=1)
