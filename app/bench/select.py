"""`kvbus bench select`: adaptive medium selection against every static medium, on emulated links.

Real agents (bus clients on a real nats-server, a real group scheduler) send SmolLM2-shaped and
Llama-3-8B-shaped caches over emulated links (the sender is paced to the link's rate; see
`kvbus.bus.EmulatedLink`). Receivers that must rebuild KV from tokens use `CalibratedRunner`:
it takes the prefill time the calibration profile measured for SmolLM2 on this machine (for
the 8B shape, scaled by the parameter count) and returns a KV of the right shape; the bench
measures selection, not a model.

Per cell (link x context x shape) the same context goes with ``adaptive`` (after one warm-up
transfer so the scheduler has seen the link) and with each static medium. Static media whose
predicted time exceeds ``--cap`` seconds and is more than 1.5x the best prediction are not run
(they cannot be the best; their prediction is reported instead). The figure compared is the
end-to-end objective the mission defines: observed latency (send -> verified and decoded at the
receiver, recompute included) plus the medium's fidelity penalty C_loss; raw latency ratios are
reported too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from kvbus.app.local import NatsServer
from kvbus.bus import Bus, BusConfig, EmulatedLink
from kvbus.codecs import get_codec
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig
from kvbus.group_scheduler.cost_model import CostModel, Endpoint, Link
from kvbus.group_scheduler.selection import AdaptiveSelector
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

logger = logging.getLogger(__name__)

SMOLLM2 = ModelSignature(
    "SmolLM2-135M-Instruct",
    n_layers=30,
    n_kv_heads=3,
    head_dim=64,
    dtype="float32",
    vocab_size=49152,
    rope_theta=100000.0,
)
LLAMA3_8B = ModelSignature(
    "llama-3-8b-shape",
    n_layers=32,
    n_kv_heads=8,
    head_dim=128,
    dtype="bfloat16",
    vocab_size=128256,
    rope_theta=500000.0,
)
SHAPES = {"smollm2": SMOLLM2, "llama3-8b": LLAMA3_8B}
PARAMS = {"smollm2": 135e6, "llama3-8b": 8.03e9}
LINKS_MBIT = (10, 100, 1000, 10000)
CONTEXTS = (128, 1024, 8192)


class CalibratedRunner:
    """A `ModelRunner` that takes the calibrated prefill time and returns a KV of the right shape."""

    def __init__(self, signature: ModelSignature, prefill_tokens_per_s: float) -> None:
        self.signature = signature
        self.prefill_tokens_per_s = prefill_tokens_per_s

    def prefill(self, tokens: torch.Tensor) -> KVCache:
        ids = tokens if tokens.dim() == 2 else tokens.unsqueeze(0)
        n = int(ids.shape[-1])
        t0 = time.perf_counter()
        shape = (ids.shape[0], self.signature.n_kv_heads, n, self.signature.head_dim)
        dtype = self.signature.torch_dtype
        keys = [torch.zeros(shape, dtype=dtype) for _ in range(self.signature.n_layers)]
        values = [torch.zeros(shape, dtype=dtype) for _ in range(self.signature.n_layers)]
        left = n / self.prefill_tokens_per_s - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        return KVCache(ids.to(torch.int64), self.signature, keys, values)


def make_kv(signature: ModelSignature, n_tokens: int, seed: int = 0) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    shape = (1, signature.n_kv_heads, n_tokens, signature.head_dim)

    def one() -> torch.Tensor:
        # KV-like: most channels small, a few outlier channels (as real keys have).
        t = torch.randn(shape, generator=g) * 0.5
        t[..., :4] *= 8
        return t.to(signature.torch_dtype)

    keys = [one() for _ in range(signature.n_layers)]
    values = [one() for _ in range(signature.n_layers)]
    tokens = torch.randint(0, signature.vocab_size, (1, n_tokens), generator=g)
    return KVCache(tokens, signature, keys, values)


@dataclass
class Harness:
    url: str
    sched: GroupScheduler
    tx_bus: Bus
    rx_bus: Bus
    model: CostModel
    prefill_tps: dict[str, float]
    media: list[str]
    cap_s: float
    n: int = 0

    async def pair(self, shape: str, mbit: float, latency_ms: float = 0.5) -> tuple[Any, Any]:
        self.n += 1
        sig = SHAPES[shape]
        runner = CalibratedRunner(sig, self.prefill_tps[shape])
        link = EmulatedLink.mbit(mbit, latency_ms)
        tx = await self.tx_bus.agent(f"sel-tx{self.n}", group="select", signature=sig, runner=runner, link=link)
        rx = await self.rx_bus.agent(f"sel-rx{self.n}", group="select", signature=sig, runner=runner)
        return tx, rx

    def loss_s(self, medium: str) -> float:
        fig = self.model.figures.get(medium)
        if fig is None:
            return 0.0
        cfg = self.model.config
        return cfg.loss_weight * cfg.output_tokens * (1 - fig.fidelity) * self.model.default_model_costs.decode_token_s

    async def once(self, tx: Any, rx: Any, kv: KVCache, medium: str | None) -> tuple[float, str, int]:
        # A fresh context each time (new token ids over the same tensors): the receiver holds no
        # prefix of it, so delta media cannot make a repeated send look free.
        self.n += 1
        fresh = dataclasses.replace(kv, tokens=(kv.tokens + self.n) % kv.signature.vocab_size)
        report = await tx.send(rx.name, fresh, medium=medium)
        await rx.receive(timeout=600)
        return report.total_s, report.medium, report.nbytes

    def predict(self, shape: str, n: int, mbit: float, medium: str) -> float:
        sig = SHAPES[shape]
        end = Endpoint(sig, model=self.model.default_model_costs)
        est = self.model.estimate(
            medium,
            n_tokens=n,
            kv_bytes=n * sig.kv_bytes_per_token(),
            link=Link(mbit * 1e6 / 8, 0.001),
            sender=end,
            receiver=end,
        )
        return est.total_s if est.usable else math.inf


async def _cell(h: Harness, shape: str, n: int, mbit: float) -> dict[str, Any]:
    tx, rx = await h.pair(shape, mbit)
    kv = make_kv(SHAPES[shape], n, seed=n)
    row: dict[str, Any] = {"shape": shape, "tokens": n, "mbit": mbit, "static": {}, "predicted": {}}
    preds = {m: h.predict(shape, n, mbit, m) for m in h.media}
    row["predicted"] = {m: (round(p, 4) if math.isfinite(p) else None) for m, p in preds.items()}
    best_pred = min(preds.values())
    await h.once(tx, rx, kv, None)  # warm-up: the scheduler sees the link once
    runs = [await h.once(tx, rx, kv, None) for _ in range(2)]
    row["adaptive"] = {
        "latency_s": round(statistics.median(r[0] for r in runs), 4),
        "media": [r[1] for r in runs],
        "bytes": runs[-1][2],
    }
    row["adaptive"]["objective_s"] = round(
        row["adaptive"]["latency_s"] + statistics.mean(h.loss_s(r[1]) for r in runs), 4
    )
    for m in h.media:
        p = preds[m]
        if not math.isfinite(p) or (p > h.cap_s and p > 1.5 * best_pred):
            continue
        times = [await h.once(tx, rx, kv, m)]
        if times[0][0] < 0.5:
            times.append(await h.once(tx, rx, kv, m))
        lat = statistics.median(t[0] for t in times)
        row["static"][m] = {
            "latency_s": round(lat, 4),
            "objective_s": round(lat + h.loss_s(m), 4),
            "bytes": times[0][2],
        }
    best = min(row["static"].items(), key=lambda kv_: kv_[1]["objective_s"])
    row["best_static"] = best[0]
    row["adaptive_vs_best_static"] = round(row["adaptive"]["objective_s"] / best[1]["objective_s"], 3)
    best_lat = min(v["latency_s"] for v in row["static"].values())
    row["adaptive_vs_best_static_latency"] = round(row["adaptive"]["latency_s"] / best_lat, 3)
    await tx.close()
    await rx.close()
    return row


def _trace() -> list[tuple[int, float]]:
    data = json.loads(resources.files("kvbus.data").joinpath("bandwidth_trace.json").read_text())
    return [(int(p["transfers"]), float(p["mbit"])) for p in data["phases"]]


async def _fluctuating(h: Harness, shape: str, n: int, quick: bool) -> dict[str, Any]:
    trace = _trace()
    if quick:
        trace = [(max(2, k // 2), mbit) for k, mbit in trace]
    kv = make_kv(SHAPES[shape], n, seed=7)
    totals: dict[str, float] = {}
    chosen: list[str] = []
    for medium in [None, *h.media]:
        label = medium or "adaptive"
        if medium is not None and max(h.predict(shape, n, mbit, medium) for _, mbit in trace) > 4 * h.cap_s:
            continue
        tx, rx = await h.pair(shape, trace[0][1])
        total = 0.0
        for count, mbit in trace:
            await tx.set_link(EmulatedLink.mbit(mbit, 0.5))
            await asyncio.sleep(0.05)
            for _ in range(count):
                lat, used, _ = await h.once(tx, rx, kv, medium)
                total += lat + h.loss_s(used)
                if medium is None:
                    chosen.append(used)
        totals[label] = round(total, 3)
        await tx.close()
        await rx.close()
    best_static = min((v, k) for k, v in totals.items() if k != "adaptive")
    return {
        "shape": shape,
        "tokens": n,
        "trace_mbit": [m for _, m in trace],
        "totals_s": totals,
        "best_static": best_static[1],
        "adaptive_media": chosen,
        "fluctuating_adaptive_vs_best_static": round(totals["adaptive"] / best_static[0], 3),
    }


async def _switches(url: str, h: Harness, shape: str, n: int, hysteresis: float, samples: int) -> int:
    """Switches of one pair's medium over a link whose rate jitters +-10 % around the crossover of
    the two best media. The crossover is re-solved from every decision record (the predicted
    terms of each candidate), so the link stays where the choice is closest even as the
    scheduler's estimates and the agents' load move it."""
    sched = await GroupScheduler.connect(
        url, f"hyst{int(hysteresis * 100)}", config=SchedulerConfig(hysteresis=hysteresis)
    )
    try:
        sig = SHAPES[shape]
        center = _crossover(h, shape, n)
        g = torch.Generator().manual_seed(3)
        runner = CalibratedRunner(sig, h.prefill_tps[shape])
        tx = await h.tx_bus.agent(
            f"hyst-tx{int(hysteresis * 100)}",
            group=sched.group,
            signature=sig,
            runner=runner,
            link=EmulatedLink.mbit(center),
        )
        rx = await h.rx_bus.agent(f"hyst-rx{int(hysteresis * 100)}", group=sched.group, signature=sig, runner=runner)
        kv = make_kv(sig, n, seed=11)
        media = []
        for _ in range(samples):
            rate = center * (1 + 0.1 * (2 * float(torch.rand(1, generator=g)) - 1))
            await tx.set_link(EmulatedLink.mbit(rate))
            await asyncio.sleep(0.02)
            h.n += 1
            fresh = dataclasses.replace(kv, tokens=(kv.tokens + h.n) % sig.vocab_size)
            report = await tx.send(rx.name, fresh)
            await rx.receive(timeout=600)
            media.append(report.medium)
            center = _solve_crossover(report.decision.get("candidates", []), rate) or center
        await tx.close()
        await rx.close()
        return sum(1 for a, b in zip(media, media[1:]) if a != b)
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
                return min(1e5, max(1.0, rate * 8 / 1e6))
        break
    return None


def _crossover(h: Harness, shape: str, n: int) -> float:
    """A link rate (Mbit/s) where the two best media are predicted within a few percent (by a fresh
    model, as the hysteresis runs' schedulers start without learned corrections)."""
    fresh = CostModel(h.model.figures, config=h.model.config)
    fresh.default_model_costs = h.model.default_model_costs
    probe = Harness(h.url, h.sched, h.tx_bus, h.rx_bus, fresh, h.prefill_tps, h.media, h.cap_s)
    best_gap, best_rate = math.inf, 100.0
    for i in range(120):
        mbit = 10 ** (1 + 3 * i / 119)
        preds = sorted(probe.predict(shape, n, mbit, m) for m in h.media)
        gap = (preds[1] - preds[0]) / preds[0] if len(preds) > 1 and preds[0] > 0 else math.inf
        if gap < best_gap and preds[0] < h.cap_s:
            best_gap, best_rate = gap, mbit
    return best_rate


async def _relay(h: Harness, shape: str, n: int, hops: int, mbit: float) -> dict[str, Any]:
    sig = SHAPES[shape]
    runner = CalibratedRunner(sig, h.prefill_tps[shape])
    agents = []
    for i in range(hops + 1):
        bus = h.tx_bus if i % 2 == 0 else h.rx_bus
        agents.append(
            await bus.agent(
                f"relay{i}", group="select", signature=sig, runner=runner, link=EmulatedLink.mbit(mbit, 0.5)
            )
        )
    kv = make_kv(sig, n, seed=5)
    threshold = h.sched.policy.selector.model.config.refresh_threshold  # type: ignore[attr-defined]
    hop_media, lineage, total_bytes = [], [], 0
    ctx = kv
    for i in range(hops):
        report = await agents[i].send(agents[i + 1].name, ctx)
        d = await agents[i + 1].receive(timeout=600)
        ctx = d.kv
        hop_media.append(report.medium)
        lineage.append(round(ctx.fidelity, 4))
        total_bytes += report.nbytes
    int4_bytes = hops * get_codec("int4").encode(kv).nbytes if "int4" in h.media else 0
    for a in agents:
        await a.close()
    return {
        "hops": hops,
        "mbit": mbit,
        "media": hop_media,
        "lineage": lineage,
        "min_lineage": min(lineage),
        "threshold": threshold,
        "bytes": total_bytes,
        "all_int4_bytes": int4_bytes,
        "bytes_vs_all_int4": round(total_bytes / int4_bytes, 3) if int4_bytes else None,
    }


async def _run(quick: bool, nats_url: str | None, cap_s: float) -> dict[str, Any]:
    server = None if nats_url else NatsServer().start()
    url = nats_url or server.url  # type: ignore[union-attr]
    try:
        sched = await GroupScheduler.connect(url, "select")
        selector = sched.policy.selector
        if not isinstance(selector, AdaptiveSelector):
            raise RuntimeError("the select bench needs the adaptive selector")
        model = selector.model
        smol_tps = model.default_model_costs.prefill_tokens_per_s
        prefill_tps = {"smollm2": smol_tps, "llama3-8b": smol_tps * PARAMS["smollm2"] / PARAMS["llama3-8b"]}
        media = [m for m in selector.candidates if not m.startswith("delta+") and not m.startswith("summary")]
        cfg = BusConfig(peer_timeout=120.0, grant_timeout=600.0, request_timeout=30.0)
        h = Harness(
            url,
            sched,
            await Bus.connect(url, config=cfg),
            await Bus.connect(url, config=cfg),
            model,
            prefill_tps,
            media,
            cap_s,
        )
        for shape in SHAPES:
            # First calls of a codec pay one-time costs (allocator, kernels): not part of any cell.
            warm = make_kv(SHAPES[shape], 64)
            for m in media:
                codec = get_codec(m)
                if codec.needs_kv:
                    enc = codec.encode(warm)
                    codec.decode(enc)
        links = (10, 1000, 10000) if quick else LINKS_MBIT
        contexts = (128, 1024) if quick else CONTEXTS
        shapes = ("smollm2",) if quick else tuple(SHAPES)
        cells = []
        for shape in shapes:
            for n in contexts:
                for mbit in links:
                    t0 = time.perf_counter()
                    row = await _cell(h, shape, n, mbit)
                    logger.info(
                        "cell %s n=%d %s Mbit/s: adaptive %s vs best static %s (%s) in %.1f s",
                        shape,
                        n,
                        mbit,
                        row["adaptive"]["media"],
                        row["best_static"],
                        row["adaptive_vs_best_static"],
                        time.perf_counter() - t0,
                    )
                    print(
                        f"{shape:>9} {n:>5} tok {mbit:>6} Mbit/s: adaptive {row['adaptive']['media'][-1]:<16} "
                        f"best static {row['best_static']:<16} ratio {row['adaptive_vs_best_static']:.3f}",
                        flush=True,
                    )
                    cells.append(row)
        fluct = await _fluctuating(h, "smollm2", 256, quick)
        print(
            f"fluctuating: adaptive / best static ({fluct['best_static']}) = "
            f"{fluct['fluctuating_adaptive_vs_best_static']}",
            flush=True,
        )
        samples = 12 if quick else 30
        with_h = await _switches(url, h, "smollm2", 256, 0.15, samples)
        without_h = await _switches(url, h, "smollm2", 256, 0.0, samples)
        print(f"switches: {with_h} with hysteresis, {without_h} without", flush=True)
        relay = await _relay(h, "smollm2", 1024, 20 if not quick else 8, 100)
        print(
            f"relay: min lineage {relay['min_lineage']} (threshold {relay['threshold']}), bytes / all-int4 "
            f"{relay['bytes_vs_all_int4']}",
            flush=True,
        )
        await h.tx_bus.close()
        await h.rx_bus.close()
        await sched.close()
        results = {
            "adaptive_vs_best_static_max": max(c["adaptive_vs_best_static"] for c in cells),
            "adaptive_vs_best_static_latency_max": max(c["adaptive_vs_best_static_latency"] for c in cells),
            "fluctuating_adaptive_vs_best_static": fluct["fluctuating_adaptive_vs_best_static"],
            "switches_with_hysteresis": with_h,
            "switches_without_hysteresis": without_h,
            "relay": relay,
            "fluctuating": fluct,
            "cells": cells,
        }
        return {
            "suite": "select",
            "config": {
                "links_mbit": list(links),
                "contexts": list(contexts),
                "shapes": list(shapes),
                "media": media,
                "cap_s": cap_s,
                "prefill_tokens_per_s": prefill_tps,
                "calibrated": model.calibrated,
                "hysteresis": model.config.hysteresis,
                "objective": "observed latency + C_loss of the medium used",
            },
            "results": results,
        }
    finally:
        if server is not None:
            server.stop()


def plot(out: dict[str, Any], path: Path) -> None:
    """Latency vs bandwidth per medium (one panel per shape x context)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = out["results"]["cells"]
    keys = sorted({(c["shape"], c["tokens"]) for c in cells})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, (shape, n) in zip(axes[0], keys):
        rows = sorted((c for c in cells if c["shape"] == shape and c["tokens"] == n), key=lambda c: c["mbit"])
        media = sorted({m for c in rows for m in c["static"]})
        for m in media:
            pts = [(c["mbit"], c["static"][m]["latency_s"]) for c in rows if m in c["static"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", lw=1, label=m)
        ax.plot(
            [c["mbit"] for c in rows],
            [c["adaptive"]["latency_s"] for c in rows],
            "k--",
            marker="*",
            ms=10,
            lw=2,
            label="adaptive",
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link (Mbit/s)")
        ax.set_ylabel("latency (s)")
        ax.set_title(f"{shape}, {n} tokens")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(
    *, quick: bool = False, nats_url: str | None = None, cap_s: float = 3.0, plot_path: str | None = None, **_: Any
) -> dict[str, Any]:
    out = asyncio.run(_run(quick, nats_url, cap_s))
    target = Path(plot_path or "docs/select_latency_vs_bandwidth.png")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        plot(out, target)
        out["config"]["plot"] = str(target)
        print(f"plot: {target}")
    except ImportError:
        logger.warning("matplotlib is not installed; no plot")
    return out
