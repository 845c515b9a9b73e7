"""`HFRunner`: a `transformers` causal LM behind the `ModelRunner` protocol (the Hugging Face model adapter).

Note on `transformers` 5: recent releases (5.24 here) take a KV-cache as ``cache=`` and return
it as ``.cache``; 5.19, which the ``[vllm]`` extra pins (vLLM 0.32 needs ``<5.20``), still calls
both ``past_key_values``. `_forward` and `output_cache` speak whichever the installed version does.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from kvbus.errors import GenerationError, SignatureMismatch
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature


@functools.cache
def _cache_keyword(forward: Any) -> str:
    """The keyword a model's forward takes its KV-cache by: ``cache`` (recent transformers) or ``past_key_values``."""
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "cache"
    return "cache" if "cache" in params or "past_key_values" not in params else "past_key_values"


def _forward(module: Any, cache: Any, **kwargs: Any) -> Any:
    """``module(**kwargs)`` with ``cache`` passed under the installed transformers' keyword."""
    return module(**kwargs, **{_cache_keyword(type(module).forward): cache})


def output_cache(out: Any) -> Any:
    """The KV-cache of a model output (``.cache``, or ``.past_key_values`` in older transformers 5 releases)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


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
        return (
            f"<HFRunner {self.name!r} {self.signature.n_layers}x{self.signature.n_kv_heads}x{self.signature.head_dim}>"
        )

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

    def prefill(self, tokens: torch.Tensor, *, out: KVCache | None = None) -> KVCache:
        """Run the model over ``tokens`` ``[batch, n]`` (or ``[n]``) and return their KV-cache.

        An empty sequence gives a token-only cache.

        Args:
            out: a cache to write the result into and return, of this model, ``n`` tokens and
                ``batch`` rows: an `Agent.kv_buffer` (``agent.kv_buffer(n)``), whose ``full``
                transfer to an agent of this host then copies no byte (the prefill's KV is
                copied into it once, at memory speed).

        Raises:
            GenerationError: the token ids are not integers in the vocabulary.
            SignatureMismatch: ``out`` is for another model, or not of the tokens' batch and
                length, or not in the model's dtype (checked before the model runs).
        """
        ids = self._ids(tokens)
        if out is not None:
            self._check_out(out, ids)
        if ids.shape[1] == 0:
            return KVCache(tokens=ids, signature=self.signature)
        with torch.inference_mode():
            result = self.model(input_ids=ids, use_cache=True)
        kv = KVCache.from_hf(output_cache(result), ids, self.model.config, model=self.name)
        if out is None:
            return kv
        out.tokens.copy_(ids)
        for dst, src in zip((*out.keys, *out.values), (*kv.keys, *kv.values), strict=True):
            dst.copy_(src)
        return out

    def _check_out(self, out: KVCache, ids: torch.Tensor) -> None:
        """That ``out`` can hold the prefill of ``ids``: this model's layers, their batch and length, its dtype."""
        sig = self.signature
        want = (ids.shape[0], sig.n_kv_heads, ids.shape[1], sig.head_dim)
        if out.positions is not None or not out.keys:
            raise SignatureMismatch(f"a cache of {sig.n_layers} dense layers", "a sparse or token-only cache")
        out.validate(sig)
        got = out.keys[0]
        if tuple(out.tokens.shape) != tuple(ids.shape) or tuple(got.shape) != want:
            raise SignatureMismatch(
                f"tokens {list(ids.shape)} and layers {list(want)}",
                f"tokens {list(out.tokens.shape)} and layers {list(got.shape)}",
            )
        if got.dtype != self.model.dtype or out.tokens.dtype != torch.int64:
            raise SignatureMismatch(f"{self.model.dtype} layers, int64 tokens", f"{got.dtype}, {out.tokens.dtype}")

    def _resume(self, kv: KVCache) -> tuple[Any, torch.Tensor, int]:
        """The `transformers` cache to continue ``kv`` from, the ids still to feed, and their first position.

        Whatever KV ``kv`` holds is reused: if it covers every token, its last entry is dropped
        and the last token fed again (its logits are needed); if it covers a prefix, the
        uncovered tail is fed. A sparsified cache (explicit positions) is continued at the true
        positions: its entries keep the rotary positions they were computed at, and the fed
        tokens get ``position_ids`` from where the kept entries end.

        Raises:
            GenerationError: the context has no tokens, or its positions are not strictly
                increasing and below the token count.
            SignatureMismatch: the KV was made by an incompatible model.
        """
        ids = self._ids(kv.tokens)
        n = ids.shape[1]
        if n == 0:
            raise GenerationError("the context has no tokens to continue from")
        if kv.has_kv:
            kv.validate(self.signature)
        if kv.positions is None:
            start = min(kv.seq_len, n - 1)
            part = kv.slice(0, start) if start else None
        else:
            pos = kv.positions.to(torch.int64)
            if pos.numel() and (
                int(pos.min()) < 0 or int(pos.max()) >= n or (pos.numel() > 1 and not bool((pos.diff() > 0).all()))
            ):
                raise GenerationError(f"KV positions must increase strictly within 0..{n - 1}")
            start = min(int(pos.max()) + 1 if pos.numel() else 0, n - 1)
            keep = torch.nonzero(pos < start).view(-1)
            part = (
                KVCache(
                    tokens=ids[:, :start],
                    signature=kv.signature,
                    keys=[k.index_select(2, keep) for k in kv.keys],
                    values=[v.index_select(2, keep) for v in kv.values],
                )
                if keep.numel()
                else None
            )
        cache = part.to(self.model.dtype).to_hf(self.model.config) if part is not None and part.seq_len else None
        return cache, ids[:, start:], start

    def attention_mass(self, kv: KVCache, window: int) -> torch.Tensor | None:
        """How much attention the real queries of the last ``window`` tokens pay to each KV entry.

        SnapKV's observation window with the model's own queries: the last ``window`` tokens
        are run again over the cache of the ones before them, each layer's queries are rebuilt
        from its input hidden states (norm, ``q_proj``, rotary embedding at the true positions)
        and scored against the cached keys. Per layer and head the causal softmax is summed
        over the window; heads and batch are averaged and layers summed: float32 ``[seq]``.
        Nothing about the model is changed (no switch of attention implementation), so this is
        safe while other threads use the model.

        Returns:
            The scores, or ``None`` when the cache is sparsified or has fewer than 2 entries, or
            the model is not a Llama-style decoder (``model.layers[i].self_attn.q_proj``,
            ``input_layernorm``, ``rotary_emb``).
        """
        base = getattr(self.model, "model", None)
        layers = getattr(base, "layers", None)
        rotary = getattr(base, "rotary_emb", None)
        if base is None or layers is None or rotary is None:
            return None
        if kv.positions is not None or kv.seq_len < 2 or not kv.has_kv:
            return None
        if not all(
            hasattr(layer, "input_layernorm") and hasattr(getattr(layer, "self_attn", None), "q_proj")
            for layer in layers
        ):
            return None
        kv.validate(self.signature)
        n = kv.seq_len
        w = min(window, n - 1)
        ids = self._ids(kv.tokens)[:, :n]
        cache = kv.slice(0, n - w).to(self.model.dtype).to_hf(self.model.config)
        positions = torch.arange(n - w, n).unsqueeze(0).expand(ids.shape[0], -1)
        total = torch.zeros(n, dtype=torch.float32)
        mask = torch.ones(w, n, dtype=torch.bool).triu_(n - w + 1)
        with torch.inference_mode():
            out = _forward(
                base,
                cache,
                input_ids=ids[:, n - w :],
                position_ids=positions,
                use_cache=True,
                output_hidden_states=True,
            )
            hidden = out.hidden_states
            cos, sin = rotary(hidden[0], positions)
            cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
            for i, layer in enumerate(layers):
                attn = layer.self_attn
                h = layer.input_layernorm(hidden[i])
                b = h.shape[0]
                d = self.signature.head_dim
                q = attn.q_proj(h).view(b, w, -1, d).transpose(1, 2)
                if hasattr(attn, "q_norm"):
                    q = attn.q_norm(q)
                q = q.float()
                half = d // 2
                rotated = torch.cat([-q[..., half:], q[..., :half]], dim=-1)
                q = q * cos + rotated * sin
                k = kv.keys[i].float()
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                scale = getattr(attn, "scaling", d**-0.5)
                logits = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
                logits.masked_fill_(mask, float("-inf"))
                total += logits.softmax(dim=-1).sum(dim=2).mean(dim=(0, 1))
        return total

    def score(self, kv: KVCache, following: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits after the context ``kv``: ``out[:, i]`` predicts ``following[:, i]``.

        The context's KV is reused as `generate` reuses it (so a compressed cache shows its
        effect from the first prediction on). Used to measure the fidelity of media.

        Args:
            kv: the context (its KV, if any, dense or sparsified).
            following: the true continuation ``[batch, T]``.

        Returns:
            float32 logits ``[batch, T, vocab]``.
        """
        cache, feed, start = self._resume(kv)
        nxt = self._ids(following)
        t = nxt.shape[1]
        if t == 0:
            return torch.empty(feed.shape[0], 0, self.signature.vocab_size)
        feed = torch.cat([feed, nxt[:, :-1]], dim=1)
        positions = torch.arange(start, start + feed.shape[1]).unsqueeze(0).expand(feed.shape[0], -1)
        with torch.inference_mode():
            out = _forward(self.model, cache, input_ids=feed, position_ids=positions, use_cache=True, logits_to_keep=t)
        logits: torch.Tensor = out.logits[:, -t:].float()
        return logits

    def generate(self, kv: KVCache, max_new_tokens: int, *, eos_token_id: int | None = None) -> torch.Tensor:
        """Greedy continuation of the context ``kv``.

        Whatever KV ``kv`` holds is reused: if it covers every token, its last position is
        dropped and the last token fed again (its logits are needed); if it covers a prefix, the
        uncovered tail is fed; a token-only context is prefilled in full. A sparsified cache
        (explicit ``positions``, e.g. from ``topk``) continues at the true positions.

        Args:
            kv: the context; its KV, if any, must fit this runner's signature.
            max_new_tokens: how many tokens to generate.
            eos_token_id: stop early once every sequence has produced it (``None``: never).

        Returns:
            The new token ids ``[batch, k]`` (int64), ``k <= max_new_tokens``.

        Raises:
            GenerationError: the context has no tokens, bad positions, or the count is negative.
            SignatureMismatch: the KV was made by an incompatible model.
        """
        new, _ = self._greedy(kv, max_new_tokens, eos_token_id)
        return new

    def continue_context(self, kv: KVCache, max_new_tokens: int, *, eos_token_id: int | None = None) -> KVCache:
        """Like `generate`, but return the grown context: the tokens of ``kv`` followed by the new
        ones, with the KV the model holds after generating (it covers every token but the last
        generated one, whose KV is computed when the context is continued again).

        The lineage is kept: continuing a degraded cache does not make it exact.
        """
        new, cache = self._greedy(kv, max_new_tokens, eos_token_id)
        tokens = torch.cat([self._ids(kv.tokens), new], dim=1)
        if cache is None or kv.positions is not None:
            # Nothing computed (no new tokens), or a sparse cache: hand back tokens only.
            return KVCache(tokens=tokens, signature=self.signature, fidelity=kv.fidelity)
        grown = KVCache.from_hf(cache, tokens, self.model.config, model=self.name)
        grown.fidelity = kv.fidelity
        return grown

    def _greedy(self, kv: KVCache, max_new_tokens: int, eos_token_id: int | None) -> tuple[torch.Tensor, Any]:
        """Greedy decoding from ``kv``: the new tokens and the final `transformers` cache (or None)."""
        if max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens={max_new_tokens} is negative")
        cache, feed, start = self._resume(kv)
        batch = feed.shape[0]
        if max_new_tokens == 0:
            return feed.new_empty((batch, 0)), cache
        sparse = kv.positions is not None
        new: list[torch.Tensor] = []
        done = torch.zeros(batch, dtype=torch.bool)
        with torch.inference_mode():
            for _ in range(max_new_tokens):
                extra = {}
                if sparse:
                    extra["position_ids"] = torch.arange(start, start + feed.shape[1]).unsqueeze(0).expand(batch, -1)
                    start += feed.shape[1]
                out = _forward(self.model, cache, input_ids=feed, use_cache=True, logits_to_keep=1, **extra)
                cache = output_cache(out)
                feed = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
                new.append(feed)
                if eos_token_id is not None:
                    done |= feed[:, 0] == eos_token_id
                    if bool(done.all()):
                        break
        return torch.cat(new, dim=1), cache
