"""Never slower than prefilling: a pull is made only when it is predicted to cost less than the prefill it saves.

The worker-side half measures both sides on its own engine:

- **prefill speed**: every forward step that computed at least `MIN_STEP_TOKENS` tokens (and
  loaded nothing) gives a time per token (`PullGate.record_step`); the median of the recent
  ones prices a prefill of ``n`` tokens as ``n`` times it;
- **pull cost**: every finished pull or cache-tier load gives ``(tokens, seconds)``, from its
  start before a forward to the step that wrote it (`PullGate.record_load`). A load of ``n``
  tokens is priced from each recent sample ``(n_i, s_i)`` as ``s_i * max(1, n / n_i)`` (the
  median over samples): never cheaper than a measured pull of more tokens, and growing
  linearly from a measured pull of fewer. Both extrapolations over-estimate the cost (a pull
  has a fixed part), so the gate errs towards prefilling.

Before any pull was measured the cost is ``prior_s`` (the config's ``pull_overhead_s``); before
the engine's prefill speed was measured every pull is allowed (there is nothing to compare with).
`PullGate.decide` returns whether to pull and the two estimates; the lookup then answers no
remote tokens for a pull that is not worth it, and the engine prefills as it would without kvbus.
A local load (a context already in the engine's own store) is a copy and always worth it.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass

#: Smallest forward step (tokens computed) that counts as a prefill sample: decode steps of a
#: few tokens are dominated by fixed per-step costs and would overstate the per-token time.
MIN_STEP_TOKENS = 64
#: How many recent samples of each kind are kept.
WINDOW = 16
#: Default cost of a pull before any was measured (seconds): the lookup round trips, the
#: transfer's grant and the one engine step a request waits for its KV.
DEFAULT_PRIOR_S = 0.3


@dataclass(frozen=True, slots=True)
class Decision:
    """Whether to load ``tokens`` from kvbus, and why."""

    pull: bool
    tokens: int
    prefill_s: float | None
    """Predicted seconds to prefill those tokens (None: the engine's speed is not measured yet)."""
    load_s: float
    """Predicted seconds to load them."""

    @property
    def reason(self) -> str:
        """One line for the log."""
        if self.prefill_s is None:
            return "prefill speed not measured yet"
        verb = "<" if self.pull else ">="
        return f"load {self.load_s:.3f} s {verb} prefill {self.prefill_s:.3f} s"


class PullGate:
    """Measured prefill speed and pull cost of one engine; decides whether a pull pays."""

    def __init__(self, *, prior_s: float = DEFAULT_PRIOR_S, window: int = WINDOW) -> None:
        if not prior_s >= 0.0:
            raise ValueError(f"prior_s must be >= 0, got {prior_s!r}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        self.prior_s = float(prior_s)
        self._lock = threading.Lock()  # recorded on vLLM's thread, read on the agent's loop
        self._per_token: deque[float] = deque(maxlen=window)
        self._loads: deque[tuple[int, float]] = deque(maxlen=window)

    def record_step(self, tokens: int, seconds: float) -> None:
        """A forward step that computed ``tokens`` tokens in ``seconds`` (small steps are ignored)."""
        if tokens >= MIN_STEP_TOKENS and seconds > 0.0:
            with self._lock:
                self._per_token.append(seconds / tokens)

    def record_load(self, tokens: int, seconds: float) -> None:
        """A pull or cache-tier load of ``tokens`` tokens that took ``seconds`` until written."""
        if tokens > 0 and seconds >= 0.0:
            with self._lock:
                self._loads.append((int(tokens), float(seconds)))

    def prefill_s(self, tokens: int) -> float | None:
        """Predicted prefill time of ``tokens`` tokens on this engine (None before a measurement)."""
        with self._lock:
            samples = list(self._per_token)
        return statistics.median(samples) * tokens if samples else None

    def load_s(self, tokens: int) -> float:
        """Predicted time to load ``tokens`` tokens from another agent (see the module docstring)."""
        with self._lock:
            loads = list(self._loads)
        if not loads:
            return self.prior_s
        return statistics.median(s * max(1.0, tokens / n) for n, s in loads)

    def decide(self, tokens: int) -> Decision:
        """Load ``tokens`` tokens from kvbus only if that is predicted faster than prefilling them."""
        prefill = self.prefill_s(tokens)
        load = self.load_s(tokens)
        return Decision(
            pull=tokens > 0 and (prefill is None or load < prefill), tokens=tokens, prefill_s=prefill, load_s=load
        )

    def snapshot(self) -> dict[str, float | int | None]:
        """The estimates for events and logs."""
        with self._lock:
            per_token, loads = list(self._per_token), len(self._loads)
        return {
            "prefill_s_per_token": statistics.median(per_token) if per_token else None,
            "prefill_samples": len(per_token),
            "load_samples": loads,
        }
