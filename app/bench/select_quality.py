"""What `kvbus bench select` judges with, measured here and not taken from the calibration profile
the selector uses: real SmolLM2 contexts of held-out text (``data/select_heldout.txt``, written
for this bench, not among the calibration texts), the fidelity of each medium on them, and the
model's decode time per token on this machine now.

The fidelity of a medium at a context length is measured as calibration defines it (top-1
agreement times exp(-KL) of the next-token predictions over the following 128 tokens of the text,
the length of the answer the penalty charges, against the lossless context) but on other text, at
the cell's context length, with the codec run here end to end, averaged over up to `WINDOWS`
windows of the text; the penalty a medium pays in the objective is
``loss_weight * output_tokens * (1 - fidelity) * decode_token_s``, all three measured or set here.
"""

from __future__ import annotations

import math
import statistics
import time
from importlib import resources
from typing import Any

import torch

from kvbus.app.calibrate import _wire, compare
from kvbus.codecs import get_codec
from kvbus.kvcache import KVCache

#: Tokens of the continuation the predictions are scored on: `OUTPUT_TOKENS`, the answer the
#: penalty charges for. (32 made one flipped greedy token a fidelity loss of 0.031, the whole
#: difference between int8 and full at 256 tokens in one stored run.)
FOLLOWING = 128
#: Tokens the receiver is expected to generate after a transfer (the cost model's default too).
OUTPUT_TOKENS = 128
#: Windows of held-out text a medium's fidelity at a context length is averaged over: contexts of
#: that length starting `FOLLOWING` tokens apart, each scored on its own following tokens (as many
#: as the text gives, at most this many). On one window a single flipped token is a fidelity loss
#: of 1/128, which at this machine's decode speed (~0.07 s per token) charged int8 68 ms in the
#: objective: more than a whole `full` transfer at 10 Gbit/s.
WINDOWS = 8
#: Timings of 8 decoded tokens whose median is the penalty's decode time per token.
DECODE_TIMINGS = 5


def heldout_ids(tokenizer: Any) -> torch.Tensor:
    """The held-out text as token ids ``[1, n]``."""
    text = resources.files("kvbus.app.bench").joinpath("data").joinpath("select_heldout.txt").read_text()
    return torch.tensor([tokenizer.encode(text, add_special_tokens=False)], dtype=torch.int64)


class Quality:
    """Real contexts, measured fidelity per (medium, context length) and the measured decode time."""

    def __init__(self, runner: Any, tokenizer: Any, *, loss_weight: float = 1.0, windows: int = WINDOWS) -> None:
        self.runner = runner
        self.windows = max(1, windows)
        """Windows each fidelity is averaged over (at most; `WINDOWS`)."""
        self.ids = heldout_ids(tokenizer)
        self.loss_weight = loss_weight
        self._contexts: dict[int, tuple[KVCache, torch.Tensor, torch.Tensor]] = {}
        self._more: dict[int, list[tuple[KVCache, torch.Tensor, torch.Tensor]]] = {}
        """Per context length: the windows after the first (`_windows`)."""
        self.fidelity: dict[tuple[str, int], dict[str, float]] = {}
        kv = runner.prefill(self.ids[:, :64])
        runner.generate(kv, 4)  # warm-up
        # The median of several timings: one, taken while another process ran, once set the
        # penalty's decode time at 0.30 s per token (0.06 s idle) for the whole run.
        per_token = []
        for _ in range(DECODE_TIMINGS):
            t = time.perf_counter()
            new = runner.generate(kv, 8)
            per_token.append((time.perf_counter() - t) / max(1, new.shape[-1]))
        self.decode_token_s = statistics.median(per_token)
        self.decode_token_s_timings = [round(x, 5) for x in per_token]
        self.measured_at = time.strftime("%Y-%m-%dT%H:%M:%S")

    @property
    def max_context(self) -> int:
        """The longest context the held-out text gives (with its following tokens)."""
        return int(self.ids.shape[-1]) - FOLLOWING

    def context(self, n: int) -> KVCache:
        """The first ``n`` tokens of the held-out text, prefilled by the model (a real KV-cache)."""
        return self._entry(n)[0]

    def _entry(self, n: int) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
        if n > self.max_context:
            raise ValueError(f"the held-out text has {self.max_context} tokens of context at most, not {n}")
        if n not in self._contexts:
            self._contexts[n] = self._window(0, n)
        return self._contexts[n]

    def _window(self, start: int, n: int) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
        """The ``n`` tokens from ``start`` prefilled, their `FOLLOWING` tokens, and the lossless
        predictions on those."""
        kv = self.runner.prefill(self.ids[:, start : start + n])
        following = self.ids[:, start + n : start + n + FOLLOWING]
        return kv, following, self.runner.score(kv, following)

    def _windows(self, n: int) -> list[tuple[KVCache, torch.Tensor, torch.Tensor]]:
        """Up to ``windows`` contexts of ``n`` tokens (the first is `context`), `FOLLOWING` tokens
        apart, with their following tokens and the lossless predictions on them."""
        out = [self._entry(n)]
        if n not in self._more:
            more: list[tuple[KVCache, torch.Tensor, torch.Tensor]] = []
            for start in range(FOLLOWING, int(self.ids.shape[-1]) - n - FOLLOWING + 1, FOLLOWING):
                if len(more) + 1 >= self.windows:
                    break
                more.append(self._window(start, n))
            self._more[n] = more
        return out + self._more[n]

    def of(self, medium: str, n: int) -> dict[str, float]:
        """``{"top1", "kl", "fidelity", "windows"}`` of ``medium`` at context length ``n``: the means
        over the held-out windows of that length (`WINDOWS`; measured once)."""
        codec = get_codec(medium)
        key = (codec.name, n)
        if key not in self.fidelity:
            if codec.lossless:
                self.fidelity[key] = {"top1": 1.0, "kl": 0.0, "fidelity": 1.0, "windows": 1}
            else:
                scores = [
                    self.score(self.of_window(medium, kv), n, ref=ref, following=following)
                    for kv, following, ref in self._windows(n)
                ]
                self.fidelity[key] = {
                    **{k: round(sum(x[k] for x in scores) / len(scores), 6) for k in ("top1", "kl", "fidelity")},
                    "windows": len(scores),
                }
        return self.fidelity[key]

    def of_window(self, medium: str, kv: KVCache) -> KVCache:
        """``kv`` as a receiver gets it sent with ``medium`` (encoded, through wire bytes, decoded)."""
        codec = get_codec(medium)
        return codec.decode(_wire(codec.encode(kv, runner=self.runner)), runner=self.runner)

    def score(
        self, got: KVCache, n: int, *, ref: torch.Tensor | None = None, following: torch.Tensor | None = None
    ) -> dict[str, float]:
        """Fidelity of a received context ``got`` against the lossless context of length ``n``."""
        if ref is None or following is None:
            _, following, ref = self._entry(n)
        kl, top1, _ = compare(ref, self.runner.score(got, following), following)
        return {"top1": round(top1, 4), "kl": round(kl, 6), "fidelity": round(top1 * math.exp(-kl), 4)}

    def loss_s(self, medium: str, n: int) -> float:
        """The objective's penalty for ``medium`` at ``n`` tokens (measured fidelity and decode time)."""
        f = float(self.of(medium, n)["fidelity"])
        return float(self.loss_weight * OUTPUT_TOKENS * (1.0 - f) * self.decode_token_s)

    def table(self) -> dict[str, dict[str, dict[str, float]]]:
        """Every measured fidelity: medium -> context length -> figures."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (medium, n), figs in sorted(self.fidelity.items()):
            out.setdefault(medium, {})[str(n)] = figs
        return out
