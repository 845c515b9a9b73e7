"""`kvbus bench agents` end to end on real vLLM engines: its smallest run (``--smoke``, one round).

Four SmolLM2 engines (planner, two executors, verifier), each its own process and kvbus agent,
run one workflow per arm on short documents. What is checked is what must hold whatever the
machine's speed (no timing is asserted): every arm answered every request, the text arms moved
no KV and the kvbus arms did, and what kvbus cannot have touched is the same in every arm.
Skipped when vLLM is not installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]', see the README)")

from kvbus.app.bench.agents import KVBUS_ARMS
from kvbus.app.bench.agents_team import NO_PREFIX_CACHE_TEXT, PREFIX_CACHED_TEXT
from tests.test_bench_smoke import NETWORKS, SCHEMAS, check

pytestmark = pytest.mark.timeout(600)

TEXT_ARMS = (PREFIX_CACHED_TEXT.name, NO_PREFIX_CACHE_TEXT.name)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("agents") / "agents.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvbus.app.cli", "bench", "agents", "--smoke", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert proc.returncode == 0, f"bench agents failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    data: dict[str, Any] = json.loads(Path(out).read_text())
    return data


def test_every_arm_answered_every_request(report: dict[str, Any]) -> None:
    arms = report["results"]["arms"]
    assert set(arms) == {*TEXT_ARMS, *(a.name for a in KVBUS_ARMS)}
    lengths = report["config"]["generated_tokens"]
    turns = report["config"]["turns"]
    for name, arm in arms.items():
        assert arm["workflows"] >= 1, name
        for calls in arm["calls"]:
            # planner, two executors, verifier per turn, in that order
            assert [c["role"] for c in calls] == ["planner", "executor-1", "executor-2", "verifier"] * turns, name
            assert all(c["ttft_s"] is not None and c["ttft_s"] > 0 for c in calls), name
        assert arm["e2e_s"]["n"] == arm["workflows"] and arm["e2e_s"]["min"] > 0, name
        assert arm["task_score"]["n"] == arm["workflows"], name
        assert arm["handoff_ttft_s"]["n"] == arm["workflows"] * (4 * turns - 1), name
    assert lengths["plan"] > 0 and lengths["answer"] > 0


def test_text_arms_move_no_kv_and_kvbus_arms_do(report: dict[str, Any]) -> None:
    arms = report["results"]["arms"]
    for name in TEXT_ARMS:
        assert arms[name]["bytes_moved"]["max"] == 0, name
        assert arms[name]["deliveries"] == 0 and arms[name]["loaded_tokens"] == 0, name
        # kvbus_off: the connector did not even store these requests' KV (kvbus_skip would)
        assert arms[name]["saves"] == 0, name
        assert all(c["loaded"] == 0 and c["source"] == "" for calls in arms[name]["calls"] for c in calls), name
    for arm in KVBUS_ARMS:
        got = arms[arm.name]
        assert got["bytes_moved"]["min"] > 0, (arm.name, got["bytes_moved"])
        assert got["loaded_tokens"] > 0 and got["saves"] > 0, arm.name
        if arm.medium:  # a fixed medium is the only one on the wire
            assert got["media"] == [arm.medium], (arm.name, got["media"])
        # every executor of turn 1 got the planner's context through kvbus (pushed or pulled)
        for calls in got["calls"]:
            executors = [c for c in calls if c["turn"] == 0 and c["role"].startswith("executor")]
            assert all(c["loaded"] > 0 for c in executors), (arm.name, executors)


def test_what_kvbus_cannot_touch_agrees_exactly(report: dict[str, Any]) -> None:
    """The planner's first request has the same prompt in every arm and nothing to load: every arm's
    answer to it is arm (a)'s, token for token; so the other figures compare like with like."""
    arms = report["results"]["arms"]
    for name, arm in arms.items():
        first = [calls[0] for calls in arm["calls"]]
        assert all(c["loaded"] == 0 and c["from"] == "" for c in first), name
        assert all(c["agreement"] == 1.0 for c in first), (name, first)
    agreement = report["results"]["agreement_vs_prefix_cached_text"]
    assert set(agreement) == {"adaptive", "full", "int8", "int4", "no_prefix_cache_text"}
    for medium, value in agreement.items():
        assert value is not None and 0.0 <= value <= 1.0, (medium, value)
    # Arm (a) against itself would be 1.0; every other arm shares at least the first planner
    # call's prompt with it, and agrees on it exactly.
    for name, arm in arms.items():
        if name == PREFIX_CACHED_TEXT.name:
            continue
        assert arm["same_prompt_tokens"] >= report["config"]["generated_tokens"]["plan"], name


def test_the_issue_figures_are_there(report: dict[str, Any]) -> None:
    results = report["results"]
    check(results, SCHEMAS["agents"], "agents.results")  # what the smoke test of every suite reads
    assert report["suite"] == "agents" and report["config"]["network"] in NETWORKS
    assert report["config"]["smoke"] is True and isinstance(report["config"]["date"], str)
    key = str(report["config"]["doc_tokens"])
    for name in ("e2e_vs_prefix_cached_text", "adaptive_vs_best_fixed"):
        assert isinstance(results[name], (int, float)) and results[name] > 0, name
    assert isinstance(results["ttft_vs_prefix_cached_text"][key], (int, float))
    assert set(results["goals"]) >= {"e2e_vs_prefix_cached_text", "adaptive_vs_best_fixed", "agreement.int8"}
    assert "cache_salt" in report["config"]["notes"]["prefix_cache"]


def test_the_demo_on_vllm_reports_the_run(report: dict[str, Any], tmp_path: Path) -> None:
    """``kvbus demo --engine vllm`` writes this suite's run as its report: the verdict against
    prefix-cached vLLM, a row per arm, every goal, and the JSON with the verdict."""
    from kvbus.app.demo_vllm import ARM_NAMES, verdict, write_report

    path = write_report(report, tmp_path / "kvbus-report", 12.0)
    text = path.read_text()
    said = verdict(report["results"])
    assert said in text and "prefix caching and text hand-offs" in said
    assert all(f"| {label} |" in text for label in ARM_NAMES.values())
    assert all(f"`{goal}`" in text for goal in report["results"]["goals"])
    saved = json.loads((tmp_path / "kvbus-report" / "results.json").read_text())
    assert saved["verdict"] == said and saved["results"] == report["results"]
