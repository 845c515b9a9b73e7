"""`scripts/perf_tables.py`: which block of `docs/performance.md` a bench JSON fills (a cluster run never
overwrites the single-server suite's table), that the cluster tables render from the keys the benches
write, and that the page holds every table, generated from the stored JSON as it is."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("perf_tables", ROOT / "scripts" / "perf_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["perf_tables"] = module
    spec.loader.exec_module(module)
    return module


perf_tables = _load()

CHAOS_CLUSTER = {
    "suite": "chaos",
    "config": {"transfers": 10, "nats_cluster": 3},
    "results": {
        "transfers": 10,
        "delivered": 9,
        "failed_with_error": 1,
        "lost": 0,
        "duplicated": 0,
        "corrupted": 0,
        "crashed": 0,
        "errors_by_type": {"TransferError": 1},
        "faults": {"receiver_restarts": 2, "server_kills": 1},
        "seconds": 12.0,
        "cluster_servers": 3,
        "server_kills": 1,
        "transfer_p99_ms": 900.0,
        "transfer_p99_during_failover_ms": 1500.0,
        "transfers_during_failover": 4,
        "resume_s": {"reconnect": {"median": 0.1, "max": 0.2}, "control_state": {"median": 1.0, "max": 2.0}},
    },
}
CACHETIER_CLUSTER = {
    "suite": "cachetier",
    "config": {"redis_cluster": True},
    "results": {
        "cluster_formed_s": 3.0,
        "wait": {"offload_MBps_wait_1": 100.0, "offload_MBps_no_wait": 120.0, "wait_cost_fraction": 0.17},
        "failover": {
            "confirmed_blocks": 40,
            "lost_blocks": 0,
            "wrong_blocks": 0,
            "kept_resident_unconfirmed": 2,
            "dropped_unconfirmed": 0,
            "primary_failover_s": 2.5,
            "fetch_during_failover": {"right": 5, "wrong": 0, "clear_misses": 1, "other_errors": 0},
        },
        "lost_blocks": 0,
        "wrong_blocks": 0,
    },
}


def test_cluster_runs_fill_their_own_tables() -> None:
    assert perf_tables.table_name(CHAOS_CLUSTER) == "chaos_cluster"
    assert perf_tables.table_name(CACHETIER_CLUSTER) == "cachetier_cluster"
    assert perf_tables.table_name({"suite": "scale", "config": {"nats_cluster": 3}}) == "scale_cluster"
    # A single-server run (scale writes nats_cluster 0) keeps its suite; unknown suites fill nothing.
    assert perf_tables.table_name({"suite": "scale", "config": {"nats_cluster": 0}}) == "scale"
    assert perf_tables.table_name({"suite": "cachetier", "config": {}}) == "cachetier"
    assert perf_tables.table_name({"suite": "nope", "config": {}}) is None
    assert perf_tables.table_name({"suite": "chaos", "config": "bad"}) is None


def test_a_newer_cluster_json_does_not_replace_the_single_server_table(tmp_path: Path) -> None:
    single = {"suite": "cachetier", "config": {"network": "emulated"}, "results": {}}
    (tmp_path / "cachetier.json").write_text(json.dumps(single))
    newer = tmp_path / "cachetier_cluster.json"
    newer.write_text(json.dumps(CACHETIER_CLUSTER))
    stat = newer.stat()
    os.utime(newer, (stat.st_atime, stat.st_mtime + 10))
    found = perf_tables.load_all(tmp_path)
    assert found["cachetier"] == single
    assert found["cachetier_cluster"] == CACHETIER_CLUSTER


def test_cluster_tables_render_and_replace_only_their_blocks() -> None:
    tables = {
        "chaos_cluster": perf_tables.render("chaos_cluster", CHAOS_CLUSTER),
        "cachetier_cluster": perf_tables.render("cachetier_cluster", CACHETIER_CLUSTER),
    }
    assert "--nats-cluster 3" in tables["chaos_cluster"]
    assert "| `lost` | 0 | 0, met |" in tables["chaos_cluster"]
    assert "0 of 40 confirmed" in tables["cachetier_cluster"]
    page = (
        "<!-- perf:chaos -->\nhand\n<!-- /perf:chaos -->\n"
        "<!-- perf:chaos_cluster -->\nold\n<!-- /perf:chaos_cluster -->\n"
        "<!-- perf:cachetier_cluster -->\nold\n<!-- /perf:cachetier_cluster -->\n"
    )
    text, done = perf_tables.update_page(page, tables)
    assert sorted(done) == ["cachetier_cluster", "chaos_cluster"]
    assert "<!-- perf:chaos -->\nhand\n" in text
    assert "old" not in text


def test_a_missed_goal_is_said() -> None:
    bad = json.loads(json.dumps(CHAOS_CLUSTER))
    bad["results"]["lost"] = 2
    assert "| `lost` | 2 | 0, **not met** |" in perf_tables.render("chaos_cluster", bad)


def test_of_two_runs_of_a_table_the_one_measured_last_is_shown_whatever_the_files_mtimes(tmp_path: Path) -> None:
    # A fresh clone writes docs/bench-results/ in no set order: select_quick.json (an older quick
    # run) had the later mtime in some checkouts, and the stored-tables test failed there.
    older = {"suite": "scale", "config": {"date": "2026-12-04T17:55:25Z", "quick": True}, "results": {}}
    newer = {"suite": "scale", "config": {"date": "2026-12-04T22:21:42Z"}, "results": {}}
    (tmp_path / "a.json").write_text(json.dumps(newer))
    (tmp_path / "b.json").write_text(json.dumps(older))
    os.utime(tmp_path / "a.json", (1, 1))  # the newer run's file is the older file
    assert perf_tables.load_all(tmp_path)["scale"]["config"]["date"] == newer["config"]["date"]


def test_the_performance_page_holds_every_table_and_the_readme_none() -> None:
    page = perf_tables.PAGE.read_text()
    assert perf_tables.PAGE == ROOT / "docs" / "performance.md"
    for suite in perf_tables.TABLES:
        assert page.count(f"<!-- perf:{suite} -->\n") == 1, suite
        assert page.count(f"<!-- /perf:{suite} -->") == 1, suite
    assert "<!-- perf:" not in (ROOT / "README.md").read_text()


def test_the_stored_tables_are_what_the_stored_json_gives() -> None:
    """Regenerating the page from `docs/bench-results/` changes nothing: no figure was edited by hand
    and no stored JSON is newer than its table (run the script with ``--page`` after a bench run)."""
    found = perf_tables.load_all(ROOT / "docs" / "bench-results")
    assert found
    tables = {suite: perf_tables.render(suite, data) for suite, data in found.items()}
    page = perf_tables.PAGE.read_text()
    text, done = perf_tables.update_page(page, tables)
    assert sorted(done) == sorted(tables)
    assert text == page
