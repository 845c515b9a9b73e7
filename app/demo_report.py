"""The demo's report: one row per policy over its interleaved rounds (median, min, max), the
terminal table, and ``kvbus-report/`` (Markdown, JSON, PNG plots); the figures that compare
adaptive with the static policies (`compare`) and the compute check (`compute_check`)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvbus.app.bench.rounds import median, ratio, spread
from kvbus.app.workflow import RunResult
from kvbus.app.workflow_remote import RemoteTeam


def agreement(run: RunResult, reference: RunResult) -> float:
    """Share of generated tokens equal to the reference run's, position by position."""
    same = total = 0
    for agent, outs in reference.outputs.items():
        mine = run.outputs.get(agent, [])
        for ref, got in zip(outs, mine):
            n = min(ref.shape[-1], got.shape[-1])
            same += int((ref[..., :n] == got[..., :n]).sum())
            total += ref.shape[-1]
    return same / total if total else 1.0


def _one(r: RunResult, ref: RunResult | None) -> dict[str, Any]:
    lat = sorted(t.latency_s for t in r.transfers)
    p99 = lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))] if lat else 0.0
    return {
        "e2e_s": r.e2e_s,
        "transfers": len(r.transfers),
        "p50_ms": statistics.median(lat) * 1000 if lat else 0.0,
        "p99_ms": p99 * 1000,
        "bytes": sum(t.nbytes for t in r.transfers),
        "recompute_s": r.recompute_s,
        "peak_kv_bytes": r.peak_kv_bytes,
        "agreement": agreement(r, ref) if ref else None,
        "media": sorted({t.medium for t in r.transfers}),
    }


def _as_rounds(runs: Mapping[str, RunResult | Sequence[RunResult]]) -> dict[str, list[RunResult]]:
    return {p: [r] if isinstance(r, RunResult) else list(r) for p, r in runs.items()}


def summarise(runs: Mapping[str, RunResult | Sequence[RunResult]]) -> list[dict[str, Any]]:
    """One row per policy: medians over its rounds (``e2e_s_rounds`` etc. hold median, min, max).

    Agreement is with the ``full`` run of the same round (greedy decoding: lossless runs agree
    exactly)."""
    by = _as_rounds(runs)
    refs = {r.round: r for r in by.get("full", [])}
    rows = []
    for policy, rs in by.items():
        each = [_one(r, refs.get(r.round)) for r in rs]
        row: dict[str, Any] = {"policy": policy, "rounds": len(rs)}
        for key in ("e2e_s", "p50_ms", "p99_ms", "recompute_s"):
            row[key] = round(median(e[key] for e in each) or 0.0, 3)
            row[f"{key}_rounds"] = spread((e[key] for e in each), digits=3)
        row["transfers"] = int(median(e["transfers"] for e in each) or 0)
        row["bytes"] = int(median(e["bytes"] for e in each) or 0)
        row["peak_kv_bytes"] = max(e["peak_kv_bytes"] for e in each)
        agree = [e["agreement"] for e in each if e["agreement"] is not None]
        row["agreement"] = round(median(agree), 4) if agree else None  # type: ignore[arg-type]
        row["agreement_min"] = round(min(agree), 4) if agree else None
        row["media"] = sorted({m for e in each for m in e["media"]})
        rows.append(row)
    return rows


def render_table(rows: list[dict[str, Any]], console: Console) -> None:
    """The rows in the terminal."""
    table = Table(title=escape("the same workflow under each policy (median over interleaved rounds [min - max])"))
    for col in (
        "policy",
        "E2E",
        "p50 / p99 per transfer",
        "bytes moved",
        "recompute",
        "peak KV",
        "agreement w/ full",
        "media used",
    ):
        table.add_column(col, justify="left" if col in ("policy", "media used") else "right")
    for r in rows:
        sp = r.get("e2e_s_rounds") or {}
        rng = f" [{sp['min']:.1f}-{sp['max']:.1f}]" if sp.get("n", 0) > 1 else ""
        table.add_row(
            r["policy"],
            f"{r['e2e_s']:.1f} s{rng}",
            f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f} ms",
            f"{r['bytes'] / 1e6:.1f} MB",
            f"{r['recompute_s']:.1f} s",
            f"{r['peak_kv_bytes'] / 1e6:.0f} MB",
            "-" if r["agreement"] is None else f"{r['agreement']:.1%}",
            ", ".join(r["media"]),
        )
    console.print(table)


def _chosen(decision: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The chosen medium's estimate in a decision record."""
    return next((c for c in decision.get("candidates", ()) if c.get("medium") == decision.get("medium")), None)


def predictions(runs: Sequence[RunResult]) -> list[tuple[str, float, float, bool]]:
    """(medium, predicted s, measured s, explored) of every transfer of ``runs`` whose decision
    the scheduler made and whose sender measured it; predicted without the fidelity penalty
    (a penalty is not a time anything takes)."""
    out = []
    for run in runs:
        for t in run.transfers:
            est, measured = _chosen(t.decision), t.decision.get("measured") or {}
            if est is None or not measured.get("total_s") or est.get("total_s") is None:
                continue
            out.append((t.medium, est["comm_s"] + est["comp_s"], measured["total_s"], bool(t.decision.get("explored"))))
    return out


def prediction_summary(runs: Sequence[RunResult]) -> dict[str, Any]:
    """|predicted - measured| / measured over ``runs``' transfers (median, p90), and the share that explored."""
    pm = predictions(runs)
    errors = sorted(abs(p - m) / m for _, p, m, _ in pm if m > 0)
    n_decided = sum(1 for run in runs for t in run.transfers if t.decision.get("candidates"))
    return {
        "transfers": len(pm),
        "prediction_error_median": round(errors[len(errors) // 2], 3) if errors else None,
        "prediction_error_p90": round(errors[min(len(errors) - 1, int(0.9 * len(errors)))], 3) if errors else None,
        "explored": sum(1 for *_, e in pm if e),
        "explored_fraction": round(sum(1 for *_, e in pm if e) / n_decided, 3) if n_decided else None,
    }


def why_table(runs: Sequence[RunResult]) -> list[str]:
    """Markdown rows: per medium adaptive chose, how often, the median predicted terms of the
    choice (communication, computation, the fidelity penalty) and the median measured time."""
    by: dict[str, list[tuple[Mapping[str, Any], Mapping[str, Any], bool]]] = {}
    for run in runs:
        for t in run.transfers:
            est = _chosen(t.decision)
            if est is not None:
                by.setdefault(t.medium, []).append(
                    (est, t.decision.get("measured") or {}, bool(t.decision.get("explored")))
                )
    rows = [
        "| medium | transfers (explored) | predicted comm / comp / loss (ms) | predicted total (ms) | measured (ms) |",
        "|---|---|---|---|---|",
    ]
    for medium, items in sorted(by.items()):

        def med(key: str, src: int = 0, _items: list[Any] = items) -> float:
            vals = [float(i[src].get(key) or 0.0) for i in _items if i[src].get(key) is not None]
            return 1000 * (statistics.median(vals) if vals else float("nan"))

        rows.append(
            f"| {medium} | {len(items)} ({sum(1 for i in items if i[2])}) | {med('comm_s'):.0f} / "
            f"{med('comp_s'):.0f} / {med('loss_s'):.0f} | {med('total_s'):.0f} | {med('total_s', 1):.0f} |"
        )
    return rows


def pair_table(runs: Sequence[RunResult]) -> list[str]:
    """Markdown rows: per (sender, receivers) pair, the media adaptive sent and the reason of its last decision."""
    by: dict[tuple[str, tuple[str, ...]], list[Any]] = {}
    for run in runs:
        for t in run.transfers:
            by.setdefault((t.src, t.dst), []).append(t)
    rows = ["| pair | media sent (count) | last decision's reason |", "|---|---|---|"]
    for (src, dst), items in sorted(by.items()):
        counts: dict[str, int] = {}
        for t in items:
            counts[t.medium] = counts.get(t.medium, 0) + 1
        reason = str(items[-1].decision.get("reason") or "-").replace("|", "/")
        media = ", ".join(f"{m} ({n})" for m, n in sorted(counts.items()))
        rows.append(f"| {src} -> {', '.join(dst)} | {media} | {reason} |")
    return rows


def write_report(
    folder: Path, rows: list[dict[str, Any]], runs: Mapping[str, RunResult | Sequence[RunResult]], meta: dict[str, Any]
) -> None:
    """``report.md``, ``results.json`` and five PNG plots in ``folder``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.artist import Artist
    from matplotlib.patches import Rectangle

    by = _as_rounds(runs)
    folder.mkdir(parents=True, exist_ok=True)
    colours: dict[str, Any] = {}
    palette = plt.get_cmap("tab10")

    def colour(medium: str) -> Any:
        if medium not in colours:
            colours[medium] = palette(len(colours) % 10)
        return colours[medium]

    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows)), 3.4))
    names = [r["policy"] for r in rows]
    med = [r["e2e_s"] for r in rows]
    lo = [r["e2e_s"] - (r.get("e2e_s_rounds", {}).get("min") or r["e2e_s"]) for r in rows]
    hi = [(r.get("e2e_s_rounds", {}).get("max") or r["e2e_s"]) - r["e2e_s"] for r in rows]
    bars = ax.bar(
        names, med, color=["#dd8452" if n == "adaptive" else "#9db4d6" for n in names], yerr=[lo, hi], capsize=3
    )
    if "adaptive" in names:
        i = names.index("adaptive")
        bars[i].set_edgecolor("black")
        ax.axhline(med[i], color="#dd8452", linestyle="--", linewidth=1)
    ax.set_ylabel("end-to-end latency (s)")
    ax.set_title("workflow latency by policy (median, min-max over rounds; adaptive in orange)")
    ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    for label in ax.get_xticklabels():
        if label.get_text() == "adaptive":
            label.set_fontweight("bold")
    fig.tight_layout()
    fig.savefig(folder / "latency_by_policy.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.2))
    by_medium: dict[str, float] = {}
    for rs in by.values():
        for r in rs:
            for t in r.transfers:
                by_medium[t.medium] = by_medium.get(t.medium, 0.0) + t.nbytes / 1e6
    ax.bar(list(by_medium), list(by_medium.values()), color=[colour(m) for m in by_medium])
    ax.set_ylabel("MB on the wire (all runs)")
    ax.set_title("bytes by medium")
    ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.tight_layout()
    fig.savefig(folder / "bytes_by_medium.png", dpi=110)
    plt.close(fig)

    adaptive = by.get("adaptive", [None])[-1]
    if adaptive is not None:
        agents = sorted({t.src for t in adaptive.transfers})
        media = sorted({t.medium for t in adaptive.transfers})
        fig, ax = plt.subplots(figsize=(8, 0.5 + 0.5 * max(1, len(agents))))
        for i, agent in enumerate(agents):
            for t in adaptive.transfers:
                if t.src == agent:
                    ax.broken_barh([(t.start_s, max(t.latency_s, 0.005))], (i - 0.4, 0.8), color=colour(t.medium))
        ax.set_yticks(range(len(agents)), agents)
        ax.set_xlabel("time (s)")
        ax.set_title("adaptive run: transfers per sending agent, coloured by medium")
        handles = [Rectangle((0, 0), 1, 1, color=colour(m)) for m in media]
        ax.legend(handles, media, fontsize=7, loc="upper right")
        fig.tight_layout()
        fig.savefig(folder / "timeline_adaptive.png", dpi=110)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.45 * max(2, len(media))))
        most = max((t.tokens for t in adaptive.transfers), default=0) or 1

        def size(tokens: float) -> float:
            return 12 + 240 * tokens / most  # marker area in proportion to the context's tokens

        for t in adaptive.transfers:
            ax.scatter(t.start_s, media.index(t.medium), color=colour(t.medium), s=size(t.tokens), alpha=0.8)
        ax.set_yticks(range(len(media)), media)
        ax.set_ylim(-0.6, len(media) - 0.4)
        ax.set_xlabel("time (s)")
        ax.set_title("media chosen by adaptive over time (marker area ~ context tokens)")
        refs = sorted({max(1, round(most * f)) for f in (0.25, 0.5, 1.0)})
        sizes = [ax.scatter([], [], s=size(n), color="grey", alpha=0.6) for n in refs]
        keys: list[Artist] = [Rectangle((0, 0), 1, 1, color=colour(m)) for m in media]
        keys += sizes
        ax.legend(
            keys,
            media + [f"{n} tokens" for n in refs],
            fontsize=7,
            loc="center left",
            bbox_to_anchor=(1.01, 0.5),
        )
        fig.tight_layout()
        fig.savefig(folder / "media_over_time.png", dpi=110)
        plt.close(fig)

    pm = predictions(by.get("adaptive", []))
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    for medium in sorted({m for m, *_ in pm}):
        pts = [(p, m, e) for mm, p, m, e in pm if mm == medium]
        ax.scatter(
            [p * 1000 for p, _, _ in pts], [m * 1000 for _, m, _ in pts], color=colour(medium), label=medium, s=22
        )
        ex = [(p, m) for p, m, e in pts if e]
        if ex:
            ax.scatter(
                [p * 1000 for p, _ in ex], [m * 1000 for _, m in ex], facecolors="none", edgecolors="black", s=60
            )
    if pm:
        lo_ms = min(min(p, m) for _, p, m, _ in pm) * 1000
        hi_ms = max(max(p, m) for _, p, m, _ in pm) * 1000
        ax.plot([lo_ms, hi_ms], [lo_ms, hi_ms], color="grey", linestyle="--", linewidth=1, label="predicted = measured")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    ax.set_xlabel("predicted (ms, without the fidelity penalty)")
    ax.set_ylabel("measured (ms)")
    ax.set_title("adaptive: predicted against measured per transfer\n(ringed: explored)", fontsize=9)
    fig.tight_layout()
    fig.savefig(folder / "predicted_vs_measured.png", dpi=110)
    plt.close(fig)

    figures = meta.get("figures") or {}
    net = meta.get("net") or {}
    lines = [
        "# kvbus demo report",
        "",
        *([f"**{figures['headline']}**", "", RATIO_MEANS, ""] if figures.get("headline") else []),
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')}; network "
        f"`{meta.get('network', '?')}`" + (f" ({net['why']})" if net.get("why") else "") + "; medians over "
        f"{max((r.get('rounds', 1) for r in rows), default=1)} interleaved round(s), [min - max].",
        "",
        "| policy | E2E (s) | p50 / p99 per transfer (ms) | bytes moved (MB) | recompute (s) | peak KV (MB) | "
        "agreement with `full` | media |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        agree = "-" if row["agreement"] is None else f"{row['agreement']:.1%}"
        sp = row.get("e2e_s_rounds") or {}
        rng = f" [{sp['min']:.2f} - {sp['max']:.2f}]" if sp.get("n", 0) > 1 else ""
        lines.append(
            f"| {row['policy']} | {row['e2e_s']:.2f}{rng} | {row['p50_ms']:.0f} / {row['p99_ms']:.0f} | "
            f"{row['bytes'] / 1e6:.1f} | {row['recompute_s']:.2f} | {row['peak_kv_bytes'] / 1e6:.0f} | "
            f"{agree} | {', '.join(row['media'])} |"
        )
    summary = prediction_summary(by.get("adaptive", []))
    lines += [
        "",
        "## Why adaptive chose what it chose",
        "",
        "The scheduler predicts each medium's latency as communication + computation + a penalty for "
        "fidelity loss (the calibrated agreement of the receiver's model under that medium, charged as the "
        "extra tokens it would have to generate); medians over the adaptive runs' transfers:",
        "",
        *why_table(by.get("adaptive", [])),
        "",
        "Which medium each pair got (pairs differ: the same rack, a slow uplink, a receiver of another model):",
        "",
        *pair_table(by.get("adaptive", [])),
        "",
        f"Prediction error |predicted - measured| / measured over {summary['transfers']} adaptive transfers: "
        f"median {summary['prediction_error_median']}, p90 {summary['prediction_error_p90']}; "
        f"{summary['explored']} explored (a medium sent to measure it, share {summary['explored_fraction']}).",
        "",
        "![predicted against measured](predicted_vs_measured.png)",
        "",
        "## Setup",
        "",
        "```json",
        json.dumps(meta, indent=2, default=str),
        "```",
        "",
        "![latency by policy](latency_by_policy.png)",
        "",
        "![bytes by medium](bytes_by_medium.png)",
        "",
        "![timeline](timeline_adaptive.png)",
        "",
        "![media over time](media_over_time.png)",
        "",
    ]
    (folder / "report.md").write_text("\n".join(lines))
    results = {"rows": rows, "meta": meta, "adaptive_predictions": summary}
    (folder / "results.json").write_text(json.dumps(results, indent=2, default=str))


def compare(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Adaptive against the best static policy (by median E2E) and the best static of at least
    adaptive's quality, per round (median, min, max of the per-round ratios)."""
    by = {r["policy"]: r for r in rows}
    adaptive = by["adaptive"]
    statics = [r for r in rows if r["policy"] != "adaptive"]
    best = min(statics, key=lambda r: r["e2e_s"])
    quality = adaptive["agreement"] or 0.0
    same = [r for r in statics if (r["agreement"] or 0.0) >= quality - 1e-9] or [best]
    best_same = min(same, key=lambda r: r["e2e_s"])

    def per_round(other: dict[str, Any]) -> dict[str, Any]:
        a, b = adaptive["e2e_s_rounds"]["values"], other["e2e_s_rounds"]["values"]
        return spread(ratio(x, y) for x, y in zip(a, b))

    vs_best, vs_same = per_round(best), per_round(best_same)
    beaten = [r["policy"] for r in same if r["e2e_s"] < adaptive["e2e_s"]]
    return {
        "adaptive_vs_best_static": vs_best["median"],
        "adaptive_vs_best_static_rounds": vs_best,
        "best_static": best["policy"],
        "adaptive_vs_best_static_same_quality": vs_same["median"],
        "adaptive_vs_best_static_same_quality_rounds": vs_same,
        "best_static_same_quality": best_same["policy"],
        "adaptive_quality": adaptive["agreement"],
        "adaptive_beaten_by_same_quality": beaten,
        "verdict": (
            f"adaptive is beaten by {', '.join(beaten)} at the same quality (median E2E)"
            if beaten
            else "no static policy of adaptive's quality is faster (median E2E)"
        ),
        "headline": headline(vs_same, best_same["policy"], quality, len(adaptive["e2e_s_rounds"]["values"])),
    }


#: Within this much of 1, adaptive and the best static policy are called even (rounds are noisy).
EVEN_WITHIN = 0.02

#: What the ratio means, said once after the headline.
RATIO_MEANS = (
    "A ratio is adaptive's end-to-end time over the static policy's, round by round: above 1 adaptive "
    "was slower, below 1 faster."
)


def headline(vs: Mapping[str, Any], policy: str, quality: float, rounds: int) -> str:
    """The demo's result in one plain sentence: adaptive against the fastest static policy of at
    least its quality (``vs``: the per-round ratios, median / min / max)."""
    r = vs.get("median")
    if r is None:
        return f"adaptive could not be compared with {policy}: a run has no time"
    lo, hi = vs.get("min", r), vs.get("max", r)
    spread_ = f"; rounds {lo:.2f}x-{hi:.2f}x" if rounds > 1 else ""
    word = "even" if abs(r - 1) <= EVEN_WITHIN else "adaptive lost" if r > 1 else "adaptive won"
    return (
        f"adaptive took {r:.2f}x as long as the fastest static policy of its quality, {policy}, "
        f"at {quality:.0%} agreement with full (median of {rounds} round{'s' if rounds != 1 else ''}{spread_}): "
        f"{word}."
    )


def compute_check(team: RemoteTeam | None, runs: dict[str, list[RunResult]]) -> dict[str, Any]:
    """The receivers' real prefill speed (``tokens`` deliveries) against the calibrated one the cost
    model used, and adaptive's predicted against observed recompute: what a load-following
    compute term would correct."""
    from kvbus.codecs.calibration import load_profile

    try:
        calibrated = float(load_profile().prefill_tokens_per_s)
    except Exception:  # noqa: BLE001 - no profile: report what was measured only
        calibrated = None
    measured: dict[str, list[float]] = {}
    for p in team.prefill if team else []:
        if p["seconds"] > 0 and p["tokens"] > 0:
            measured.setdefault(p["agent"], []).append(p["tokens"] / p["seconds"])
    pairs = []
    for run in runs.get("adaptive", []):
        for t in run.transfers:
            cands = {c.get("medium"): c for c in (t.decision or {}).get("candidates", [])}
            if t.medium == "tokens" and "tokens" in cands:
                pairs.append({"predicted_comp_s": cands["tokens"].get("comp_s"), "observed_decode_s": t.decode_s})
    return {
        "prefill_tokens_per_s_calibrated": calibrated,
        "prefill_tokens_per_s_measured": {a: spread(v, digits=1) for a, v in measured.items()},
        "adaptive_tokens_recompute": {
            "n": len(pairs),
            "predicted_s": median(p["predicted_comp_s"] for p in pairs),
            "observed_s": median(p["observed_decode_s"] for p in pairs),
        },
    }
