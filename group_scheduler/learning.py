"""What a group scheduler learns from finished transfers: online corrections of the cost model.

The cost model's physics (bytes over bandwidth, calibrated codec speeds, a prefill rate) is the
prior: it makes a first decision sensible. Every transfer that finishes reports what it took
(`TransferDone`: encode, time on the wire, the slowest receiver's decode), and `LearnedCosts`
corrects each term from it:

- the fixed cost of a transfer per data path (the `Open`, the verdict, per-transfer work: what a
  transfer costs beyond its bytes), from transfers whose bytes are a small part of their time;
- encode and decode per (medium, size class), as a factor on the calibrated speed (kept in log
  space, so one slow outlier moves it as much as one fast one);
- prefill tokens/s per receiver, from ``tokens`` transfers (the receiver's decode is its prefill);
- how often, and how recently, each (medium, size class) was measured: what exploration asks.

Per-byte throughput per (path, link) is the group's sliding-window link estimate
(`kvbus.group_scheduler.state.LinkEstimate`); it is fed the wire time less the learned fixed
cost, so a small transfer's round trips are not read as a slow link.

The state is plain data (`as_dict` / `from_dict`), persisted by `LearnedStore` in JetStream KV,
where the group's reservations live too, so that a restarted scheduler or a standby that takes
over starts from what the group learned.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nats.js.errors import KeyNotFoundError

from kvbus.codecs.spec import medium_spec
from kvbus.net.buckets import transport_bucket
from kvbus.net.transport import Transport
from kvbus.protocol import PathName, packb, unpackb

logger = logging.getLogger(__name__)

#: Upper bounds (bytes of uncompressed context) of the size classes; larger is the last class.
SIZE_CLASS_BOUNDS = (1 << 20, 8 << 20, 64 << 20, 512 << 20)
#: Weight of a new sample in the exponentially weighted averages.
LEARN_WEIGHT = 0.3
#: One sample moves a quantity learned in log space (a speed, a factor) by at most this factor:
#: it is clamped to value/STEP .. value*STEP before it is folded in (with `LEARN_WEIGHT`, a sample
#: 10x off moves it 1.5x). A first sample is judged against the prior the decision used, and
#: taken half way (at most 2x). One outlier (a prefill slowed 10x by another process on the
#: machine) once replaced the prior whole: every later ``tokens`` transfer was predicted 7 s
#: against 0.35 s, past the exploration margin, and never tried again.
MAX_STEP = 4.0
#: A learned factor stays within this range of the prior (1/x .. x): a broken clock or one absurd
#: sample cannot make a medium look free or impossible.
MAX_FACTOR = 50.0
#: Payloads below this many bytes teach the fixed cost of their path, larger ones its link estimate
#: (`kvbus.group_scheduler.state.LinkEstimate`). The two unknowns of a wire time (a cost per transfer,
#: a cost per byte) are told apart by size: a small payload's time is nearly all round trips, a
#: large one's nearly all bytes. Judging by the bytes' *predicted* share instead read a link that
#: had just slowed down as a fixed cost (one int8 transfer on a link that fell from 1 Gbit/s to
#: 25 Mbit/s taught 1.0 s per transfer), and a fixed cost a second too high kept every later
#: ``tokens`` transfer predicted 4x too slow.
SMALL_PAYLOAD_BYTES = 64 * 1024
#: The fixed cost taken off a wire time before it feeds the link estimate is at most this share of it.
FIXED_MAX_SHARE = 0.5
#: Recent prediction errors kept for `prediction_error`.
ERRORS_KEPT = 512
#: Entries kept per table (the oldest measured are dropped past it): the state stays small.
MAX_ENTRIES = 1024
#: JetStream KV bucket of the learned state (key ``<group>.state``).
LEARNED_BUCKET = "kvbus_sched_learned"
#: Version of the stored layout; another version is ignored (the prior applies).
LAYOUT = 1


def size_class(kv_bytes: float) -> int:
    """The size class of a context of ``kv_bytes`` uncompressed bytes (0 = under 1 MB)."""
    for i, bound in enumerate(SIZE_CLASS_BOUNDS):
        if kv_bytes < bound:
            return i
    return len(SIZE_CLASS_BOUNDS)


@dataclass(slots=True)
class Learned:
    """One learned quantity: an exponentially weighted average, its sample count and last time."""

    value: float
    n: int = 1
    ts: float = 0.0
    """Wall-clock time of the last sample."""

    def add(self, sample: float, now: float, *, log: bool = False) -> None:
        """Fold in ``sample`` (``log``: average in log space, the sample first bounded to
        `MAX_STEP` of the value)."""
        if log:
            sample = min(self.value * MAX_STEP, max(self.value / MAX_STEP, sample))
            self.value = math.exp((1 - LEARN_WEIGHT) * math.log(self.value) + LEARN_WEIGHT * math.log(sample))
        else:
            self.value = (1 - LEARN_WEIGHT) * self.value + LEARN_WEIGHT * sample
        self.n += 1
        self.ts = now


@functools.lru_cache(maxsize=1024)
def family(medium: str) -> str:
    """What the learned state keys ``medium`` by: ``split+X`` for every ``split(f)+X`` (the prefix
    the scheduler sized varies from transfer to transfer; the measurements are of the same
    medium), the medium itself otherwise."""
    if not medium.startswith("split("):
        return medium
    try:
        spec = medium_spec(medium)
    except Exception:  # noqa: BLE001 - a malformed name is its own key
        return medium
    return "+".join(("split", *spec.pieces[1:])) if len(spec.pieces) > 1 else "split+full"


#: A ``split`` transfer's rate is a sample of its link only when at least this share of the
#: estimate (or when there is none): a slower one says more about its receiver than its link.
LOWER_BOUND_SHARE = 0.5


@functools.lru_cache(maxsize=1024)
def measures_link(medium: str) -> bool:
    """Whether a transfer of ``medium`` measures its link (and its path's fixed cost): not a
    ``split``, whose receiver prefills the prefix while the bytes come. The prefill holds the
    receiver's GIL between its ops, so the chunks are read late: on the testbed a 5.6 MB
    ``split+full`` over a 10 Gbit/s link took 133 ms to arrive (``full``: 12 ms), and the pair's
    estimate fell from 2987 to 357 Mbit/s; the next transfers went in int8 where full was faster.
    Its rate is still a lower bound of the link's: the loop takes it as a sample where it is at
    least `LOWER_BOUND_SHARE` of the estimate (or there is none), which keeps the estimate of a
    pair that sends only splits from going stale (on a 10 Mbit/s link, where the bytes' time is
    most of it, a split's rate is the link's: without it the estimate expired and the pair's next
    context went as if the link were unmeasured, in int8, 12.9 s against 2.2 s for ``tokens``)."""
    try:
        return medium_spec(medium).outer != "split"
    except Exception:  # noqa: BLE001 - a name the codecs do not parse measures nothing
        return False


def _tokens_per_s(tokens: int, seconds: float, _held: int) -> float:
    """A prefill's plain speed (the ``speed`` of `LearnedCosts.observe_prefill` by default)."""
    return tokens / seconds


def _finite_positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@dataclass(slots=True)
class LearnedCosts:
    """The corrections a group scheduler learned (see the module docstring)."""

    fixed_s: dict[str, Learned] = field(default_factory=dict)
    """Per data path: seconds a transfer costs beyond its bytes."""
    codec: dict[tuple[str, int, str], Learned] = field(default_factory=dict)
    """Per (medium, size class, ``encode`` or ``decode``): measured / calibrated seconds."""
    prefill_tps: dict[str, Learned] = field(default_factory=dict)
    """Per receiver: prefill tokens/s measured from its ``tokens`` deliveries."""
    seen: dict[tuple[str, int], Learned] = field(default_factory=dict)
    """Per (medium, size class): how many transfers finished with it and when the last did (what
    exploration asks; every medium, ``tokens`` included, whose transfers teach no codec speed)."""
    decisions: int = 0
    """Adaptive decisions of the group so far, across restarts (the exploration cap's base)."""
    explorations: int = 0
    """Of those, the ones that explored."""
    recent: deque[tuple[str, float, float]] = field(default_factory=lambda: deque(maxlen=ERRORS_KEPT))
    """(medium, predicted s, measured s) of recent transfers (not persisted)."""
    changes: int = 0
    """Samples folded in since the state was last persisted."""

    # -- reading ------------------------------------------------------------------------------

    def fixed(self, path: str) -> float | None:
        """The learned fixed cost of a transfer on ``path`` (None before its first sample)."""
        got = self.fixed_s.get(path)
        return got.value if got is not None else None

    def factor(self, medium: str, kv_bytes: float, phase: str) -> float | None:
        """Measured / calibrated seconds of ``phase`` (``encode``/``decode``) for ``medium`` at
        this size, or None when never measured."""
        got = self.codec.get((family(medium), size_class(kv_bytes), phase))
        return got.value if got is not None else None

    def prefill(self, receiver: str) -> float | None:
        """The receiver's measured prefill tokens/s (None before a ``tokens`` delivery to it)."""
        got = self.prefill_tps.get(receiver)
        return got.value if got is not None else None

    def measured(self, medium: str, kv_bytes: float) -> tuple[int, float]:
        """(samples, wall time of the last one) of ``medium`` at this size (0, 0.0 when never):
        the transfers that finished with it, or (a state saved before they were counted) its
        codec samples."""
        cls_ = size_class(kv_bytes)
        done = self.seen.get((family(medium), cls_))
        got = [self.codec.get((family(medium), cls_, p)) for p in ("encode", "decode")]
        seen = [g for g in (done, *got) if g is not None]
        if not seen:
            return 0, 0.0
        return max(g.n for g in seen), max(g.ts for g in seen)

    def prediction_error(self) -> dict[str, Any]:
        """Median and p90 of |predicted - measured| / measured over the recent transfers."""
        vals = sorted(abs(p - m) / m for _, p, m in self.recent)
        if not vals:
            return {"n": 0, "median": None, "p90": None}
        return {
            "n": len(vals),
            "median": round(vals[len(vals) // 2], 4),
            "p90": round(vals[min(len(vals) - 1, int(0.9 * len(vals)))], 4),
        }

    # -- learning -----------------------------------------------------------------------------

    def observe_fixed(self, path: str, sample_s: float, now: float | None = None) -> None:
        """A transfer on ``path`` spent ``sample_s`` beyond its bytes."""
        if not math.isfinite(sample_s) or sample_s < 0:
            return
        self._fold(self.fixed_s, path, sample_s, now, log=False)

    def observe_codec(
        self, medium: str, kv_bytes: float, phase: str, measured_s: float, prior_s: float, now: float | None = None
    ) -> None:
        """``phase`` of ``medium`` took ``measured_s`` where the calibrated figures said ``prior_s``."""
        if not (_finite_positive(measured_s) and _finite_positive(prior_s)):
            return
        sample = min(MAX_FACTOR, max(1 / MAX_FACTOR, measured_s / prior_s))
        self._fold(self.codec, (family(medium), size_class(kv_bytes), phase), sample, now, log=True, prior=1.0)

    def observe_prefill(
        self,
        receiver: str,
        tokens: int,
        seconds: float,
        now: float | None = None,
        *,
        prior_tps: float = 0.0,
        speed: Callable[[int, float, int], float] | None = None,
    ) -> None:
        """``receiver`` rebuilt ``tokens`` tokens of KV in ``seconds``; ``prior_tps``: the speed the
        decision predicted it at (a first sample is judged against it); ``speed``: how a timing
        becomes the speed learned (``(tokens, seconds, held) -> tokens/s``; default tokens/seconds)."""
        if tokens <= 0 or not _finite_positive(seconds):
            return
        prior = prior_tps if _finite_positive(prior_tps) else None
        sample = (speed or _tokens_per_s)(tokens, seconds, 0)
        if _finite_positive(sample):
            self._fold(self.prefill_tps, receiver, sample, now, log=True, prior=prior)

    def observe_error(self, medium: str, predicted_s: float, measured_s: float) -> None:
        """How far the prediction of a finished transfer was from what it took."""
        if _finite_positive(predicted_s) and _finite_positive(measured_s):
            self.recent.append((medium, predicted_s, measured_s))

    def observe_transfer(
        self,
        done: Any,
        decision: Mapping[str, Any],
        *,
        kv_bytes: int,
        new_tokens: int,
        bandwidth_bps: float | None,
        teach_codec: bool = True,
        reference_tps: Callable[[int, float, int], float] | None = None,
    ) -> float:
        """Learn from one finished transfer (a `TransferDone` and the decision record it was granted
        with); returns the fixed cost to take off its wire time before the link estimate sees it.

        Args:
            kv_bytes: the context's uncompressed bytes (its size class).
            new_tokens: the tokens the receiver had to rebuild (``tokens``: its prefill's length).
            bandwidth_bps: the pair's bandwidth on the path the bytes took, when known (the bytes'
                own time is taken off a small payload's fixed-cost sample).
            teach_codec: False for a transfer under another's rate budget (its record is the other's).
            reference_tps: ``(tokens, seconds, held) -> tokens/s`` at the calibrated length
                (`ModelCosts.reference_tps`): what a ``tokens`` delivery's prefill is learned as.
                None: its plain tokens/s.
        """
        now = time.time()
        medium = str(done.medium)
        if teach_codec:
            self._count(medium, kv_bytes, now)
        candidate = next((c for c in decision.get("candidates", ()) if c.get("medium") == medium), None)
        prior = candidate.get("prior") if candidate else None
        if teach_codec and isinstance(prior, Mapping):
            kind = medium_spec(medium).kind
            self.observe_codec(medium, kv_bytes, "encode", done.encode_s, prior.get("enc_s", 0.0), now)
            if kind == "tokens":
                if len(done.dst) == 1:
                    terms = candidate.get("terms") if candidate else None
                    predicted = terms.get("recompute_s", 0.0) if isinstance(terms, Mapping) else 0.0
                    speed = reference_tps or _tokens_per_s
                    prior_tps = speed(new_tokens, predicted, 0) if _finite_positive(predicted) else 0.0
                    rx = str(done.dst[0])
                    self.observe_prefill(rx, new_tokens, done.decode_s, now, prior_tps=prior_tps, speed=speed)
            elif kind != "summary" and measures_link(medium):
                # (A split's decode waits for the receiver's prefill of its prefix: not a codec
                # speed, for the reason its wire time is not the link's, `measures_link`.)
                self.observe_codec(medium, kv_bytes, "decode", done.decode_s, prior.get("dec_s", 0.0), now)
            if done.encode_s > 0 or done.decode_s > 0:
                self.observe_error(medium, candidate["comm_s"] + candidate["comp_s"], done.seconds)  # type: ignore[index]
        path = done.path or PathName.NATS
        if 0 < done.nbytes < SMALL_PAYLOAD_BYTES and done.wire_s > 0 and measures_link(medium):
            bytes_s = done.nbytes / bandwidth_bps if bandwidth_bps else 0.0
            self.observe_fixed(path, max(0.0, done.wire_s - bytes_s), now)
        fixed = self.fixed(path)
        return min(fixed, FIXED_MAX_SHARE * done.wire_s) if fixed else 0.0

    def _count(self, medium: str, kv_bytes: float, now: float) -> None:
        """One more finished transfer of ``medium`` at this size (`measured`)."""
        key = (family(medium), size_class(kv_bytes))
        got = self.seen.get(key)
        if got is None:
            self.seen[key] = Learned(1.0, 1, now)
            if len(self.seen) > MAX_ENTRIES:
                del self.seen[min(self.seen, key=lambda k: self.seen[k].ts)]
        else:
            got.n += 1
            got.ts = now
        self.changes += 1

    def _fold(
        self,
        table: dict[Any, Learned],
        key: Any,
        sample: float,
        now: float | None,
        *,
        log: bool,
        prior: float | None = None,
    ) -> None:
        """Fold ``sample`` into ``table[key]`` (a new entry drops the oldest past `MAX_ENTRIES`).

        A new entry of a log-space quantity with a ``prior`` starts half way (geometrically) from
        the prior to the sample bounded to `MAX_STEP` of it; without a prior, at the sample."""
        now = time.time() if now is None else now
        got = table.get(key)
        if got is None:
            if log and prior is not None and _finite_positive(prior):
                bounded = min(prior * MAX_STEP, max(prior / MAX_STEP, sample))
                sample = math.sqrt(prior * bounded)
            table[key] = Learned(sample, 1, now)
            if len(table) > MAX_ENTRIES:
                del table[min(table, key=lambda k: table[k].ts)]
        else:
            got.add(sample, now, log=log)
        self.changes += 1

    # -- persistence --------------------------------------------------------------------------

    def as_dict(self) -> dict[str, Any]:
        """Plain data (what `LearnedStore` writes and the scheduler's snapshot shows)."""
        return {
            "layout": LAYOUT,
            "fixed_s": {p: [v.value, v.n, v.ts] for p, v in self.fixed_s.items()},
            "codec": [[m, c, ph, v.value, v.n, v.ts] for (m, c, ph), v in self.codec.items()],
            "prefill_tps": {r: [v.value, v.n, v.ts] for r, v in self.prefill_tps.items()},
            "seen": [[m, c, v.n, v.ts] for (m, c), v in self.seen.items()],
            "explore": [self.decisions, self.explorations],
        }

    @classmethod
    def from_dict(cls, data: Any) -> LearnedCosts:
        """The state ``as_dict`` wrote; entries that are malformed or out of range are skipped.

        Raises:
            ValueError: ``data`` is not a learned state of this layout.
        """
        if not isinstance(data, dict) or data.get("layout") != LAYOUT:
            raise ValueError(f"not a learned state of layout {LAYOUT}")
        out = cls()

        def entry(raw: Any, *, factor: bool = False) -> Learned | None:
            if not (isinstance(raw, (list, tuple)) and len(raw) == 3):
                return None
            value, n, ts = raw
            if not (_finite_positive(value) or (value == 0 and not factor)) or not isinstance(n, int) or n < 1:
                return None
            if factor and not 1 / MAX_FACTOR <= value <= MAX_FACTOR:
                return None
            return Learned(float(value), n, float(ts) if _finite_positive(ts) else 0.0)

        def table(key: str) -> dict[Any, Any]:
            got = data.get(key)
            return got if isinstance(got, dict) else {}

        codec = data.get("codec")
        for path, raw in table("fixed_s").items():
            got = entry(raw)
            if isinstance(path, str) and got is not None:
                out.fixed_s[path] = got
        for raw in codec if isinstance(codec, list) else []:
            if not (isinstance(raw, (list, tuple)) and len(raw) == 6):
                continue
            medium, cls_, phase, *rest = raw
            got = entry(rest, factor=True)
            ok = isinstance(medium, str) and isinstance(cls_, int) and phase in ("encode", "decode")
            if ok and got is not None and len(out.codec) < MAX_ENTRIES:
                out.codec[(medium, cls_, phase)] = got
        for rx, raw in table("prefill_tps").items():
            got = entry(raw)
            if isinstance(rx, str) and got is not None and got.value > 0 and len(out.prefill_tps) < MAX_ENTRIES:
                out.prefill_tps[rx] = got
        seen = data.get("seen")
        for raw in seen if isinstance(seen, list) else []:
            if not (isinstance(raw, (list, tuple)) and len(raw) == 4):
                continue
            medium, cls_, n, ts = raw
            got = entry([1.0, n, ts])
            if isinstance(medium, str) and isinstance(cls_, int) and got is not None and len(out.seen) < MAX_ENTRIES:
                out.seen[(medium, cls_)] = got
        explore = data.get("explore")
        if isinstance(explore, (list, tuple)) and len(explore) == 2:
            decisions, explorations = explore
            if isinstance(decisions, int) and isinstance(explorations, int) and 0 <= explorations <= decisions:
                out.decisions, out.explorations = decisions, explorations
        return out


class LearnedStore:
    """Persists one group's `LearnedCosts` in JetStream KV (bucket `LEARNED_BUCKET`, key
    ``<group>.state``: a scheduler in secure mode may write only its own group's keys).

    Failures are logged, never raised: the state in memory holds, and a scheduler that cannot
    read it starts from the prior.
    """

    def __init__(self, transport: Transport, group: str) -> None:
        self.transport = transport
        self.group = group
        self._key = f"{group}.state"
        self._bucket: Any = None

    async def _open(self) -> Any:
        if self._bucket is None:
            self._bucket = await transport_bucket(self.transport, LEARNED_BUCKET)
        return self._bucket

    async def save(self, learned: LearnedCosts) -> None:
        """Write ``learned`` (the whole state: it is small)."""
        try:
            bucket = await self._open()
            if bucket is not None:
                await bucket.put(self._key, packb(learned.as_dict()))
                learned.changes = 0
        except Exception:
            logger.warning("group %s: could not persist what the scheduler learned", self.group, exc_info=True)

    async def load(self) -> LearnedCosts | None:
        """The stored state, or None (nothing stored, unreadable, or another layout)."""
        try:
            bucket = await self._open()
            if bucket is None:
                return None
            entry = await bucket.get(self._key)
            return LearnedCosts.from_dict(unpackb(bytes(entry.value or b""), "learned state"))
        except KeyNotFoundError:
            return None
        except Exception:
            logger.warning(
                "group %s: the stored learned state is not readable; the prior applies", self.group, exc_info=True
            )
            return None
