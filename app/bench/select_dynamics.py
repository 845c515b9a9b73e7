"""The dynamic cases of `kvbus bench select`: a link that follows a bandwidth trace (adaptive against
every static medium over the whole trace), and how often a pair switches medium on a link that
jitters around the crossover of its two best media, with and without hysteresis."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import statistics
from importlib import resources
from typing import TYPE_CHECKING, Any

import torch

from kvbus.app.bench.rounds import spread
from kvbus.app.bench.select_net import shifted
from kvbus.bus import EmulatedLink
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig
from kvbus.group_scheduler.cost_model import CostModel

if TYPE_CHECKING:
    from kvbus.app.bench.select import Harness


def _trace() -> list[tuple[int, float]]:
    data = json.loads(resources.files("kvbus.data").joinpath("bandwidth_trace.json").read_text())
    return [(int(p["transfers"]), float(p["mbit"])) for p in data["phases"]]


#: After the first round, a static medium whose total was more than this many times the best
#: static's is not replayed again: it cannot be the best static of a later round (its gap is far
#: beyond the run-to-run spread), and at the trace's slow phases it costs minutes per replay.
PRUNE_FACTOR = 2.0


async def fluctuating(h: Harness, shape: str, n: int, quick: bool, rounds: int = 1) -> dict[str, Any]:
    """The shipped bandwidth trace (``kvbus/data/bandwidth_trace.json``) replayed on one pair per
    policy, in ``rounds`` interleaved rounds (each: adaptive, then every static medium): the sum of
    latency plus quality penalty over the trace. The figure is the median over rounds of adaptive's
    total over the best static total of the same round."""
    trace = _trace()
    if quick:
        trace = [(max(2, k // 2), mbit) for k, mbit in trace]
    policies: list[str | None] = [None]
    for static in h.media:
        if max(h.predict(shape, n, mbit, static) for _, mbit in trace) <= 4 * h.cap_s:
            policies.append(static)
    totals: dict[str, list[float]] = {}
    ratios: list[float] = []
    pruned: list[str] = []
    chosen: list[str] = []
    steps: list[dict[str, Any]] = []
    for r in range(max(1, rounds)):
        this_round: dict[str, float] = {}
        for medium in policies:
            label = medium or "adaptive"
            if label in pruned:
                continue
            pair = await h.pair(shape, trace[0][1])
            total = 0.0
            for count, mbit in trace:
                await pair.set_link(mbit)
                await asyncio.sleep(0.05)
                for _ in range(count):
                    lat, used, _ = await h.once(pair, n, medium)
                    total += lat + h.loss_s(used, n)
                    if medium is None:
                        chosen.append(used)
                        steps.append({"round": r, **_step(mbit, lat, pair.last_decision)})
            this_round[label] = round(total, 3)
            totals.setdefault(label, []).append(round(total, 3))
            await pair.close()
        best = min(v for k, v in this_round.items() if k != "adaptive")
        ratios.append(round(this_round["adaptive"] / best, 3))
        if r == 0:
            pruned = [k for k, v in this_round.items() if k != "adaptive" and v > PRUNE_FACTOR * best]
    medians = {k: round(statistics.median(v), 3) for k, v in totals.items()}
    best_static = min((v, k) for k, v in medians.items() if k != "adaptive")
    return {
        "shape": shape,
        "tokens": n,
        "trace_mbit": [m for _, m in trace],
        "rounds": max(1, rounds),
        "totals_s": medians,
        "totals_s_rounds": totals,
        "pruned_after_first_round": pruned,
        "best_static": best_static[1],
        "adaptive_media": chosen,
        "adaptive_decisions": steps,
        "fluctuating_adaptive_vs_best_static": round(statistics.median(ratios), 3),
        "fluctuating_adaptive_vs_best_static_rounds": spread(ratios),
        "ratios_per_round": ratios,
    }


def _step(mbit: float, latency_s: float, decision: dict[str, Any]) -> dict[str, Any]:
    """One adaptive transfer of the trace as its decision record saw it: the link, the medium and
    why, and each candidate's predicted total beside what the transfer took."""
    return {
        "mbit": mbit,
        "medium": decision.get("medium"),
        "reason": decision.get("reason"),
        "explored": bool(decision.get("explored")),
        "latency_s": round(latency_s, 4),
        "predicted_s": decision.get("predicted_s"),
        "candidates_s": {
            c["medium"]: c.get("total_s") for c in decision.get("candidates", ()) if c.get("total_s") is not None
        },
        "terms": next(
            (c.get("terms") for c in decision.get("candidates", ()) if c.get("medium") == decision.get("medium")), None
        ),
        "links": decision.get("links", {}),
    }


async def switches(url: str, h: Harness, shape: str, n: int, hysteresis: float, samples: int) -> int:
    """Switches of one pair's medium over a link whose rate jitters +-10 % around the crossover of
    the two best media. The crossover is re-solved from every decision record (the predicted
    terms of each candidate), so the link stays where the choice is closest even as the
    scheduler's estimates and the agents' load move it."""
    sched = await GroupScheduler.connect(
        url, f"hyst{int(hysteresis * 100)}", config=SchedulerConfig(hysteresis=hysteresis)
    )
    try:
        center = _crossover(h, shape, n)
        g = torch.Generator().manual_seed(3)
        tx = await h.tx_bus.agent(
            f"hyst-tx{int(hysteresis * 100)}", group=sched.group, runner=h.runner, link=EmulatedLink.mbit(center)
        )
        rx = await h.rx_bus.agent(f"hyst-rx{int(hysteresis * 100)}", group=sched.group, runner=h.runner)
        kv = h.quality.context(n)
        media = []
        for _ in range(samples):
            rate = center * (1 + 0.1 * (2 * float(torch.rand(1, generator=g)) - 1))
            await tx.set_link(EmulatedLink.mbit(rate))
            await asyncio.sleep(0.02)
            h.n += 1
            report = await tx.send(rx.name, shifted(kv, h.n))
            await rx.receive(timeout=600)
            media.append(report.medium)
            center = _solve_crossover(report.decision.get("candidates", []), rate) or center
        await tx.close()
        await rx.close()
        return sum(1 for a, b in itertools.pairwise(media) if a != b)
    finally:
        await sched.close()


def _solve_crossover(candidates: list[dict[str, Any]], mbit: float) -> float | None:
    """The link rate (Mbit/s) at which the two best candidates of a decision would cost the same."""
    bps = mbit * 1e6 / 8
    usable = sorted((c for c in candidates if c.get("total_s") is not None), key=lambda c: c["total_s"])
    for i, a in enumerate(usable):
        for b in usable[i + 1 : i + 3]:
            if a["bytes"] == b["bytes"]:
                continue
            other_a = a["total_s"] - a["bytes"] / bps
            other_b = b["total_s"] - b["bytes"] / bps
            if other_b == other_a:
                continue
            rate = (a["bytes"] - b["bytes"]) / (other_b - other_a)
            if rate > 0:
                return float(min(1e5, max(1.0, rate * 8 / 1e6)))
        break
    return None


def _crossover(h: Harness, shape: str, n: int) -> float:
    """A link rate (Mbit/s) where the two best media are predicted within a few percent (by a fresh
    model, as the hysteresis runs' schedulers start without learned corrections)."""
    fresh = CostModel(h.model.figures, config=h.model.config)
    fresh.default_model_costs = h.model.default_model_costs
    probe = dataclasses.replace(h, model=fresh)
    best_gap, best_rate = math.inf, 100.0
    for i in range(120):
        mbit = 10 ** (1 + 3 * i / 119)
        preds = sorted(probe.predict(shape, n, mbit, m) for m in h.media)
        gap = (preds[1] - preds[0]) / preds[0] if len(preds) > 1 and preds[0] > 0 else math.inf
        if gap < best_gap and preds[0] < h.cap_s:
            best_gap, best_rate = gap, mbit
    return best_rate
