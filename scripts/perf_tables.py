#!/usr/bin/env python3
"""Generate the performance tables of ``docs/performance.md`` from bench JSON files, so no number is
copied by hand.

    kvbus bench sched --json docs/bench-results/sched.json      # ... one file per suite
    python scripts/perf_tables.py docs/bench-results             # print every table
    python scripts/perf_tables.py docs/bench-results --page docs/performance.md   # rewrite its tables

Each table is preceded by a line stating the machine, the date, the network mode (``netns``: the
testbed; ``emulated``; ``loopback``; ``none``) and the rounds of the JSON it came from. In the
page each table sits between ``<!-- perf:SUITE -->`` and ``<!-- /perf:SUITE -->``; a suite with no
JSON file keeps what is there. A run on a cluster (``config.nats_cluster`` > 1 or
``config.redis_cluster``: ``--nats-cluster N``, ``--redis-cluster``) fills ``SUITE_cluster``, never the
single-server suite's block. Only the standard library is used.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Json = dict[str, Any]


def _f(x: Any, fmt: str = "{:.2f}", none: str = "-") -> str:
    if x is None or (isinstance(x, float) and x != x):
        return none
    return fmt.format(x)


def _sp(s: Any, fmt: str = "{:.2f}") -> str:
    """``median [min - max]`` of a spread (just the median when one round)."""
    if not isinstance(s, dict) or s.get("median") is None:
        return "-"
    if s.get("n", 1) <= 1 or s.get("min") == s.get("max"):
        return _f(s["median"], fmt)
    return f"{_f(s['median'], fmt)} [{_f(s['min'], fmt)} - {_f(s['max'], fmt)}]"


#: The goals the performance page states for a suite's headline figures: (key in ``results``, ``<=`` or ``>=``, value).
GOALS: dict[str, tuple[tuple[str, str, float], ...]] = {
    "select": (
        ("adaptive_vs_best_static_max", "<=", 1.05),
        ("adaptive_vs_best_static_median", "<=", 0.98),
        ("fluctuating_adaptive_vs_best_static", "<=", 0.85),
        ("prediction_error_p90", "<=", 0.25),
        ("regret_vs_oracle", "<=", 1.10),
    ),
    "cachetier": (("offload_fetch_vs_raw_redis", ">=", 0.8), ("int8_effective_vs_raw_redis", ">=", 1.5)),
    "scale": (
        # issue 33: the scheduler's own CPU, the figure a deployment with a core per group sees
        ("busiest_scheduler_cpu_growth_hier_64_to_1024", "<=", 1.5),
        ("busiest_scheduler_cpu_flat_over_hier_at_1024", ">=", 5.0),
        # an earlier round's latency goals: on 2 cores the machine's run queue sets them
        ("hier_growth_64_to_1024", "<=", 1.5),
        ("flat_over_hier_at_1024", ">=", 5.0),
    ),
}


def goals(suite: str, results: Json) -> str:
    """``Goals: `key` <= 1.05: 1.46, **not met**; ...`` for the figures of ``GOALS[suite]`` (a figure this
    run has not got, e.g. the 1024-agent ratios of a quick scale run, is said to be not measured)."""
    bits = []
    for key, op, want in GOALS.get(suite, ()):
        got = results.get(key)
        if not isinstance(got, (int, float)):
            bits.append(f"`{key}` {op} {want:g}: not measured in this run")
            continue
        ok = got <= want if op == "<=" else got >= want
        bits.append(f"`{key}` {op} {want:g}: {got:g}, {'met' if ok else '**not met**'}")
    return "Goals: " + "; ".join(bits) + "." if bits else ""


def header(data: Json, command: str) -> str:
    """The line that says where and how a table was measured."""
    cfg = data.get("config", {})
    machine = cfg.get("machine", {})
    rounds = cfg.get("rounds")
    bits = [
        f"`{command}`",
        f"{cfg.get('date', '?')}",
        f"{machine.get('platform', '?')}, {machine.get('cpus', '?')} cores",
    ]
    if machine.get("load_avg"):
        bits.append(f"load average at the end {machine['load_avg'][0]}")
    bits.append(f"network `{cfg.get('network', '?')}`")
    if rounds:
        bits.append(f"{rounds} interleaved round(s), median [min - max]")
    if cfg.get("quick"):
        bits.append("quick mode")
    if cfg.get("smoke"):
        bits.append("SMOKE RUN: figures meaningless")
    return "Measured by " + "; ".join(bits) + "."


def transport(d: Json) -> str:
    r = d["results"]
    by = r["by_size"]
    # 512 MB only in a full run.
    sizes = [size for size in ("64MB", "512MB", "1MB", "64KB") if size in by]
    rows = ["| figure | " + " | ".join(size.replace("MB", " MB").replace("KB", " KB") for size in sizes) + " |"]
    rows.append("|---|" + "---|" * len(sizes))
    for label, key, fmt in (
        ("kvbus `send`/`receive`, `full` codec (MB/s)", "kvbus_MBps", "{:.0f}"),
        (
            "plain nats-py loop, same messages and window (MB/s; 1 MB and 64 KB: one request/reply)",
            "nats_py_MBps",
            "{:.0f}",
        ),
        ("kvbus / nats-py request/reply, median ms per transfer", "kvbus_ms", None),
        ("redis-py one SET + one GET (MB/s)", "redis_MBps", "{:.0f}"),
        ("redis-py pipelined chunked SET/GET, the faster loop (MB/s)", "redis_pipelined_MBps", "{:.0f}"),
        ("`ratio_vs_nats_py`", "ratio_vs_nats_py", "{:.2f}"),
        ("`ratio_vs_redis`", "ratio_vs_redis", "{:.2f}"),
        ("`ratio_vs_redis_pipelined`", "ratio_vs_redis_pipelined", "{:.2f}"),
        ("`tracing_overhead`", "tracing_overhead", "{:.2f}"),
        ("path the bus picked", "path", "{}"),
        ("bus on `shm` / `tcp` / `nats` only (GB/s)", None, ""),
        ("`shm_ratio_vs_nats_py`", "shm_ratio_vs_nats_py", "{:.2f}"),
        ("`tcp_ratio_vs_nats_py`", "tcp_ratio_vs_nats_py", "{:.2f}"),
        ("`nats_path_ratio_vs_nats_py`", "nats_path_ratio_vs_nats_py", "{:.2f}"),
        ("`tcp_vs_loopback_limit` (plain socket loop)", "tcp_vs_loopback_limit", "{:.2f}"),
        ("`shm_vs_memcpy` (a context built in place, `Agent.kv_buffer`)", "shm_vs_memcpy", "{:.2f}"),
        ("`shm_copying_vs_memcpy` (an ordinary context, copied to a segment)", "shm_copying_vs_memcpy", "{:.2f}"),
        ("`zero_copy_vs_copying` (send time, copying / in place)", "zero_copy_vs_copying", "{:.2f}"),
        ("`first_transfer_vs_steady` (the first send of the size)", "first_transfer_vs_steady", "{:.2f}"),
        ("`first_transfer_zero_copy_vs_steady` (built in place)", "first_transfer_zero_copy_vs_steady", "{:.2f}"),
        ("control round trips of one transfer", "round_trips", "{}"),
    ):
        if key == "kvbus_ms":
            cells = [
                f"{_f(by[size].get('kvbus_ms'), '{:.2f}')} / {_f(by[size].get('nats_py_ms'), '{:.2f}')}"
                if "kvbus_ms" in by[size]
                else "-"
                for size in sizes
            ]
        elif key is None:
            cells = [
                " / ".join(_f(by[size].get(f"kvbus_{p}_GBps"), "{:.2f}") for p in ("shm", "tcp", "nats"))
                for size in sizes
            ]
        else:
            cells = [_f(by[size].get(key), fmt) for size in sizes]
        if any(c != "-" for c in cells):
            rows.append(f"| {label} | " + " | ".join(cells) + " |")
    rows.append(
        "| ratio per run vs nats-py / vs pipelined redis-py | "
        + " | ".join(
            f"{_sp(by[size].get('ratio_vs_nats_py_runs'))} / {_sp(by[size].get('ratio_vs_redis_pipelined_runs'))}"
            for size in sizes
        )
        + " |"
    )
    return "\n".join(rows)


def sched(d: Json) -> str:
    r = d["results"]
    c, f = r["critical"], r["fairness"]
    # Older stored runs have three arms; newer ones add strict priority and the concurrency-1 FIFO.
    labels = {
        "wrr": "wrr (kvbus)",
        "fifo": "fifo, same budget and concurrency",
        "fifo1": "fifo, one transfer at a time",
        "strict": "strict priority",
        "unscheduled": "unscheduled (flows share the link)",
    }
    arms = [a for a in labels if a in c]
    sizes = sorted(r["decision_us_p99_rounds"], key=int)
    rows = [
        "| figure | " + " | ".join(labels[a] for a in arms) + " |",
        "|---" * (len(arms) + 1) + "|",
        "| critical p99 (ms), 64 KB every 200 ms under 4 x 8 MB bulk, 40 MB/s | "
        + " | ".join(_sp(c[a].get("critical_p99_ms_rounds"), "{:.1f}") for a in arms)
        + " |",
        "| bulk throughput (MB/s) | " + " | ".join(_f(c[a].get("bulk_mb_s"), "{:.1f}") for a in arms) + " |",
        *(
            [
                "| critical p99 (ms) with no bulk at all (wrr's senders alone: the floor) | "
                + _sp(r["critical_idle"].get("critical_p99_ms_rounds"), "{:.1f}")
                + " |"
                + " |" * (len(arms) - 1)
            ]
            if "critical_idle" in r
            else []
        ),
        "| Jain's fairness, W 2/3/4/6, 30 MB/s | "
        + " | ".join(_sp(f[a].get("jain_rounds"), "{:.3f}") if a in f else "" for a in arms)
        + " |",
        "",
        "| ratio | measured |",
        "|---|---|",
        *(
            f"| `{key}` | {_sp(r.get(key + '_rounds'))} |"
            for key in (
                "critical_p99_ratio_fifo_vs_wrr",
                "critical_p99_ratio_fifo1_vs_wrr",
                "critical_p99_ratio_strict_vs_wrr",
                "critical_p99_ratio_unscheduled_vs_wrr",
                "critical_p99_ratio_wrr_vs_idle",
                "bulk_throughput_ratio_wrr_vs_unscheduled",
            )
            if key in r
        ),
        f"| `jain_fairness` (wrr) | {_sp(r.get('jain_fairness_rounds'), '{:.3f}')} |",
        f"| `jitter_p99_over_p50` (wrr critical) | {_f(r.get('jitter_p99_over_p50'))} |",
        f"| `decision_us_p99` {' / '.join(sizes)} agents | "
        + " / ".join(_sp(r["decision_us_p99_rounds"].get(n), "{:.0f}") for n in sizes)
        + " |",
        "| the same with the cost model choosing | "
        + " / ".join(_f(r["decision_us_p99_with_selection"].get(n), "{:.0f}") for n in sizes)
        + " |",
        *(
            [
                f"| `adjust_us_p99` {' / '.join(sizes)} agents | "
                + " / ".join(_sp(r["adjust_us_p99_rounds"].get(n), "{:.0f}") for n in sizes)
                + " |"
            ]
            if "adjust_us_p99_rounds" in r
            else []
        ),
        *(
            f"| `{key}` | {_sp(r.get(key + '_rounds'))} |"
            for key in ("decision_us_p99_growth_16_to_1024", "adjust_us_p99_growth_16_to_1024")
            if key in r
        ),
        *_sched_by_path(r),
        "",
        "| preempt threshold | MB/s | urgent p50 / p99 (ms) | bulk p99 (s) | pauses (declined) |",
        "|---|---|---|---|---|",
    ]
    for s in r.get("preempt_threshold_sweep", []):
        rows.append(
            f"| {s['threshold']:.0%} | {_f(s['throughput_mb_s'], '{:.1f}')} | "
            f"{_f(s['urgent_p50_ms'], '{:.0f}')} / {_f(s['urgent_p99_ms'], '{:.0f}')} | "
            f"{_f(s['bulk_p99_s'])} | {s['pauses_asked']} "
            f"({s['pauses_declined']}) |"
        )
    return "\n".join(rows)


def _sched_by_path(r: Json) -> list[str]:
    """The critical experiment with the bulk on each data path in turn (runs that have it)."""
    by_path = r.get("by_path")
    if not by_path:
        return []
    rows = [
        "",
        f"Bulk on each data path in turn (the figures above are `{r.get('default_path')}`'s, the path the bus "
        "takes between these hosts by default):",
        "",
        "| bulk on | critical p99 (ms) wrr / unscheduled / fifo1 | unscheduled / wrr | fifo1 / wrr "
        "| bulk wrr / unscheduled |",
        "|---|---|---|---|---|",
    ]
    for path, f in by_path.items():
        p99 = f.get("critical_p99_ms", {})
        rows.append(
            f"| {path} | {' / '.join(_f(p99.get(a), '{:.1f}') for a in ('wrr', 'unscheduled', 'fifo1'))} | "
            f"{_sp(f.get('critical_p99_ratio_unscheduled_vs_wrr_rounds'))} | "
            f"{_sp(f.get('critical_p99_ratio_fifo1_vs_wrr_rounds'))} | "
            f"{_sp(f.get('bulk_throughput_ratio_wrr_vs_unscheduled_rounds'))} |"
        )
    for path, why in r.get("by_path_left_out", {}).items():
        rows.append(f"| {path} | not measured: {why} | | | |")
    return rows


def codecs(d: Json) -> str:
    r = d["results"]
    rows = ["| codec | encode / decode GB/s | encode / decode vs copy | ratio | rel. error |", "|---|---|---|---|---|"]

    def vs_copy(row: Json, side: str) -> str:
        # the suite reports a medium that copies no byte on that side as a sentinel ratio
        return "zero-copy" if row.get(f"zero_copy_{side}") else _f(row[f"{side}_vs_copy"])

    for name, row in r.items():
        if not isinstance(row, dict) or "encode_gbps" not in row:
            continue
        rows.append(
            f"| {name} | {_f(row['encode_gbps'])} / {_f(row['decode_gbps'])} | {vs_copy(row, 'encode')} / "
            f"{vs_copy(row, 'decode')} | {_f(row['ratio'])} | {_f(row.get('rel_error'), '{:.4f}')} |"
        )
    first = r.get("first_call_s")
    if isinstance(first, dict) and first:
        rows += [
            "",
            "`first_call_s` (first encode + decode in a fresh process): "
            + ", ".join(f"{m} {_f(v, '{:.3f}')} s" for m, v in first.items()),
        ]
    cold = r.get("first_call_cold_s")
    if isinstance(cold, dict) and cold:
        rows += [
            "",
            "`first_call_cold_s` (the same with an empty kernel cache; the C kernels build in the background): "
            + ", ".join(f"{m} {_f(v, '{:.3f}')} s" for m, v in cold.items()),
        ]
    other = r.get("other_kernels")
    if isinstance(other, dict) and isinstance(other.get("llama3-8b-512"), dict):
        rows += [
            "",
            f"Same run, `{other.get('mode')}` kernels (encode / decode vs copy): "
            + ", ".join(
                f"{m} {_f(row.get('encode_vs_copy'))} / {_f(row.get('decode_vs_copy'))}"
                for m, row in other["llama3-8b-512"].items()
                if isinstance(row, dict)
            ),
        ]
    return "\n".join(rows)


def _select_where(cfg: Json) -> list[str]:
    """Where each part of a select run ran, and the data paths its transfers took (newer runs say)."""
    where = cfg.get("where")
    if not isinstance(where, dict):
        return []
    parts = ", ".join(f"{part} on `{net}`" for part, net in where.items())
    paths = cfg.get("paths") or {}
    taken = ", ".join(f"`{p}` {n}" for p, n in sorted(paths.items())) if paths else ""
    return ["", f"Parts: {parts}." + (f" Data paths of the testbed's transfers: {taken}." if taken else "")]


def select(d: Json) -> str:
    r = d["results"]
    rows = [
        "| tokens | Mbit/s | adaptive chose | best static (objective) | adaptive / best static |",
        "|---|---|---|---|---|",
    ]
    for c in r["cells"]:
        rows.append(
            f"| {c['tokens']} | {c['mbit']:g} | {', '.join(sorted(set(c['adaptive']['media'])))} | "
            f"{c['best_static']} | {_sp(c.get('adaptive_vs_best_static_rounds'), '{:.3f}')} |"
        )
    relay = r["relay"]
    rows += [
        "",
        f"`adaptive_vs_best_static_max` = {_f(r['adaptive_vs_best_static_max'], '{:.3f}')} (median over cells "
        f"{_f(r.get('adaptive_vs_best_static_median'), '{:.3f}')}); `fluctuating_adaptive_vs_best_static` = "
        f"{_f(r['fluctuating_adaptive_vs_best_static'], '{:.3f}')}; switches with / without hysteresis "
        f"{r['switches_with_hysteresis']} / {r['switches_without_hysteresis']}. Relay of {relay['hops']} hops: "
        f"fidelity measured at each hop min {_f(relay['measured_min_fidelity'], '{:.3f}')} (final top-1 "
        f"{_f(relay['measured_final_top1'], '{:.3f}')}; the selector's own lineage min "
        f"{_f(relay['min_lineage'], '{:.3f}')}, threshold {relay['threshold']}), "
        f"{_f(relay.get('bytes_vs_all_int4'), '{:.3f}')} x the bytes of all-int4.",
        *_select_where(d.get("config", {})),
        "",
        goals("select", r),
    ]
    return "\n".join(rows)


def cachetier(d: Json) -> str:
    r = d["results"]
    t, rp = r["throughput"], r["replay"]
    return "\n".join(
        [
            "| figure | measured |",
            "|---|---|",
            "| `offload_fetch_vs_raw_redis` (loopback) | "
            f"{_sp(t.get('offload_fetch_vs_raw_redis_rounds'), '{:.2f}')} |",
            "| `int8_effective_vs_raw_redis` (loopback) | "
            f"{_sp(t.get('int8_effective_vs_raw_redis_rounds'), '{:.2f}')} |",
            f"| `int8_effective_vs_raw_redis_1gbps` | {_f(r.get('int8_effective_vs_raw_redis_1gbps'))} |",
            f"| `prefetch_hidden_stall_fraction` | {_sp(rp.get('prefetch_hidden_stall_fraction_rounds'), '{:.2f}')}"
            f"{' (no stall to hide: absent)' if r.get('prefetch_hidden_stall_fraction') is None else ''} |",
            f"| `peak_memory_vs_unmanaged` | {_f(r.get('peak_memory_vs_unmanaged'))} |",
            f"| work between steps | {rp.get('work', '?')} |",
            "",
            goals(
                "cachetier",
                {
                    **r,
                    **{
                        k: (t.get(f"{k}_rounds") or {}).get("median", r.get(k))
                        for k in ("offload_fetch_vs_raw_redis", "int8_effective_vs_raw_redis")
                    },
                },
            ),
        ]
    )


def e2e(d: Json) -> str:
    r = d["results"]
    rows = [
        "| policy | E2E (s) | p50 / p99 per transfer (ms) | MB moved | recompute (s) | agreement with `full` | media |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        agree = "-" if row.get("agreement") is None else f"{row['agreement']:.1%}"
        rows.append(
            f"| {row['policy']} | {_sp(row.get('e2e_s_rounds'), '{:.1f}')} | {_f(row['p50_ms'], '{:.0f}')} / "
            f"{_f(row['p99_ms'], '{:.0f}')} | {row['bytes'] / 1e6:.1f} | {_f(row['recompute_s'], '{:.1f}')} | "
            f"{agree} | {', '.join(row['media'])} |"
        )
    rows += [
        "",
        f"`adaptive_vs_best_static` = {_sp(r.get('adaptive_vs_best_static_rounds'), '{:.3f}')} against "
        f"{r['best_static']}; `adaptive_vs_best_static_same_quality` = "
        f"{_sp(r.get('adaptive_vs_best_static_same_quality_rounds'), '{:.3f}')} against "
        f"{r['best_static_same_quality']}; `adaptive_quality` = {_f(r.get('adaptive_quality'), '{:.3f}')}. "
        f"{r.get('verdict', '')}.",
    ]
    return "\n".join(rows)


def agents(d: Json) -> str:
    r = d["results"]
    rows = [
        "| arm | E2E (s) | E2E / arm (a) | hand-off TTFT p50 / p99 (s) | MB moved | agreement with (a) "
        "| task score | media |",
        "|---|---|---|---|---|---|---|---|",
    ]
    per_arm = r.get("e2e_vs_prefix_cached_text_per_arm", {})
    for name, arm in r["arms"].items():
        ttft = arm.get("handoff_ttft_s", {})
        mb = arm.get("bytes_moved", {})
        rows.append(
            f"| {name} | {_sp(arm.get('e2e_s'), '{:.1f}')} | {_sp(per_arm.get(name), '{:.2f}')} | "
            f"{_f(ttft.get('p50'))} / {_f(ttft.get('p99'))} | "
            f"{_f(None if mb.get('median') is None else mb['median'] / 1e6, '{:.1f}')} | "
            f"{_sp(arm.get('agreement_vs_prefix_cached_text'), '{:.3f}')} | {_sp(arm.get('task_score'))} | "
            f"{', '.join(arm.get('media') or []) or '-'} |"
        )
    bits = []
    for key, g in r.get("goals", {}).items():
        value = "-" if g.get("value") is None else f"{g['value']:g}"
        bits.append(f"`{key}` {g.get('goal')}: {value}, {'met' if g.get('met') else '**not met**'}")
    rows += ["", f"Best fixed medium: {r.get('best_fixed', '-')}. Goals: " + "; ".join(bits) + "."]
    return "\n".join(rows)


def scale(d: Json) -> str:
    r = d["results"]
    size = d.get("config", {}).get("group_size", 64)
    rows = [
        f"| agents | flat: p99 (ms), busiest scheduler CPU | groups of {size}: p99 (ms), busiest scheduler CPU, "
        "coordinator CPU |",
        "|---|---|---|",
    ]
    for n in sorted(r["flat"], key=int):
        fl, hi = r["flat"][n], r["hier"][n]
        rows.append(
            f"| {n} | {_sp(fl.get('sched_overhead_p99_ms_rounds'))}, {_f(fl.get('scheduler_cpu_busiest'))} | "
            f"{_sp(hi.get('sched_overhead_p99_ms_rounds'))}, {_f(hi.get('scheduler_cpu_busiest'))}, "
            f"{_f(hi.get('coordinator_cpu'))} ({hi.get('groups')} groups) |"
        )
    ratios = [f"`{k[:-7]}` = {_sp(v)}" for k, v in r.items() if k.endswith("_rounds") and isinstance(v, dict)]
    return "\n".join([*rows, "", "; ".join(ratios) + ".", "", goals("scale", r)])


def chaos(d: Json) -> str:
    r = d["results"]
    return (
        f"{r['transfers']} transfers: {r['delivered']} delivered, {r['failed_with_error']} failed with an error, "
        f"**{r['lost']} lost, {r['duplicated']} duplicated, {r['corrupted']} corrupted, {r['crashed']} crashed**; "
        f"faults {json.dumps(r['faults'])}."
        + (
            f" Failed while delivered (`delivered_after_sender_error`): {r['delivered_after_sender_error']} "
            f"(goal 0, {_goal(r['delivered_after_sender_error'], 0)}); in doubt (`in_doubt`, the sender told it "
            f"may have arrived): {r['in_doubt']}, {r.get('in_doubt_delivered', 0)} of them delivered."
            if "in_doubt" in r
            else ""
        )
        + (f" Data paths of the delivered sends: {json.dumps(r['paths'])}." if r.get("paths") else "")
    )


def _goal(value: Any, want: Any) -> str:
    return "met" if value == want else "**not met**"


def chaos_cluster(d: Json) -> str:
    r = d["results"]
    servers = d.get("config", {}).get("nats_cluster", r.get("cluster_servers"))
    rs = r.get("resume_s", {})
    rec, ctl = rs.get("reconnect", {}), rs.get("control_state", {})
    rows = ["| figure | measured | goal |", "|---|---|---|"]
    for key in ("lost", "duplicated", "corrupted", "crashed"):
        rows.append(f"| `{key}` | {r[key]} | 0, {_goal(r[key], 0)} |")
    rows += [
        f"| `cluster_servers` | {r.get('cluster_servers')} | {servers}, {_goal(r.get('cluster_servers'), servers)} |",
        f"| transfers: delivered / failed with an error | {r['delivered']} / {r['failed_with_error']} "
        f"(of {r['transfers']}, {_f(r.get('seconds'), '{:.0f}')} s) | |",
        f"| server kills (SIGKILL, restarted on their ports) | {r.get('server_kills')} | >= 3, "
        f"{'met' if (r.get('server_kills') or 0) >= 3 else 'missed'} |",
        f"| transfer p99, all / in flight while a server was down (ms) | {_f(r.get('transfer_p99_ms'), '{:.0f}')} / "
        f"{_f(r.get('transfer_p99_during_failover_ms'), '{:.0f}')} ({r.get('transfers_during_failover')} "
        "transfers) | |",
    ]
    by_cause, during = r.get("failed_by_cause"), r.get("transfers_during_failover")
    if isinstance(by_cause, dict) and during:
        share = by_cause.get("server_kill", 0) / during
        ratio = r.get("p99_during_over_without_failover")
        rows += [
            f"| `failed_by_cause` | {json.dumps(by_cause)} | server_kill <= 1 % of the transfers during a "
            f"failover ({share:.2%}), {'met' if share <= 0.01 else 'missed'}; unknown 0, "
            f"{_goal(by_cause.get('unknown', 0), 0)} |",
            f"| `delivered_after_sender_error` / `in_doubt` | {r.get('delivered_after_sender_error')} / "
            f"{r.get('in_doubt')} | 0, {_goal(r.get('delivered_after_sender_error'), 0)} |",
            f"| p99 during a failover / p99 without (`p99_during_over_without_failover`) | {_f(ratio)} "
            f"({_f(r.get('transfer_p99_during_failover_ms'), '{:.0f}')} / "
            f"{_f(r.get('transfer_p99_without_failover_ms'), '{:.0f}')} ms) | <= 2, "
            f"{'met' if ratio is not None and ratio <= 2 else 'missed'} |",
            f"| grant wait p99 during / without a failover (ms) | "
            f"{_f(r.get('grant_wait_p99_during_failover_ms'), '{:.0f}')} / "
            f"{_f(r.get('grant_wait_p99_without_failover_ms'), '{:.0f}')} | |",
        ]
    rows += [
        f"| resume after a kill, clients on a survivor: median / max (s) | {_f(rec.get('median'))} / "
        f"{_f(rec.get('max'))} | |",
        f"| resume after a kill, control state writable (R3 bucket): median / max (s) | {_f(ctl.get('median'))} / "
        f"{_f(ctl.get('max'))} | |",
        "",
        f"Other faults: {json.dumps({k: v for k, v in r['faults'].items() if k != 'server_kills'})}; errors by type "
        f"{json.dumps(r.get('errors_by_type', {}))}.",
    ]
    return "\n".join(rows)


def cachetier_cluster(d: Json) -> str:
    r = d["results"]
    w, f = r["wait"], r["failover"]
    fd = f["fetch_during_failover"]
    return "\n".join(
        [
            "| figure | measured | goal |",
            "|---|---|---|",
            f"| `lost_blocks` (confirmed, gone after a primary's failover during offload) | {r['lost_blocks']} of "
            f"{f['confirmed_blocks']} confirmed | 0, {_goal(r['lost_blocks'], 0)} |",
            f"| `wrong_blocks` (came back different) | {r['wrong_blocks']} | 0, {_goal(r['wrong_blocks'], 0)} |",
            f"| fetch during a second failover: right / clear miss / wrong / other error | {fd['right']} / "
            f"{fd['clear_misses']} / {fd['wrong']} / {fd['other_errors']} | no wrong, no other error |",
            f"| primary failover (kill -9 to the replica promoted, s) | {_f(f.get('primary_failover_s'))} | |",
            f"| blocks kept resident (write not confirmed by a replica) / dropped unconfirmed | "
            f"{f['kept_resident_unconfirmed']} / {f['dropped_unconfirmed']} | |",
            f"| offload MB/s with `WAIT 1` / without | {_f(w.get('offload_MBps_wait_1'), '{:.0f}')} / "
            f"{_f(w.get('offload_MBps_no_wait'), '{:.0f}')} (`WAIT` costs "
            f"{_f(w.get('wait_cost_fraction'), '{:.0%}')}) | |",
            f"| cluster formed in (s) | {_f(r.get('cluster_formed_s'))} | |",
        ]
    )


def soak(d: Json) -> str:
    r = d["results"]
    return (
        f"{r['agents']} agents, {r['seconds']} s: {r['transfers']} transfers, {r['failed']} failed, "
        f"{r['slow_consumer_events']} slow-consumer events, `rss_growth_fraction` {r['rss_growth_fraction']}."
    )


TABLES: dict[str, tuple[str, Callable[[Json], str]]] = {
    "transport": ("kvbus bench transport --json transport.json", transport),
    "sched": ("kvbus bench sched --json sched.json", sched),
    "codecs": ("kvbus bench codecs --json codecs.json", codecs),
    "select": ("kvbus bench select --json select.json", select),
    "cachetier": ("kvbus bench cachetier --json cachetier.json", cachetier),
    "e2e": ("kvbus bench e2e --json e2e.json", e2e),
    "agents": ("kvbus bench agents --json agents.json", agents),
    "scale": ("kvbus bench scale --json scale.json", scale),
    "chaos": ("kvbus bench chaos --json chaos.json", chaos),
    "soak": ("kvbus bench soak --json soak.json", soak),
    # The cluster variants: the same suites' JSON with ``config.nats_cluster`` > 1 or ``config.redis_cluster``.
    "chaos_cluster": ("kvbus bench chaos --nats-cluster 3 --json chaos_cluster.json", chaos_cluster),
    "cachetier_cluster": ("kvbus bench cachetier --redis-cluster --json cachetier_cluster.json", cachetier_cluster),
    "scale_cluster": ("kvbus bench scale --nats-cluster 3 --json scale_cluster.json", scale),
}


def table_name(data: Json) -> str | None:
    """The table a bench JSON fills: its suite, or ``SUITE_cluster`` for a run on a NATS or Redis cluster."""
    suite = data.get("suite") if isinstance(data, dict) else None
    cfg = data.get("config", {}) if isinstance(data, dict) else {}
    if not isinstance(suite, str) or not isinstance(cfg, dict):
        return None
    nats_cluster = cfg.get("nats_cluster") or 0
    if (isinstance(nats_cluster, int) and nats_cluster > 1) or cfg.get("redis_cluster"):
        suite = f"{suite}_cluster"
    return suite if suite in TABLES else None


def render(suite: str, data: Json) -> str:
    """The header line and the table of one suite's JSON."""
    command, fn = TABLES[suite]
    servers = data.get("config", {}).get("nats_cluster")
    if isinstance(servers, int) and servers > 1:
        command = command.replace("--nats-cluster 3", f"--nats-cluster {servers}")
    if data.get("config", {}).get("quick") and "--quick" not in command:
        command = command.replace(" --json", " --quick --json")
    return f"{header(data, command)}\n\n{fn(data)}"


def load_all(folder: Path) -> dict[str, Json]:
    """Every ``*.json`` in ``folder`` that is a bench result, by table (`table_name`): of two runs of
    one table, the one measured last (``config.date``; the file's mtime for a run without one).

    Not the file's mtime alone: a fresh clone writes every file at about the same time, in no set
    order, and `select_quick.json` (an older quick run) won over `select.json` in some checkouts."""
    found: dict[str, tuple[tuple[str, float], Json]] = {}
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        suite = table_name(data) if isinstance(data, dict) else None
        if suite is None:
            continue
        cfg = data.get("config")
        date = cfg.get("date") if isinstance(cfg, dict) else None
        key = (str(date) if date else "", path.stat().st_mtime)
        if suite not in found or key > found[suite][0]:
            found[suite] = (key, data)
    return {k: v for k, (_, v) in found.items()}


#: The page that holds the generated tables (the README links to it).
PAGE = Path(__file__).resolve().parents[1] / "docs" / "performance.md"


def update_page(text: str, tables: dict[str, str]) -> tuple[str, list[str]]:
    """``text`` with every ``<!-- perf:SUITE -->...<!-- /perf:SUITE -->`` block that has a table replaced."""
    done = []
    for suite, table in tables.items():
        pattern = re.compile(rf"(<!-- perf:{suite} -->\n)(.*?)(<!-- /perf:{suite} -->)", re.S)
        if pattern.search(text):
            text = pattern.sub(lambda m, t=table: m.group(1) + t + "\n" + m.group(3), text)
            done.append(suite)
    return text, done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="folder with bench JSON files (one per suite)")
    parser.add_argument(
        "--page", type=Path, default=None, help=f"rewrite this page's perf blocks in place (they live in {PAGE.name})"
    )
    args = parser.parse_args(argv)
    found = load_all(args.folder)
    if not found:
        print(f"no bench JSON in {args.folder}", file=sys.stderr)
        return 1
    tables = {suite: render(suite, data) for suite, data in found.items()}
    if args.page is None:
        for suite, table in tables.items():
            print(f"## {suite}\n\n{table}\n")
        return 0
    text, done = update_page(args.page.read_text(), tables)
    args.page.write_text(text)
    print(
        f"updated {', '.join(done) or 'nothing'} in {args.page}; no block for "
        f"{', '.join(sorted(set(tables) - set(done))) or '-'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
