"""Adaptive medium selection: the cost model applied to the group's live state."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from kvbus.codecs import get_codec
from kvbus.group_scheduler.config import SchedulerConfig
from kvbus.group_scheduler.cost_model import Choice, CostConfig, CostModel, Endpoint, Estimate, Link, ModelCosts
from kvbus.group_scheduler.learning import SMALL_PAYLOAD_BYTES
from kvbus.group_scheduler.policy import MediumSelector, Selection, StaticSelector
from kvbus.group_scheduler.signatures import signature_of
from kvbus.group_scheduler.state import RISE_FACTOR, GroupState, Pending
from kvbus.protocol import PathName, Reason
from kvbus.signature import ModelSignature

logger = logging.getLogger(__name__)

#: Media the adaptive selector considers when none are configured (those without figures are skipped).
DEFAULT_CANDIDATES = (
    "full",
    "int8",
    "int4",
    "topk+int8",
    "lowrank",
    "tokens",
    "summary",
    "delta+full",
    "delta+int8",
    "delta+int4",
    "split+full",
    "split+int8",
    "split+int4",
)


def _path(pending: Pending, rx: str) -> str:
    """The data path ``pending``'s bytes to ``rx`` will likely take: the sender's, except that a
    sender says shm to a receiver it never sent to whenever it may use shm, and to a receiver
    known to be on another host its bytes take tcp. (A testbed cell's 128-token context was
    predicted at memory speed after four inline sends had measured the link: full, 4.9 s.)"""
    path = pending.request.path
    return PathName.TCP if path == PathName.SHM and pending.other_host(rx) else path


def _canonical(spec: str) -> str:
    try:
        return get_codec(spec).name
    except Exception:  # noqa: BLE001 - unknown here: left as is and filtered out
        return spec


def _known(spec: str) -> bool:
    try:
        get_codec(spec)
    except Exception:  # noqa: BLE001 - not in this build
        return False
    return True


@dataclass(frozen=True, slots=True)
class Exploration:
    """Bounded exploration: how often, and which, media are tried to measure them.

    A medium whose estimate at this context size is unmeasured (fewer than ``min_samples``
    transfers) or stale (none for ``stale_s``), and that would beat the chosen one if its
    prediction were ``margin`` too pessimistic, is sent instead on at most ``fraction`` of the
    transfers, so that a wrong prior is corrected within a few dozen transfers. Never for a
    critical transfer, one with a deadline, a broadcast, a receiver under memory pressure, a
    medium the precision refresh forbids, a medium the sender asked for, or a pair whose link was
    never measured (its first transfer is hedged instead, `AdaptiveSelector._hedge`).
    """

    fraction: float = 0.1
    """Most transfers that may explore, as a share of the adaptive decisions (0 = never)."""
    margin: float = 1.0
    """How wrong an unmeasured prediction may be: a candidate is explored only if it would beat the
    chosen one with its compute terms (encode, decode, recompute) ``1 + margin`` times faster than
    predicted. Its bytes over a measured link are taken as predicted: on a slow link, a medium
    whose bytes alone take longer than the chosen medium's whole transfer is never explored."""
    min_samples: int = 3
    """A medium measured fewer times than this at a context size is unmeasured there."""
    stale_s: float = 600.0
    """A medium not measured for this long at a context size is measured again."""
    link_every: int = 2
    """A pair whose link dropped and that has since sent only payloads too small to measure it is
    probed after this many decisions, then twice as many each time (0 = never)."""


#: Rates at which a pair with an unmeasured link is predicted (`AdaptiveSelector._hedge`).
HEDGE_POINTS = 5

#: The longest wait, in decisions, between two probes of a link that stays slow.
MAX_PROBE_EVERY = 64

#: Padding of a ``tokens`` probe (`AdaptiveSelector._probe`): with the ids, a payload big enough
#: for the link estimate to take (`SMALL_PAYLOAD_BYTES`); 52 ms at 10 Mbit/s.
PROBE_PAD_BYTES = SMALL_PAYLOAD_BYTES

#: A padded probe whose padding costs at most this share of the transfer it rides on does not
#: back off (a link that stays slow is probed every `Exploration.link_every` transfers).
PROBE_SHARE = 0.1


@dataclass(slots=True)
class _ProbeState:
    """One pair's link probing (`AdaptiveSelector._probe`)."""

    every: int
    """Decisions that did not measure the link after which it is probed."""
    unmeasured: int = 0
    """Decisions since the link was last probed (or its estimate last changed)."""
    changes: int = 0
    """The estimate's `LinkEstimate.changes` this back-off started from."""


@dataclass(frozen=True, slots=True)
class Decided:
    """The selector's choice for one transfer, with the cost model's record of it."""

    medium: str
    reason: str
    choice: Choice | None
    code: Reason = Reason.NONE
    """For a refusal: why, as a code."""
    links: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per receiver, the link the prediction used: its path, where its rate came from
    (``estimate``, ``configured``, ``estimate of tcp``, ``default``) and the rate, Mbit/s."""

    @classmethod
    def refusal(cls, reason: str, code: Reason) -> Decided:
        """A refusal (no medium, no cost model record): ``reason`` for people, ``code`` to match on."""
        return cls("", reason, None, code)


class AdaptiveSelector(MediumSelector):
    """For each transfer, the medium with the lowest predicted end-to-end latency.

    Bandwidth per pair is the group's sliding-window estimate from observed transfers, else the
    capacity the agents declared (link emulation), else ``default_bandwidth_bps``
    (``default_shm_bandwidth_bps`` on ``shm``). A pair keeps
    its medium unless another is predicted ``hysteresis`` faster. The sender's explicit medium,
    when given, is honoured (and still recorded with its predicted cost).
    """

    def __init__(
        self,
        model: CostModel | None = None,
        *,
        candidates: tuple[str, ...] = DEFAULT_CANDIDATES,
        default_bandwidth_bps: float = 1e9,
        default_shm_bandwidth_bps: float = 3e9,
        unmeasured_floor_bps: float = 1.25e6,
        exploration: Exploration | None = None,
        drop_risk: bool = True,
    ) -> None:
        self.model = model or CostModel()
        self.drop_risk = drop_risk
        """Whether a link's recent drops are priced in (`SchedulerConfig.link_drop_risk`)."""
        self.exploration = exploration or Exploration()
        self.decided = 0
        """Decisions the selector made itself (not a medium the sender asked for)."""
        self.explored = 0
        """Of those, the ones that explored."""
        self.candidates = tuple(
            dict.fromkeys(c for c in (_canonical(m) for m in candidates) if c in self.model.figures and _known(c))
        )
        self.default_bandwidth_bps = default_bandwidth_bps
        self.default_shm_bandwidth_bps = default_shm_bandwidth_bps
        """What an unmeasured ``shm`` path is assumed to carry (memory speed, not a network's)."""
        self.unmeasured_floor_bps = unmeasured_floor_bps
        """The slowest rate a pair's unmeasured link is assumed able to have (`_hedge`; 0 = assume
        ``default_bandwidth_bps``)."""
        self.last: dict[tuple[str, str], str] = {}
        self._probes: dict[tuple[str, str, str], _ProbeState] = {}
        """Per (sender, receiver, path): the link probing's back-off (see `_probe`)."""
        self.switches = 0

    def link(self, state: GroupState, src: str, dst: str, path: str = PathName.NATS, inline_bytes: int = 0) -> Link:
        """The pair's bandwidth on data ``path``: that path's sliding-window estimate, else the
        declared capacity, else the default. With ``inline_bytes`` (the sender's inline limit), a
        payload that small is predicted on the pair's NATS link (it rides in the `Open`)."""
        link = self._link(state, src, dst, path or PathName.NATS)
        if inline_bytes > 0 and link.path != PathName.NATS:
            link = replace(link, inline=self._link(state, src, dst, PathName.NATS), inline_bytes=inline_bytes)
        return link

    def _link(self, state: GroupState, src: str, dst: str, path: str) -> Link:
        est = state.link(src, dst, path)
        if est.known:
            p, slow = est.drop_risk() if self.drop_risk else (0.0, 0.0)
            return Link(
                est.bandwidth_bps, 2 * state.declared_latency(src, dst), "estimate", path, drop_p=p, drop_bps=slow
            )
        declared = state.declared_bandwidth(src, dst)
        if declared > 0:
            return Link(declared, 2 * state.declared_latency(src, dst), "configured", path)
        if path != PathName.SHM:
            # The same two hosts' other network path, if measured: it crosses the same links. (On
            # the testbed a hedged first transfer rode inline on NATS at 10 Mbit/s, and the next,
            # the first on tcp, was hedged over rates up to 8 Gbit/s again: it went in full.)
            for other in (PathName.TCP, PathName.NATS):
                sibling = state.link(src, dst, other)
                if other != path and sibling.known:
                    return Link(
                        sibling.bandwidth_bps, 2 * state.declared_latency(src, dst), f"estimate of {other}", path
                    )
        if path == PathName.SHM:
            return Link(self.default_shm_bandwidth_bps, 0.0, "default", path)
        return Link(self.default_bandwidth_bps, 0.0, "default", path)

    def endpoint(
        self, state: GroupState, name: str, signature: ModelSignature | None, *, recompute: bool = True
    ) -> Endpoint:
        """An agent as the cost model sees it: its model, compute load, memory pressure and whether
        it can recompute KV from tokens."""
        agent = state.agents.get(name)
        load = agent.compute_load if agent else 0.0
        pressure = agent.memory_pressure if agent else 0.0
        costs = getattr(self.model, "default_model_costs", ModelCosts())
        measured = 0.0
        if agent is not None and agent.prefill_tps > 0:
            # Its speed over the lengths it prefilled lately, carried to the calibrated length:
            # per token a long prefill is slower than a short one, on any load.
            n = int(agent.prefill_tokens)
            held = int(agent.prefill_held)
            measured = costs.reference_tps(n, n / agent.prefill_tps, held) if n > 0 else agent.prefill_tps
        if measured <= 0:  # the agent measures none: what its tokens deliveries took, if any
            measured = self.model.learned.prefill(name) or 0.0
        if measured > 0:
            # Its decode per token runs the same model on the same machine under the same load as
            # its prefill: it is slower (or faster) than calibrated by the same factor. The loss
            # term charges that decode time, so a loaded receiver's fidelity loss costs more.
            slowdown = costs.prefill_tokens_per_s / measured if costs.prefill_tokens_per_s > 0 else 1.0
            costs = replace(costs, prefill_tokens_per_s=measured, decode_token_s=costs.decode_token_s * slowdown)
        return Endpoint(signature, load, pressure, costs, recompute=recompute, prefill_measured=measured > 0)

    def choose(self, state: GroupState, pending: Pending) -> tuple[str, str]:
        """The medium with the lowest predicted latency (recorded on ``pending``), and why."""
        medium, reason, _ = self.select(state, pending)
        return medium, reason

    def select(self, state: GroupState, pending: Pending) -> Selection:
        """`choose` with the refusal's code."""
        decided = self.decide(state, pending)
        path = pending.request.path or PathName.NATS
        pending.decision = {**decided.choice.record(), "path": path, "links": decided.links} if decided.choice else {}
        if decided.choice is not None:
            pending.predicted_s = decided.choice.estimate.total_s
            est = decided.choice.estimate
            pending.predicted_comp_s = est.comp_s
            pending.predicted_split = (
                (est.split_prefill_s, est.split_stream_s, est.comm_s + est.comp_s - est.recompute_s)
                if est.split_prefill_s > 0
                else None
            )
        return Selection(decided.medium, decided.reason, decided.code)

    def decide(self, state: GroupState, pending: Pending) -> Decided:
        """The choice for ``pending`` without recording it."""
        req = pending.request
        try:
            sender_sig = signature_of(req.signature)
        except Exception as exc:  # noqa: BLE001 - validated on arrival; be safe anyway
            return Decided.refusal(f"bad sender signature: {exc}", Reason.MALFORMED)
        sender = self.endpoint(state, req.src, sender_sig)
        candidates = (req.medium,) if req.medium else self.candidates
        per_rx: list[Choice] = []
        unmeasured: set[str] = set()  # receivers whose network link was never measured nor declared
        links: dict[str, dict[str, Any]] = {}
        prices: dict[str, Callable[[str], Estimate]] = {}  # per receiver: one medium's estimate
        for rx, sig in pending.receivers.items():
            link = self.link(state, req.src, rx, _path(pending, rx), req.inline_limit)
            links[rx] = {"path": link.path, "source": link.source, "mbit": round(link.bandwidth_bps * 8e-6, 3)}
            receiver = self.endpoint(state, rx, sig, recompute=pending.recompute.get(rx, True))
            prices[rx] = partial(
                self.model.estimate,
                n_tokens=req.n_tokens,
                kv_bytes=req.nbytes,
                link=link,
                sender=sender,
                receiver=receiver,
                base_tokens=req.base_tokens,
            )
            choose = partial(
                self.model.choose,
                candidates,
                n_tokens=req.n_tokens,
                kv_bytes=req.nbytes,
                sender=sender,
                receiver=receiver,
                lineage=req.fidelity,
                current=None if req.medium else self.last.get((req.src, rx)),
                base_tokens=req.base_tokens,
                requested=bool(req.medium),
            )
            try:
                best = choose(link=link)
                if (
                    link.source == "default"
                    and not req.medium
                    and not (link.path == PathName.SHM and pending.same_host(rx))
                ):
                    # (shm runs at memory speed, `default_shm_bandwidth_bps`: nothing to hedge. A
                    # sender says shm to a receiver it has not sent to yet whenever it may use shm.)
                    unmeasured.add(rx)
                    best = self._hedge(best, link, choose, req.fidelity)
                per_rx.append(best)
            except ValueError:
                if req.medium and not _known(req.medium):
                    return Decided.refusal(
                        f"medium {req.medium!r} is not a codec this scheduler knows; send with "
                        f"one it knows or let kvbus choose",
                        Reason.UNKNOWN_CODEC,
                    )
                if req.medium:
                    return Decided.refusal(
                        f"medium {req.medium!r} carries KV that {rx} cannot use (different model); "
                        f"send with medium='tokens' or let kvbus choose",
                        Reason.INCOMPATIBLE,
                    )
                return Decided.refusal(f"no medium can reach {rx}", Reason.INCOMPATIBLE)
        choice = per_rx[0] if len(per_rx) == 1 else self._broadcast_choice(per_rx)
        if choice is None:
            return Decided.refusal("no medium is usable by every receiver", Reason.INCOMPATIBLE)
        for rx in pending.receivers:
            previous = self.last.get((req.src, rx))
            if previous is not None and previous != choice.medium:
                self.switches += 1
            self.last[(req.src, rx)] = choice.medium
        if req.medium:
            return Decided(choice.medium, "requested by the sender", choice, links=links)
        self.decided += 1
        self.model.learned.decisions += 1
        if len(per_rx) == 1:
            # The pair keeps its exploited medium for hysteresis: an exploration is one transfer.
            rx = next(iter(pending.receivers))
            # A pair whose link was never measured is not explored: its choice is hedged over the
            # rates the link may have (`_hedge`), and its bytes will measure the link.
            explore = (
                None
                if rx in unmeasured
                else self._probe(state, pending, choice, rx, prices[rx]) or self._explore(state, pending, choice, rx)
            )
            if explore is not None:
                self.explored += 1
                self.model.learned.explorations += 1
                return Decided(explore.medium, explore.reason, explore, links=links)
        return Decided(choice.medium, choice.reason, choice, links=links)

    def _may_explore(self, state: GroupState, pending: Pending, rx: str, *, capped: bool = True) -> bool:
        """Whether this transfer may be sent with another medium than predicted best (`Exploration`);
        ``capped``: it counts against ``fraction`` (a padded ``tokens`` probe does not: it costs its
        padding's bytes, and its own back-off bounds how often it is sent)."""
        ex, req = self.exploration, pending.request
        # The cap counts the group's decisions across restarts (they are in the learned state): a
        # scheduler that restarts, or a standby that takes over, does not explore afresh.
        learned = self.model.learned
        if ex.fraction <= 0 or (capped and learned.explorations >= ex.fraction * learned.decisions + 1):
            return False
        if req.critical or req.deadline is not None or pending.deadline_at is not None:
            return False
        agent = state.agents.get(rx)
        return agent is None or agent.memory_pressure <= 0

    def _probe(
        self, state: GroupState, pending: Pending, choice: Choice, rx: str, price: Callable[[str], Estimate]
    ) -> Choice | None:
        """A KV medium to send instead of ``choice`` to measure the pair's link again, if due.

        A link estimate that dropped stays low until a transfer big enough to measure it goes by
        (`SMALL_PAYLOAD_BYTES`), and once it is low the cost model picks ``tokens``, which never
        measures it: a link that recovered would never be seen to. So a pair whose estimate is
        ``RISE_FACTOR`` below the rate it had before its last drop, and whose last ``link_every``
        decisions did not measure it, is probed if a KV medium would beat ``choice`` were the link
        back at that rate. When ``choice`` is ``tokens`` and the rate is what is in doubt, the probe
        is the ids padded to a payload the estimate takes (`PROBE_PAD_BYTES`): its cost is the
        padding's bytes. Otherwise (and for a link whose risk of drops keeps KV off it) it is a
        KV medium instead, of those that would win, the one cheapest at the current estimate (if
        the link is still slow, the probe costs least). Each probe doubles the wait (a link that
        stays slow costs ever fewer probes), but for a padded one whose padding costs at most
        `PROBE_SHARE` of the transfer; a drop or a rise restarts it. A probe's sample
        moves the estimate at once (`LinkEstimate.observe` with ``probe``).
        """
        ex, req = self.exploration, pending.request
        if ex.link_every <= 0:
            return None
        path = _path(pending, rx) or PathName.NATS
        est = state.link(req.src, rx, path)
        probe = self._probes.setdefault((req.src, rx, path), _ProbeState(ex.link_every))
        if probe.changes != est.changes:
            probe.changes, probe.every, probe.unmeasured = est.changes, ex.link_every, 0
        if choice.estimate.nbytes >= SMALL_PAYLOAD_BYTES:
            probe.unmeasured = 0  # this transfer measures the link itself
            return None
        probe.unmeasured += 1
        if not est.known:
            return None
        due = probe.unmeasured >= probe.every
        rate_in_doubt = True
        if est.rising:
            hope, why = est.last_rate_bps, "confirming a rise to"
        elif est.peak_bps > RISE_FACTOR * est.bandwidth_bps and due:
            hope, why = est.peak_bps, "it was"
        elif due and self.drop_risk and est.drop_risk()[0] > 0:
            # The link is back, but its recent drops priced every KV medium out: without samples
            # that find it steady the risk would only fade with age, so one is taken (back-off).
            hope, why, rate_in_doubt = est.bandwidth_bps, "a risk of drops kept KV off it; it runs at", False
        else:
            return None
        # Padded ids tell a rate; a risk of drops fades only with the KV transfers that run steady.
        cheap = choice.medium == "tokens" and rate_in_doubt
        if not self._may_explore(state, pending, rx, capped=not cheap):
            return None
        best = choice.estimate.total_s
        options: list[tuple[float, Estimate]] = []
        for e in choice.candidates:
            if not e.usable or e.medium == choice.medium or e.nbytes < SMALL_PAYLOAD_BYTES:
                continue
            if not self.model.refresh_allows(e, req.fidelity):
                continue
            hoped = e.total_s - (e.comm_s - e.fixed_s) + e.nbytes / hope
            if hoped < best:
                options.append((hoped, e))
        if not options:
            return None
        hoped, e = min(options, key=lambda o: o[1].total_s)
        # The ids padded to a measurable payload: the probe costs the padding's bytes, not a
        # whole KV's at a rate that may still be the slow one.
        padded = price(f"tokens({PROBE_PAD_BYTES})") if cheap else None
        # A probe that costs little next to the transfer it rides on keeps its pace: a link back
        # up is seen within `link_every` transfers, for at most PROBE_SHARE / link_every more time.
        if not est.rising and not (padded is not None and padded.total_s - best <= PROBE_SHARE * best):
            probe.every = min(MAX_PROBE_EVERY, 2 * probe.every)
        probe.unmeasured = 0
        cause = f"{why} {hope * 8 / 1e6:.0f} Mbit/s, now estimated {est.bandwidth_bps * 8 / 1e6:.0f}"
        if padded is not None:
            reason = (
                f"probe the link: {padded.medium} (the ids and {PROBE_PAD_BYTES >> 10} KiB of padding) measures it "
                f"({cause}); predicted {padded.total_s * 1000:.1f} ms against {best * 1000:.1f} ms unpadded, and "
                f"{e.medium} {hoped * 1000:.1f} ms if the link is back"
            )
            return replace(
                choice,
                medium=padded.medium,
                estimate=padded,
                candidates=(*choice.candidates, padded),
                reason=reason,
                explored=True,
                explored_link=True,
                kept_by_hysteresis=False,
            )
        reason = (
            f"explore the link: {e.medium} measures it again ({cause}); predicted "
            f"{hoped * 1000:.1f} ms there, {e.total_s * 1000:.1f} ms at the estimate, against {best * 1000:.1f} ms "
            f"for {choice.medium}"
        )
        return replace(
            choice,
            medium=e.medium,
            estimate=e,
            reason=reason,
            explored=True,
            explored_link=True,
            kept_by_hysteresis=False,
        )

    def _explore(self, state: GroupState, pending: Pending, choice: Choice, rx: str) -> Choice | None:
        """The medium to measure on this transfer instead of ``choice``, if any (see `Exploration`).

        A candidate is worth measuring only if it could win: if it would beat ``choice`` with its
        compute terms ``1 + margin`` times faster than predicted (they are what an unmeasured
        medium's prior can get wrong; its bytes over the pair's measured link are known, and so is
        a recompute on a receiver that measured its prefill speed).
        """
        ex = self.exploration
        req = pending.request
        if not self._may_explore(state, pending, rx):
            return None
        learned = self.model.learned
        now = time.time()
        best = choice.estimate.total_s
        prefill_known = self.endpoint(state, rx, None).prefill_measured
        options: list[tuple[int, float, Estimate]] = []
        for e in choice.candidates:
            if not e.usable or e.medium == choice.medium:
                continue
            unsure = e.comp_s - (e.recompute_s if prefill_known else 0.0)
            if e.total_s - unsure * ex.margin / (1 + ex.margin) >= best:
                continue
            if not self.model.refresh_allows(e, req.fidelity):
                continue
            n, ts = learned.measured(e.medium, req.nbytes)
            if n < ex.min_samples or now - ts > ex.stale_s:
                options.append((n, e.total_s, e))
        if not options:
            return None
        n, _, est = min(options, key=lambda o: (o[0], o[1]))
        reason = (
            f"explore: {est.medium} measured {n} time(s) at this size; predicted "
            f"{est.total_s * 1000:.1f} ms against {best * 1000:.1f} ms for {choice.medium}"
        )
        return replace(choice, medium=est.medium, estimate=est, reason=reason, explored=True, kept_by_hysteresis=False)

    def _hedge(self, choice: Choice, link: Link, choose: Callable[..., Choice], lineage: float) -> Choice:
        """For a pair whose link was never measured: the medium least far from the best at every
        rate the link may have.

        ``choice`` assumed ``default_bandwidth_bps``, the fastest link of the range: there a full
        context costs least, and on a 10 Mbit/s link it costs 10 to 100 times what ``tokens`` or a
        quantised medium would (a first transfer of 6 MB took 4.9 s for a prediction of 8 ms). So
        each candidate is predicted at ``HEDGE_POINTS`` rates from ``unmeasured_floor_bps`` up to
        the default, and the one whose worst ratio to the best at the same rate is smallest is
        sent. Its bytes (if enough, `SMALL_PAYLOAD_BYTES`) then measure the link, and later
        transfers are chosen on the estimate.
        """
        floor, top = self.unmeasured_floor_bps, link.bandwidth_bps
        if not 0 < floor < top:
            return choice

        def allowed(e: Estimate) -> bool:
            return e.usable and self.model.refresh_allows(e, lineage)

        worst: dict[str, float] = {e.medium: 1.0 for e in choice.candidates if allowed(e)}
        for i in range(HEDGE_POINTS):
            rate = floor * (top / floor) ** (i / (HEDGE_POINTS - 1))
            at = replace(link, bandwidth_bps=rate)
            if link.inline is not None and link.inline.source == "default":
                at = replace(at, inline=replace(link.inline, bandwidth_bps=rate))
            totals = {e.medium: e.total_s for e in choose(link=at).candidates if e.medium in worst and allowed(e)}
            if not totals:
                return choice
            low = max(min(totals.values()), 1e-9)
            for medium in worst:
                worst[medium] = max(worst[medium], totals.get(medium, math.inf) / low)
        medium = min(worst, key=lambda m: (worst[m], m != choice.medium))
        if medium == choice.medium or not math.isfinite(worst[medium]):
            return choice
        est = next(e for e in choice.candidates if e.medium == medium)
        reason = (
            f"link not measured yet: {medium} is at most {worst[medium]:.1f}x the best at any rate from "
            f"{floor * 8 / 1e6:.0f} to {top * 8 / 1e6:.0f} Mbit/s ({choice.medium}, best at "
            f"{top * 8 / 1e6:.0f}, up to {worst[choice.medium]:.1f}x)"
        )
        return replace(choice, medium=medium, estimate=est, reason=reason, kept_by_hysteresis=False, hedged=True)

    def _broadcast_choice(self, per_rx: list[Choice]) -> Choice | None:
        """One medium for all receivers: the one whose slowest receiver is fastest."""
        media = [e.medium for e in per_rx[0].candidates]
        best: tuple[float, str] | None = None
        for m in media:
            worst = 0.0
            for c in per_rx:
                est = next((e for e in c.candidates if e.medium == m), None)
                if est is None or not est.usable:
                    worst = math.inf
                    break
                worst = max(worst, est.total_s)
            if worst < math.inf and (best is None or worst < best[0]):
                best = (worst, m)
        if best is None:
            return None
        medium = best[1]
        slowest: Estimate = max(
            (next(e for e in c.candidates if e.medium == medium) for c in per_rx), key=lambda e: e.total_s
        )
        return Choice(medium, slowest, per_rx[0].candidates, f"broadcast: slowest receiver fastest with {medium}")


def default_selector(config: SchedulerConfig) -> MediumSelector:
    """The adaptive selector over the calibration profile (fallback figures if none loads), or static."""
    if config.selector == "static":
        return StaticSelector()
    try:
        from kvbus.codecs.calibration import load_profile

        model = CostModel.from_profile(load_profile(), config=CostConfig(hysteresis=config.hysteresis))
    except Exception as exc:  # noqa: BLE001 - no profile: decisions say they used fallback figures
        logger.warning("no calibration profile (%s); the cost model uses fallback figures", exc)
        model = CostModel(config=CostConfig(hysteresis=config.hysteresis))
    exploration = Exploration(
        fraction=config.explore_fraction,
        margin=config.explore_margin,
        min_samples=config.explore_min_samples,
        stale_s=config.explore_stale_s,
        link_every=config.explore_link_every,
    )
    return AdaptiveSelector(
        model,
        default_bandwidth_bps=config.default_bandwidth_bps,
        default_shm_bandwidth_bps=config.default_shm_bandwidth_bps,
        unmeasured_floor_bps=config.unmeasured_floor_bps,
        exploration=exploration,
        drop_risk=config.link_drop_risk,
    )
