"""`kvbus bench e2e`: the demo workflow under adaptive and every static medium adaptive can pick,
in interleaved rounds, on the testbed's two racks (or emulated links).

Writes ``results.adaptive_vs_best_static`` (adaptive's E2E latency over the static policy with the
lowest median E2E, per round: median, and min / max in ``..._rounds``),
``results.adaptive_vs_best_static_same_quality`` (against the fastest static policy whose
generated tokens agree with the lossless run at least as well as adaptive's do),
``results.adaptive_quality`` (adaptive's median token agreement with the ``full`` run of the same
round), ``results.adaptive_beaten_by_same_quality`` and one row per policy. The static policies
are `kvbus.app.demo.STATIC_POLICIES`: every candidate medium of the adaptive selector, delta
media included. ``results.compute_check`` compares the receivers' measured prefill speed with
the calibrated one the cost model uses.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rich.console import Console

from kvbus.app.bench.rounds import FULL_ROUNDS
from kvbus.app.demo import STATIC_POLICIES, run_policies
from kvbus.app.demo_report import compare, render_table

SMOKE_POLICIES = ["full", "adaptive", "int8", "delta+int8", "tokens"]


def run(
    *,
    quick: bool = False,
    smoke: bool = False,
    network: str | None = None,
    new_tokens: int | None = None,
    rounds: int | None = None,
    tasks: int | None = None,
    **_: Any,
) -> dict[str, Any]:
    """Run the suite: ``FULL_ROUNDS`` rounds of every policy over 2 tasks of the workflow, 16 tokens per
    step (``--quick``: 1 task, 8 tokens, the same rounds; smoke: one round of a few policies on tiny
    random models, in one process)."""
    t0 = time.perf_counter()
    rounds = rounds or (1 if smoke else FULL_ROUNDS)
    new_tokens = new_tokens or (2 if smoke else 8 if quick else 16)
    tasks = tasks or (1 if smoke or quick else 2)
    console = Console(width=140)
    _, rows, meta = asyncio.run(
        run_policies(
            quick=quick,
            new_tokens=new_tokens,
            console=console,
            rounds=rounds,
            policies=SMOKE_POLICIES if smoke else None,
            network=network,
            smoke=smoke,
            tasks=tasks,
        )
    )
    render_table(rows, console)
    figures = compare(rows)
    print(f"adaptive / best static ({figures['best_static']}): {figures['adaptive_vs_best_static_rounds']}")
    print(
        f"adaptive / best static of its quality ({figures['best_static_same_quality']}): "
        f"{figures['adaptive_vs_best_static_same_quality_rounds']}; {figures['verdict']}"
    )
    compute = meta.pop("compute_check")
    return {
        "suite": "e2e",
        "config": {
            **meta,
            "quick": quick,
            "static_policies": list(STATIC_POLICIES),
            "seconds": round(time.perf_counter() - t0, 1),
        },
        "results": {**figures, "compute_check": compute, "rows": rows},
    }
