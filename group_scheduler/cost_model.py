"""The cost model: for a transfer of N tokens from A to B, the predicted latency of every medium.

    Latency(m) = C_comm(m) + C_comp(m) + C_loss(m)

- ``C_comm = bytes(m) / bandwidth(A,B) + round_trips * rtt + chunks(m) * per_chunk``
- ``C_comp = encode(m) on A + decode(m) on B + recompute on B`` (for ``tokens``: B's prefill of
  the N tokens; for ``summary``: A writes the summary, B prefills it), scaled by the compute
  load each side reports in its probes.
- ``C_loss = loss_weight * extra_tokens(m) * B's per-token decode time`` (calibrated, scaled by
  B's measured prefill speed against the calibrated one, or else by its reported load), with
  ``extra_tokens(m) = output_tokens * (1 - fidelity(m))``: a hop that keeps a fraction f of the
  model's greedy choices (calibrated top-1 agreement) is charged as if the receiver had to
  generate the other (1 - f) of its expected answer again. Lossless media cost nothing here.

Memory pressure on B (its reported cache bytes over its budget's watermark) adds a penalty per
byte it must hold (the payload while it arrives, then the decoded KV), so a pressed receiver
prefers compact payloads and, where available, media that leave less resident (sparse, summary).
The figures per medium come from the calibration profile (`kvbus calibrate`), never from
constants here; the defaults below are only a fallback when no profile can be loaded, and are
labelled as such in every decision.

A receiver that cannot recompute (no model runner: its directory record says ``recompute``
false) is never given ``tokens`` or ``summary`` for a context with KV while a KV medium fits
it, unless the sender insists on that medium.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvbus.codecs.spec import MediumSpec, medium_spec, render_stage
from kvbus.codecs.split import SplitCodec, prefix_length
from kvbus.group_scheduler.learning import LearnedCosts, family
from kvbus.protocol import PathName
from kvbus.signature import ModelSignature

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MediumFigures:
    """What the cost model needs to know about one medium (from calibration)."""

    ratio: float = 1.0
    """Uncompressed KV bytes / encoded bytes."""
    encode_gbps: float = 1e6
    """Encode throughput in GB/s of uncompressed KV."""
    decode_gbps: float = 1e6
    """Decode throughput in GB/s of uncompressed KV."""
    fidelity: float = 1.0
    """Fidelity factor of one hop (1.0 = lossless)."""
    needs_kv: bool = True
    """False for media that carry tokens (the receiver recomputes)."""
    lossless: bool = True
    summary_tokens: int = 0
    """For ``summary``: tokens in the summary (the sender generates them, the receiver prefills them)."""
    resident_fraction: float = 1.0
    """Share of the context's KV the receiver holds after decoding (a sparsified cache keeps less)."""
    fidelity_by_tokens: tuple[tuple[int, float], ...] = ()
    """``(context tokens, fidelity)`` measured at several lengths, ascending (calibration's
    ``fidelity_by_tokens``); empty: ``fidelity`` at every length."""
    split_loss_scale: float = 1.0
    """For ``split+X``: a split's fidelity loss is X's on the whole context times the share sent
    in X times this. 1 is the prior (the recomputed prefix removes only its own share of the
    error); calibration measures less, since most of X's error is in the first tokens, which
    every later one attends to and a split recomputes exact (`split_loss_scale`)."""

    def fidelity_at(self, n_tokens: int) -> float:
        """The fidelity of one hop of a context of ``n_tokens``: the calibrated curve, linear in
        log(tokens) between measured lengths and flat past its ends; ``fidelity`` without one."""
        curve = self.fidelity_by_tokens
        if self.lossless or not curve:
            return self.fidelity
        if n_tokens <= curve[0][0]:
            return curve[0][1]
        for (n0, f0), (n1, f1) in itertools.pairwise(curve):
            if n_tokens <= n1:
                w = math.log(n_tokens / n0) / math.log(n1 / n0)
                return f0 + w * (f1 - f0)
        return curve[-1][1]


def split_loss_scale(fidelity: float, behind_prefix: float | None, probe: float) -> float:
    """`MediumFigures.split_loss_scale` of ``split+X`` from X's calibrated ``fidelity`` and the
    fidelity of ``split(probe)+X`` measured on the same text (``behind_prefix``, None: not
    measured, the prior 1). At most 1: a recomputed prefix does not add error."""
    if behind_prefix is None or fidelity >= 1.0:
        return 1.0
    kept = (1.0 - behind_prefix) / (1.0 - fidelity) / (1.0 - probe)
    return min(1.0, max(0.0, kept))


def split_loss(whole_loss_s: float, share: float, scale: float) -> float:
    """The fidelity loss of ``split(f)+X`` whose rest, ``share`` of the context, goes in X, which
    would lose ``whole_loss_s`` on the whole context (``scale``: `MediumFigures.split_loss_scale`)."""
    return whole_loss_s * min(1.0, share * scale)


#: Fallback figures, used only when no calibration profile is available (decisions say so).
FALLBACK_FIGURES: dict[str, MediumFigures] = {
    "full": MediumFigures(1.0, 1e6, 1e6, 1.0, True, True),
    "int8": MediumFigures(1.9, 1.0, 2.0, 0.99, True, False),
    "int4": MediumFigures(3.5, 0.6, 1.2, 0.97, True, False),
    "tokens": MediumFigures(1.0, 1e6, 1e6, 1.0, False, True),
}
FALLBACK_PREFILL_TPS = 800.0
FALLBACK_DECODE_TOKEN_S = 0.03

#: The weight of one split transfer in its family's learned prefill slowdown (`CostModel.observe_split`):
#: one transfer gives the slowdown itself, not a ratio of totals, so it counts for half.
SPLIT_WEIGHT = 0.5
#: The prefixes a bare ``split+X`` is priced at are fractions of the context in these steps (the
#: chosen one names the medium, ``split(0.65)+int4``: few distinct names for the learned state).
SPLIT_STEP = 0.05
#: Bytes per second at which a receiver joins a recomputed prefix's KV to the rest (a copy).
JOIN_BPS = 5e9


@dataclass(frozen=True, slots=True)
class ModelCosts:
    """Compute figures of the receiving (or summarising) model."""

    prefill_tokens_per_s: float = FALLBACK_PREFILL_TPS
    """Prefill speed over a context of ``prefill_ref_tokens`` tokens (from nothing held)."""
    decode_token_s: float = FALLBACK_DECODE_TOKEN_S
    prefill_shape: tuple[float, float, float] | None = None
    """How a prefill's time grows with its length: ``(c0, c1, c2)``, the prefill of ``n`` tokens
    after ``p`` held taking ``c0 + c1 n + c2 ((p + n)^2 - p^2)`` reference prefills (a fixed cost,
    the per-token work, attention over the context), with ``c0 + c1 R + c2 R^2 = 1`` at
    ``R = prefill_ref_tokens``; calibration fits it to prefills at several lengths. None: linear,
    ``n / prefill_tokens_per_s`` at every length."""
    prefill_ref_tokens: int = 512
    """The context length ``prefill_tokens_per_s`` was measured at."""

    def prefill_s(self, tokens: int, held: int = 0) -> float:
        """Seconds to prefill ``tokens`` tokens after ``held`` already in the cache."""
        if tokens <= 0:
            return 0.0
        if self.prefill_shape is None:
            return tokens / self.prefill_tokens_per_s
        return self.prefill_ref_tokens / self.prefill_tokens_per_s * self._work(tokens, held)

    def reference_tps(self, tokens: int, seconds: float, held: int = 0) -> float:
        """The ``prefill_tokens_per_s`` under which a prefill of ``tokens`` after ``held`` takes
        ``seconds``: a speed measured at one length, carried to the reference length."""
        if self.prefill_shape is None:
            return tokens / seconds
        return self.prefill_ref_tokens * self._work(tokens, held) / seconds

    def _work(self, tokens: int, held: int) -> float:
        c0, c1, c2 = self.prefill_shape or (0.0, 1.0 / self.prefill_ref_tokens, 0.0)
        return c0 + c1 * tokens + c2 * ((held + tokens) ** 2 - held**2)


@dataclass(frozen=True, slots=True)
class CostConfig:
    """Knobs of the cost model."""

    round_trips: int = 3
    """Control round trips per transfer (scheduler, open, final verdict)."""
    rtt_s: float = 0.0005
    """Round-trip time used when a link reports none."""
    per_chunk_s: float = 0.0001
    """Fixed cost per chunk on top of its bytes."""
    chunk_bytes: int = 1 << 20
    output_tokens: int = 128
    """Tokens the receiver is expected to generate after the transfer (for C_loss)."""
    loss_weight: float = 1.0
    """Scale of C_loss (0 ignores fidelity, larger values protect quality harder)."""
    memory_penalty_s_per_gb: float = 1.0
    """Seconds charged per GB B must hold, multiplied by how far B is past its watermark (0..1)."""
    refresh_threshold: float = 0.9
    """Below this lineage fidelity the next hop is forced lossless."""
    hysteresis: float = 0.15
    """A pair switches medium only if the new one is predicted at least this much faster."""


@dataclass(frozen=True, slots=True)
class Link:
    """What the scheduler knows of the path A -> B."""

    bandwidth_bps: float
    """Bytes per second (estimate or configured capacity)."""
    rtt_s: float = 0.0
    source: str = "estimate"
    """``estimate`` (observed transfers), ``estimate of <path>`` (the pair's other network path's,
    this one never measured), ``configured`` (declared capacity) or ``default``."""
    path: str = PathName.NATS
    """The data path the bytes are expected to take (its learned fixed cost applies)."""
    inline: Link | None = None
    """The path a payload of at most ``inline_bytes`` takes instead (it rides in the `Open`, over
    NATS, whatever ``path`` says): a ``tokens`` transfer of a context that would go direct."""
    inline_bytes: int = 0
    drop_p: float = 0.0
    """Probability that a transfer meets the link at ``drop_bps`` instead (the share of its recent
    transfers that found it dropped: `LinkEstimate.drop_risk`); 0 for a link that held its rate."""
    drop_bps: float = 0.0

    def bytes_s(self, nbytes: int) -> float:
        """Expected seconds for ``nbytes`` on this link: at its rate, or with probability
        ``drop_p`` at the slow rate it has been seen to drop to."""
        bw = max(self.bandwidth_bps, 1.0)
        if self.drop_p > 0 and 0 < self.drop_bps < bw:
            p = min(1.0, self.drop_p)
            return nbytes * ((1.0 - p) / bw + p / self.drop_bps)
        return nbytes / bw

    def for_payload(self, nbytes: int) -> Link:
        """The link a payload of ``nbytes`` takes."""
        if self.inline is not None and nbytes <= self.inline_bytes:
            return self.inline
        return self


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One side of a transfer as the cost model sees it."""

    signature: ModelSignature | None
    compute_load: float = 0.0
    """0..1 share of the machine busy (from probes); compute terms are scaled by (1 + load)."""
    memory_pressure: float = 0.0
    """0..1: how far the agent's cache is past its high watermark."""
    model: ModelCosts = field(default_factory=ModelCosts)
    recompute: bool = True
    """Whether it can rebuild KV from tokens (it has a model runner). A receiver that cannot is
    not given ``tokens`` or ``summary`` for a context with KV, unless the sender insists."""
    prefill_measured: bool = False
    """``model.prefill_tokens_per_s`` was measured by the agent under its real load: the prefill
    terms take it as it is, not scaled by ``compute_load`` again."""


@dataclass(frozen=True, slots=True)
class Estimate:
    """Predicted cost terms of one candidate medium."""

    medium: str
    nbytes: int
    comm_s: float
    comp_s: float
    loss_s: float
    fidelity: float
    usable: bool = True
    why_not: str = ""
    enc_s: float = 0.0
    """Encode on A (in ``comp_s``)."""
    dec_s: float = 0.0
    """Decode on B (in ``comp_s``)."""
    recompute_s: float = 0.0
    """B's prefill (``tokens``; A's summary and B's prefill of it for ``summary``; in ``comp_s``)."""
    fixed_s: float = 0.0
    """Round trips and per-transfer costs beyond the bytes (in ``comm_s``)."""
    drop_risk_s: float = 0.0
    """Of the bytes' time, what the link's recent drops add to it (`Link.drop_p`; in ``comm_s``)."""
    prior_enc_s: float = 0.0
    """Encode by the calibrated figures alone (what a measured encode is compared with)."""
    prior_dec_s: float = 0.0
    """Decode by the calibrated figures alone."""
    learned: bool = False
    """Some term was corrected by what the scheduler measured (`kvbus.group_scheduler.learning`)."""
    split_prefill_s: float = 0.0
    """``split``: the prefix's prefill by the receiver's calibrated speed, before the learned
    slowdown of a prefill that shares the receiver with the stream (`CostModel.observe_split`)."""
    split_stream_s: float = 0.0
    """``split``: the rest's stream (its bytes' time and decode) that hides the prefill."""

    @property
    def total_s(self) -> float:
        """Predicted end-to-end seconds (communication + computation + the fidelity penalty); inf if unusable."""
        return self.comm_s + self.comp_s + self.loss_s if self.usable else math.inf

    def as_dict(self) -> dict[str, Any]:
        """The estimate as a JSON-ready dict (seconds rounded to microseconds), as decisions report it."""
        return {
            "medium": self.medium,
            "bytes": self.nbytes,
            "comm_s": round(self.comm_s, 6),
            "comp_s": round(self.comp_s, 6),
            "loss_s": round(self.loss_s, 6),
            "total_s": round(self.total_s, 6) if self.usable else None,
            "fidelity": self.fidelity,
            **({"why_not": self.why_not} if self.why_not else {}),
            **(
                {
                    "terms": {
                        "fixed_s": round(self.fixed_s, 6),
                        "bytes_s": round(self.comm_s - self.fixed_s, 6),
                        "drop_risk_s": round(self.drop_risk_s, 6),
                        "enc_s": round(self.enc_s, 6),
                        "dec_s": round(self.dec_s, 6),
                        "recompute_s": round(self.recompute_s, 6),
                    },
                    "prior": {"enc_s": self.prior_enc_s, "dec_s": self.prior_dec_s},
                    "learned": self.learned,
                }
                if self.usable
                else {}
            ),
        }


@dataclass(frozen=True, slots=True)
class Choice:
    """The chosen medium with the reasons."""

    medium: str
    estimate: Estimate
    candidates: tuple[Estimate, ...]
    reason: str
    forced_lossless: bool = False
    kept_by_hysteresis: bool = False
    explored: bool = False
    """Chosen to measure it (bounded exploration), not because it was predicted fastest."""
    explored_link: bool = False
    """Explored to measure the pair's link again (a probe after a drop), not the medium."""
    hedged: bool = False
    """The pair's link was never measured: chosen to be least far from the best at any rate
    (`AdaptiveSelector._hedge`), not for the default rate alone."""

    def record(self) -> dict[str, Any]:
        """The decision record that travels in the grant and ends up in the TransferReport."""
        return {
            "medium": self.medium,
            "reason": self.reason,
            "predicted_s": round(self.estimate.total_s, 6),
            "forced_lossless": self.forced_lossless,
            "kept_by_hysteresis": self.kept_by_hysteresis,
            "explored": self.explored,
            "explored_link": self.explored_link,
            "hedged": self.hedged,
            "candidates": [c.as_dict() for c in self.candidates],
        }


class CostModel:
    """Predicts the latency of each medium and chooses one, with hysteresis and precision refresh."""

    def __init__(
        self,
        figures: Mapping[str, MediumFigures] | None = None,
        *,
        config: CostConfig | None = None,
        calibrated: bool = True,
    ) -> None:
        self.figures = dict(figures or FALLBACK_FIGURES)
        self.config = config or CostConfig()
        self.calibrated = calibrated and figures is not None
        self.bias: dict[str, float] = {}
        """Observed / predicted compute time per medium (online correction), 1.0 until observed;
        applies where `learned` has no measured encode and decode for the medium at that size."""
        self.learned = LearnedCosts()
        """What the scheduler measured of each term (fixed cost per path, codec speed per medium
        and size, prefill per receiver): corrections over the calibrated prior."""

    @classmethod
    def from_profile(cls, profile: Any, *, config: CostConfig | None = None) -> CostModel:
        """Build from a `kvbus.codecs.calibration.CalibrationProfile` (duck-typed)."""
        from kvbus.codecs import get_codec
        from kvbus.codecs.calibration import SPLIT_PROBE

        figures: dict[str, MediumFigures] = {}
        for spec, f in profile.codecs.items():
            try:
                codec = get_codec(spec)
            except Exception:  # noqa: BLE001 - a profile may name codecs this build lacks
                logger.info("calibration profile names unknown medium %r; ignored", spec)
                continue
            figures[spec] = MediumFigures(
                ratio=max(float(f.ratio), 1e-6),
                encode_gbps=max(float(f.encode_gbps), 1e-6),
                decode_gbps=max(float(f.decode_gbps), 1e-6),
                fidelity=min(1.0, max(0.0, float(f.fidelity))),
                needs_kv=bool(codec.needs_kv),
                lossless=bool(codec.lossless),
                summary_tokens=int(
                    getattr(f, "summary_tokens", 0) or (64 if medium_spec(spec).kind == "summary" else 0)
                ),
                fidelity_by_tokens=_curve(profile, spec),
            )
        for name, fb in FALLBACK_FIGURES.items():
            figures.setdefault(name, fb)
        # delta+X costs what X costs on the tokens the receiver lacks (estimate() scales it).
        for inner in ("full", "int8", "int4"):
            if inner in figures:
                try:
                    spec = get_codec(medium_spec(inner).with_delta().name).name
                except Exception:  # noqa: BLE001 - no delta in this build
                    continue
                figures.setdefault(spec, figures[inner])
        # split+X costs what X costs on the tokens after the prefix (estimate() prices the prefix),
        # and loses what calibration measured X to lose behind a recomputed prefix.
        behind_prefix = getattr(profile, "split_fidelity", {})
        for inner in ("full", "int8", "int4"):
            if inner in figures:
                try:
                    name = get_codec(f"split+{inner}").name
                except Exception:  # noqa: BLE001 - no split in this build
                    continue
                scale = split_loss_scale(figures[inner].fidelity, behind_prefix.get(inner), SPLIT_PROBE)
                figures.setdefault(name, replace(figures[inner], split_loss_scale=scale))
        model = cls(figures, config=config, calibrated=True)
        shape = getattr(profile, "prefill_shape", None)
        model.default_model_costs = ModelCosts(
            float(profile.prefill_tokens_per_s),
            float(profile.decode_token_s),
            prefill_shape=shape() if callable(shape) else None,
            prefill_ref_tokens=int(getattr(profile, "context_tokens", 512) or 512),
        )
        return model

    default_model_costs: ModelCosts = ModelCosts()

    def figures_of(self, medium: str) -> MediumFigures | None:
        """The figures of ``medium``: the calibrated ones, those of ``tokens`` for padded ids (a
        link probe; their padding's bytes are counted by `estimate`), those of ``split+X`` (or
        else X) for ``split(f)+X``, else None."""
        fig = self.figures.get(medium)
        if fig is None and _padding(medium):
            return self.figures.get("tokens")
        fam = family(medium)
        if fig is None and fam.startswith("split+"):  # a split costs what its inner medium costs on the rest
            return self.figures.get(fam) or self.figures.get(fam[len("split+") :])
        return fig

    def _figures(self, medium: str) -> MediumFigures:
        """`figures_of` a medium an estimate was made for (it has figures)."""
        fig = self.figures_of(medium)
        if fig is None:
            raise KeyError(medium)
        return fig

    # -- prediction ---------------------------------------------------------------------------------

    def estimate(
        self,
        medium: str,
        *,
        n_tokens: int,
        kv_bytes: int,
        link: Link,
        sender: Endpoint,
        receiver: Endpoint,
        base_tokens: int = 0,
        known: Mapping[str, Estimate] | None = None,
    ) -> Estimate:
        """Predicted cost terms of sending ``n_tokens`` (``kv_bytes`` uncompressed) with ``medium``.

        ``known``: estimates of other media for the same transfer, by medium (a ``split+X`` takes
        X's whole-context estimate from it rather than making it again)."""
        cfg = self.config
        fig = self.figures_of(medium)
        pad = _padding(medium) if medium not in self.figures else 0
        if fig is None:
            return Estimate(medium, 0, 0, 0, 0, 0, usable=False, why_not="no figures for this medium")
        if fig.needs_kv and (
            receiver.signature is None
            or sender.signature is None
            or not sender.signature.compatible_with(receiver.signature)
        ):
            return Estimate(medium, 0, 0, 0, 0, fig.fidelity, usable=False, why_not="receiver cannot use this KV")
        spec = medium_spec(medium)
        if spec.outer == "split":
            return self._estimate_split(
                medium,
                spec,
                n_tokens=n_tokens,
                kv_bytes=kv_bytes,
                link=link,
                sender=sender,
                receiver=receiver,
                whole=(known or {}).get("+".join(spec.pieces[1:]) or "full"),
            )
        delta = spec.delta
        if delta and base_tokens <= 0:
            return Estimate(medium, 0, 0, 0, 0, fig.fidelity, usable=False, why_not="receiver holds no base")
        new_tokens = max(0, n_tokens - base_tokens) if delta else n_tokens
        per_token_bytes = kv_bytes / n_tokens if n_tokens else 0.0
        kind = spec.kind
        if not fig.needs_kv:
            nbytes = 8 * max(1, fig.summary_tokens) if kind == "summary" else 8 * new_tokens + pad
            raw = 0.0
        else:
            raw = per_token_bytes * new_tokens
            nbytes = int(raw / fig.ratio) + 8 * n_tokens
        link = link.for_payload(nbytes)
        rtt = link.rtt_s or cfg.rtt_s
        chunks = max(1, math.ceil(nbytes / cfg.chunk_bytes))
        learned_fixed = self.learned.fixed(link.path)
        # The grant's round trip, then what a transfer on this path was measured to cost beyond
        # its bytes (Open, verdict); before any measurement, the configured round trips.
        fixed = rtt + learned_fixed if learned_fixed is not None else cfg.round_trips * rtt
        bytes_s = link.bytes_s(nbytes)
        drop_risk = bytes_s - nbytes / max(link.bandwidth_bps, 1.0)
        comm = bytes_s + fixed + chunks * cfg.per_chunk_s
        prior_enc = raw / (fig.encode_gbps * 1e9) / _free(sender.compute_load)
        prior_dec = raw / (fig.decode_gbps * 1e9) / _free(receiver.compute_load)
        f_enc = self.learned.factor(medium, kv_bytes, "encode")
        f_dec = self.learned.factor(medium, kv_bytes, "decode")
        enc = prior_enc * (f_enc if f_enc is not None else 1.0)
        dec = prior_dec * (f_dec if f_dec is not None else 1.0)
        recompute = 0.0
        if kind == "tokens":
            recompute = receiver.model.prefill_s(new_tokens, n_tokens - new_tokens) / _prefill_free(receiver)
        elif kind == "summary":
            write = fig.summary_tokens * sender.model.decode_token_s / _free(sender.compute_load)
            read = receiver.model.prefill_s(fig.summary_tokens) / _prefill_free(receiver)
            recompute = write + read
        # The per-medium bias is the older, coarser correction: only where nothing finer was measured.
        measured_codec = f_enc is not None or f_dec is not None
        bias = 1.0 if measured_codec else self.bias.get(medium, 1.0)
        enc, dec, recompute = enc * bias, dec * bias, recompute * bias
        comp = enc + dec + recompute
        fidelity = fig.fidelity_at(n_tokens)
        # The receiver's decode time per token, under its load as its prefill is (`_prefill_free`).
        loss = cfg.loss_weight * cfg.output_tokens * (1.0 - fidelity) * receiver.model.decode_token_s
        loss /= _prefill_free(receiver)
        # What B must hold: the payload while it arrives, then the decoded KV.
        resident = per_token_bytes * fig.summary_tokens if kind == "summary" else kv_bytes * fig.resident_fraction
        comp += cfg.memory_penalty_s_per_gb * receiver.memory_pressure * (nbytes + resident) / 1e9
        # The corrections apply to the compute terms and the fixed cost only: the bytes' time comes
        # from the link as observed (the group's estimate), and scaling it too would carry what
        # one link taught about a medium's codec speed to every other link.
        return Estimate(
            medium,
            nbytes,
            comm,
            comp,
            loss,
            fidelity,
            enc_s=enc,
            dec_s=dec,
            recompute_s=recompute,
            fixed_s=fixed,
            drop_risk_s=drop_risk,
            prior_enc_s=round(prior_enc, 9),
            prior_dec_s=round(prior_dec, 9),
            learned=measured_codec or learned_fixed is not None or bias != 1.0,
        )

    def _estimate_split(
        self,
        medium: str,
        spec: MediumSpec,
        *,
        n_tokens: int,
        kv_bytes: int,
        link: Link,
        sender: Endpoint,
        receiver: Endpoint,
        whole: Estimate | None = None,
    ) -> Estimate:
        """``split(f)+X``: the receiver prefills the first ``f`` of the tokens from the moment the
        `Open` arrives, while X's bytes of the rest cross the link and are decoded; it takes the
        longer of the two (and a join). A bare ``split+X`` is priced at the prefix where the two
        meet (in steps of `SPLIT_STEP`), and the estimate names the medium with it."""
        inner = "+".join(spec.pieces[1:]) or "full"
        stage = spec.stages[0]
        given = stage.args[0] if stage.args else dict(stage.kwargs).get("prefix")
        if not receiver.recompute:
            return Estimate(
                medium, 0, 0, 0, 0, 1.0, usable=False, why_not="receiver cannot recompute (no model runner)"
            )
        offered = whole is not None and whole.medium == inner  # X is a candidate of the same decision
        if whole is None or not offered:
            whole = self.estimate(
                inner, n_tokens=n_tokens, kv_bytes=kv_bytes, link=link, sender=sender, receiver=receiver
            )
        if not whole.usable or n_tokens <= 1:
            why = whole.why_not or "a context of one token cannot be split"
            return replace(whole, medium=medium, usable=False, why_not=why)
        free = _prefill_free(receiver)
        # A prefill that shares the receiver with the stream ran this much slower than its
        # calibrated speed in the split transfers measured so far (`observe_split`).
        slowdown = self.bias.get(family(medium), 1.0)

        def prefill(k: int) -> float:
            return receiver.model.prefill_s(k) / free * slowdown

        if isinstance(given, (int, float)) and not isinstance(given, bool):
            fraction = float(given)
        else:
            # The rest's time on the link and in its decode shrinks with it, about in proportion;
            # the prefix's prefill grows with it, and so does the share recomputed exactly (the
            # rest's fidelity loss shrinks). Below the largest step whose prefill the rest's stream
            # still hides, a longer prefix only gains; past it, each step trades exposed prefill
            # for less loss, so every step from there on is priced on the whole's terms scaled to
            # the rest, and the cheapest taken (a decision does this for every split candidate:
            # arithmetic only, and one exact estimate of the rest at the end). Only that step and
            # the next were compared before: on a lossy medium the prefix stayed at the meeting
            # point however much loss a longer one saved (`bench select`, 128 tokens at 100
            # Mbit/s: split(0.05)+int8 chosen, objective 0.198 s, where split+int8 at the
            # default prefix measured 0.156 s).
            stream = whole.comm_s - whole.fixed_s + whole.dec_s
            steps = round(1 / SPLIT_STEP)

            scale = self._split_loss_scale(medium)

            def cost(s: int) -> float:
                k = prefix_length(s / steps, n_tokens)
                share = (n_tokens - k) / n_tokens
                exposed = max(0.0, prefill(k) - stream * share)
                return (stream + whole.enc_s) * share + split_loss(whole.loss_s, share, scale) + exposed

            if (
                offered
                and prefill(prefix_length(1 / steps, n_tokens)) > stream * (1 - 1 / steps)
                and cost(1) >= stream + whole.enc_s + whole.loss_s
            ):
                # Even the smallest prefix takes longer to prefill than the rest takes to arrive,
                # and the loss it saves does not pay for that: the split only adds to X, which
                # this decision weighs anyway (fast links). A lossy X is still split where the
                # exact prefix saves more loss than its prefill costs (`bench select`, 128 tokens
                # at 100 Mbit/s: int8 chosen at an objective of 0.198 s, where split+int8, with
                # most of int8's error recomputed away, measured 0.156 s).
                why = (
                    f"{inner} arrives before the smallest prefix ({SPLIT_STEP:.0%}) is prefilled: "
                    f"{inner} alone is faster"
                )
                return replace(whole, medium=medium, usable=False, why_not=why)
            lo, hi = 1, steps - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if prefill(prefix_length(mid / steps, n_tokens)) <= stream * (1 - mid / steps):
                    lo = mid
                else:
                    hi = mid - 1
            fraction = min(range(lo, steps), key=cost) / steps
            medium = _split_name(fraction, inner)
        return self._split_at(
            medium,
            fraction,
            whole,
            prefill,
            n_tokens,
            kv_bytes,
            link,
            receiver,
            inner=inner,
            sender=sender,
            slowdown=slowdown,
        )

    def _split_at(
        self,
        medium: str,
        fraction: float,
        whole: Estimate,
        prefill: Callable[[int], float],
        n_tokens: int,
        kv_bytes: int,
        link: Link,
        receiver: Endpoint,
        *,
        inner: str,
        sender: Endpoint,
        slowdown: float,
    ) -> Estimate:
        """``split(fraction)+inner`` (see `_estimate_split`): ``whole`` is inner's estimate for
        the whole context (its fidelity), ``prefill(k)`` the receiver's prefill of ``k`` tokens
        beside the stream (its calibrated time times the learned ``slowdown``)."""
        k = prefix_length(fraction, n_tokens)
        rest = self.estimate(
            inner,
            n_tokens=max(1, n_tokens - k),
            kv_bytes=kv_bytes * (n_tokens - k) // n_tokens,
            link=link,
            sender=sender,
            receiver=receiver,
        )
        ids = 4 * k
        lossy = (n_tokens - k) / n_tokens  # the prefix is recomputed exactly: only the rest is lossy
        stream = rest.comm_s - rest.fixed_s + rest.dec_s
        # The prefill's part the stream did not hide. The learned slowdown is in the prefill, not
        # in this difference: a split predicted to hide its prefill whole (the difference
        # negative) and measured not to must raise its price (`bench select`, 2048 tokens at 10
        # Mbit/s: split(0.75)+int4 predicted 3.5 s five times in a row, measured 7.2 s each
        # time, where tokens took 4.4 s).
        beside = prefill(k)
        exposed = max(0.0, beside - stream)
        join = kv_bytes / JOIN_BPS / _free(receiver.compute_load)
        return replace(
            rest,
            medium=medium,
            nbytes=rest.nbytes + ids,
            comm_s=rest.comm_s + link.bytes_s(ids),
            comp_s=rest.comp_s + exposed + join,
            loss_s=split_loss(whole.loss_s, lossy, self._split_loss_scale(medium)),
            # What the receiver's decode stamps on the context (the inner medium's factor, see
            # `SplitCodec`), which the precision refresh must count: with the share prorated
            # here as well, a relay of 20 hops took the lineage to 0.895 under a threshold of 0.9.
            fidelity=whole.fidelity,
            dec_s=rest.dec_s + join,
            recompute_s=exposed,
            split_prefill_s=beside / slowdown,
            split_stream_s=stream,
        )

    def _split_loss_scale(self, medium: str) -> float:
        """`MediumFigures.split_loss_scale` of ``split(f)+X`` (1 without figures)."""
        fig = self.figures_of(medium)
        return fig.split_loss_scale if fig is not None else 1.0

    def choose(
        self,
        candidates: Iterable[str],
        *,
        n_tokens: int,
        kv_bytes: int,
        link: Link,
        sender: Endpoint,
        receiver: Endpoint,
        lineage: float = 1.0,
        current: str | None = None,
        base_tokens: int = 0,
        requested: bool = False,
    ) -> Choice:
        """The medium with the lowest predicted latency.

        Args:
            candidates: media to consider.
            lineage: the context's fidelity product so far; if one more lossy hop would take it
                below ``refresh_threshold``, only lossless media are considered.
            current: the medium this pair used last; kept unless another is predicted at least
                ``hysteresis`` faster.
            base_tokens: tokens of this context the receiver already holds (enables delta media).
            requested: the sender insists on ``candidates`` (then a receiver that cannot
                recompute may still be given a token medium).
        """
        cfg = self.config
        media = list(dict.fromkeys(candidates))
        known: dict[str, Estimate] = {}
        # Splits last: each takes its inner medium's estimate from the others when it is one.
        for m in sorted(media, key=lambda m: m.startswith("split")):
            known[m] = self.estimate(
                m,
                n_tokens=n_tokens,
                kv_bytes=kv_bytes,
                link=link,
                sender=sender,
                receiver=receiver,
                base_tokens=base_tokens,
                known=known,
            )
        ests = [known[m] for m in media]
        # Tokens would reach a receiver with no model to rebuild the KV from them: only when no KV
        # medium fits it at all (then tokens are all it can take), or the sender insists.
        if (
            not receiver.recompute
            and kv_bytes > 0
            and not requested
            and any(e.usable and self._figures(e.medium).needs_kv for e in ests)
        ):
            ests = [
                replace(e, usable=False, why_not="receiver cannot recompute (no model runner)")
                if e.usable and not self._figures(e.medium).needs_kv
                else e
                for e in ests
            ]
        pool = [e for e in ests if e.usable]
        if not pool:
            raise ValueError("no usable medium among " + ", ".join(e.medium for e in ests))
        # Precision refresh: a lossy hop that would take the lineage below the threshold is
        # not allowed; lossless media keep the product (``tokens`` even resets it to 1).
        allowed = [e for e in pool if self.refresh_allows(e, lineage)]
        allowed = allowed or pool
        forced = min(pool, key=lambda e: e.total_s) not in allowed
        pool = allowed
        best = min(pool, key=lambda e: e.total_s)
        kept = False
        reason = f"lowest predicted latency ({best.total_s * 1000:.1f} ms)"
        if current is not None and family(current) != family(best.medium):
            # (a split keeps its family: its prefix is sized anew for every transfer)
            cur = next((e for e in pool if family(e.medium) == family(current)), None)
            if cur is not None and best.total_s > (1.0 - cfg.hysteresis) * cur.total_s:
                best, kept = cur, True
                reason = f"kept {current}: the best alternative is less than {cfg.hysteresis:.0%} faster"
        if forced:
            reason = f"precision refresh (lineage {lineage:.3f}); " + reason
        if not self.calibrated:
            reason += " [uncalibrated fallback figures]"
        return Choice(best.medium, best, tuple(ests), reason, forced_lossless=forced, kept_by_hysteresis=kept)

    def refresh_allows(self, e: Estimate, lineage: float) -> bool:
        """Whether the precision refresh lets ``e``'s medium carry a context of fidelity ``lineage``:
        a lossless medium always, a lossy one if the lineage stays at ``refresh_threshold`` or above."""
        return self._figures(e.medium).lossless or lineage * e.fidelity >= self.config.refresh_threshold

    # -- online correction ------------------------------------------------------------------------

    def observe(self, medium: str, predicted_s: float, observed_s: float, *, weight: float = 0.2) -> None:
        """Move the medium's bias towards observed / predicted compute time (an EWMA, clamped to 0.25..4).

        ``predicted_s`` is the estimate's ``comp_s`` (bias included), ``observed_s`` the transfer's
        time off the wire (encode, decode, recompute: its seconds less its ``wire_s``).
        """
        if predicted_s <= 0 or observed_s <= 0:
            return
        medium = family(medium)  # every split(f)+X teaches split+X
        self._move_bias(medium, observed_s / (predicted_s / self.bias.get(medium, 1.0)), weight)

    def _move_bias(self, fam: str, ratio: float, weight: float) -> None:
        """The EWMA step of a family's bias towards ``ratio``, clamped to 0.25..4."""
        self.bias[fam] = (1 - weight) * self.bias.get(fam, 1.0) + weight * min(4.0, max(0.25, ratio))

    def observe_split(
        self,
        medium: str,
        *,
        prefill_s: float,
        stream_s: float,
        base_s: float,
        observed_s: float,
        weight: float = SPLIT_WEIGHT,
    ) -> None:
        """Learn a split's prefill slowdown (its family's bias, clamped to 0.25..4) from one
        transfer: what it took (``observed_s``: encode, transfer, decode) beyond what it costs
        besides its exposed prefill (``base_s``) is the prefill the stream did not hide.

        ``prefill_s`` and ``stream_s`` are the estimate's `Estimate.split_prefill_s` and
        `Estimate.split_stream_s`. The split's bytes do not measure the link (`measures_link`),
        so the link estimate in ``base_s`` is taken as right.
        """
        if prefill_s <= 0 or observed_s <= 0:
            return
        medium = family(medium)
        implied = _implied_slowdown(prefill_s, stream_s, observed_s - base_s, self.bias.get(medium, 1.0))
        self._move_bias(medium, implied, weight)


def _implied_slowdown(prefill_s: float, stream_s: float, exposed_s: float, current: float) -> float:
    """The prefill slowdown a split transfer implies: it left ``exposed_s`` of a prefill of
    ``prefill_s`` (calibrated) uncovered by a stream of ``stream_s``. One it hid whole says only
    that the slowdown is at most ``stream_s / prefill_s``."""
    if exposed_s > 0:
        return (exposed_s + stream_s) / prefill_s
    return min(current, stream_s / prefill_s)


def _padding(medium: str) -> int:
    """The padding of a ``tokens(pad)`` medium (a link probe, `AdaptiveSelector._probe`); 0 for
    any other medium, or a spec that names no codec."""
    try:
        spec = medium_spec(medium)
        if len(spec.stages) != 1 or spec.kind != "tokens":
            return 0
        from kvbus.codecs import get_codec

        return int(get_codec(medium).args.get("pad", 0))
    except Exception:  # noqa: BLE001 - an unknown or malformed medium has no figures either way
        return 0


def _split_name(fraction: float, inner: str) -> str:
    """The canonical spec of ``split(fraction)+inner``, as the codec names it (the default prefix
    is not written)."""
    return render_stage("split", SplitCodec.params, {"prefix": round(fraction, 4)}) + "+" + inner


def _prefill_free(endpoint: Endpoint) -> float:
    """The load factor of ``endpoint``'s prefill: 1 for a measured speed (measured under its real
    load already), else `_free` of its reported load."""
    return 1.0 if endpoint.prefill_measured else _free(endpoint.compute_load)


def _free(load: float) -> float:
    """Speed of a new job on a machine this busy, relative to an idle one.

    A job sharing the machine with one other busy job runs at about half speed, hence
    ``1 / (1 + load)``: at full load twice as slow. (``1 - load`` would explode near full load,
    and an agent's reported load includes its own last recompute, which made the prediction
    oscillate between media.)
    """
    return 1.0 / (1.0 + min(max(load, 0.0), 1.0))


def with_model(endpoint: Endpoint, model: ModelCosts) -> Endpoint:
    """``endpoint`` with its model-cost figures replaced by ``model``."""
    return replace(endpoint, model=model)


def _curve(profile: Any, spec: str) -> tuple[tuple[int, float], ...]:
    """A profile's fidelity curve of ``spec`` (duck-typed: an older profile object may have none),
    with every point clamped to (0, 1] and lengths strictly ascending."""
    curve = getattr(profile, "fidelity_curve", None)
    points = curve(spec) if callable(curve) else ()
    return tuple((int(n), min(1.0, max(1e-6, float(f)))) for n, f in points if int(n) > 0)
