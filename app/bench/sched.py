"""`kvbus bench sched`: the weighted scheduler against FIFO and against no scheduler at all, on the
testbed's real shaped link (or emulated links), and the scheduler's own cost per grant.

Processes: nats-server and one scheduler per arm on host ``core``, every sender in one worker on
host ``tx``, the receiver in a worker on host ``rx`` (see `kvbus.app.bench.sched_ops`). The
receiver's link is the bottleneck: on the testbed an htb-shaped veth (``network: netns``);
without it a paced TCP relay that all of the receiver's traffic shares (``network: emulated``).
Either way every byte really crosses one shared bottleneck, whatever the scheduler decides.

Arms, in interleaved rounds (wrr, fifo, fifo1, strict, unscheduled, wrr, ...), each described in
``config.arms``:

- ``wrr``: kvbus's weighted policy, the group's budget at ``BUDGET_SHARE`` of the link's rate (the
  part of it TCP goodput reaches), the receiver declaring its link, defaults otherwise
  (``max_active`` 8, ``per_pair`` 1, preemption on).
- ``fifo``: first come first served with the same budget and the same concurrency (``max_active``
  8, one per sender) and the same declaration.
- ``fifo1``: the usual FIFO, one transfer at a time on the receiver's link (``max_active`` 1; the
  bench has one receiver): ``fifo``'s concurrency lets a critical transfer pass the bulk
  (``fifo_concurrency_lets_critical_pass_bulk``), this one's does not.
- ``strict``: strict priority without weights (`StrictPriorityPolicy`): critical before bulk.
- ``unscheduled``: no scheduling at all: a pass-through scheduler grants every transfer at once,
  unpaced (no budget, ``max_active`` and ``per_pair`` 10^6, no preemption, the receiver declares
  nothing), so all flows share the link itself (its queue, TCP, nats-server's buffers).

Figures (each per round, reported as median with min and max, see `kvbus.app.bench.rounds`):

- ``critical_p99_ratio_<arm>_vs_wrr`` (fifo, fifo1, strict, unscheduled): four bulk senders
  keep 8 MB transfers going to the receiver (40 MB/s link) while two critical senders each send
  a 64 KB critical message every 200 ms (open loop); p99 of the critical messages' latency
  (`send` to verified delivery) under the arm over the same under ``wrr``, same round;
  ``bulk_throughput_ratio_wrr_vs_unscheduled``: the bulk's MB/s under ``wrr`` over unscheduled.
- ``critical_idle``: the ``wrr`` arm's critical senders alone (no bulk), once per round after
  the arms: the floor of a critical message's latency on this machine and link (the request or
  rate budget, encode, the `Open` through nats-server, decode, the verdict);
  ``critical_p99_ratio_wrr_vs_idle``: ``wrr``'s critical p99 over it, same round (1: the bulk
  costs the critical messages nothing).
- ``critical_p99_ms`` per arm, and ``critical_phases`` (the ``wrr`` arm; every arm's in
  ``critical.<arm>.phases``): where a critical transfer's time goes (`phases`), per phase the
  median over rounds of its p50 and p99 and its mean over the slowest 5 % (``tail``).
- ``jain_fairness``: four senders of role priority 0, 1, 2, 4 saturate a 30 MB/s receiver (priority
  0), so W = 2, 3, 4, 6; Jain's index of throughput / W over a window without the start, for
  every arm under the same budget (``fairness.<arm>``).
- ``preempt_threshold_sweep``: three bulk senders (8 MB) and an urgent one (critical 4 MB, 0.2-0.6 s
  apart, critical boost 7), 40 MB/s, per threshold: throughput, urgent p50/p99, bulk p99, pauses.
- ``decision_us_*``, ``adjust_us_*``: `kvbus.app.bench.sched_cost`, in process, at 16 / 64 / 256 /
  1024 agents; ``*_growth_16_to_1024``: the p99 at 1024 over the p99 at 16, per round.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

from kvbus.app.bench.rounds import FULL_ROUNDS, jain, median, pct, ratio, spread
from kvbus.app.bench.sched_cost import decision_cost
from kvbus.app.bench.sched_ops import MB, SIG
from kvbus.app.testbed.benchnet import BenchNet, open_net
from kvbus.app.testbed.topology import Topology, one_rack
from kvbus.app.testbed.worker import Worker
from kvbus.bus.config import BusConfig
from kvbus.group_scheduler import SchedulerConfig
from kvbus.group_scheduler.selection import default_selector
from kvbus.group_scheduler.simulate import FixedSelector

OPS = "kvbus.app.bench.sched_ops"
ARMS = ("wrr", "fifo", "fifo1", "strict", "unscheduled")
#: The arms compared with ``wrr`` (a ``critical_p99_ratio_<arm>_vs_wrr`` each).
BASELINES = ARMS[1:]
#: The scheduler's budget as a share of the link's rate: TCP/IP headers take about 4 % of a
#: 1500-byte frame, and the budget leaves 2 % more so paced senders do not build a queue.
BUDGET_SHARE = 0.94
CRIT_LINK, FAIR_LINK, SWEEP_LINK = 40 * MB, 30 * MB, 40 * MB
UNLIMITED = 10**6
#: Group sizes (agents) of the decision-cost figures.
DECISION_SIZES = (16, 64, 256, 1024)
#: Senders of the critical experiment (`sched_ops.critical`): bulk, critical.
N_BULK, N_CRIT = 4, 2
#: Whether the ``fifo`` arm's concurrency (``max_active``, one per sender) lets a critical transfer
#: pass the bulk: it does when every sender can hold a slot at once.
FIFO_PASSES = SchedulerConfig().max_active >= N_BULK + N_CRIT


def topology() -> Topology:
    """One rack: ``core`` (nats-server, schedulers), ``tx`` (senders), ``rx`` (the receiver, the shaped link)."""
    return one_rack("sched", {"core": 10000, "tx": 10000, "rx": CRIT_LINK * 8 / 1e6}, nats="core")


def arm_config(arm: str, link_bps: float, **extra: Any) -> tuple[dict[str, Any], float]:
    """(scheduler config, the link the receiver declares) of one arm on a link of ``link_bps``."""
    if arm == "unscheduled":
        return {
            "policy": "wrr",
            "bandwidth_bps": 0.0,
            "max_active": UNLIMITED,
            "per_pair": UNLIMITED,
            "preempt": False,
            **extra,
        }, 0.0
    budget = BUDGET_SHARE * link_bps
    if arm == "fifo1":  # the usual FIFO: one transfer at a time on the receiver's link (one receiver here)
        return {"policy": "fifo", "bandwidth_bps": budget, "max_active": 1, **extra}, budget
    return {"policy": arm, "bandwidth_bps": budget, **extra}, budget


class Schedulers:
    """One worker process per arm on host ``core``, each running the schedulers of that arm's
    groups (one group per experiment), so an arm's scheduler never shares an event loop with
    another arm's."""

    def __init__(self, net: BenchNet) -> None:
        self.net = net
        self.workers: dict[str, Worker] = {}
        self.groups: dict[str, str] = {}

    async def start_workers(self) -> None:
        """Start one worker process per arm."""
        names = ARMS

        async def one(arm: str) -> None:
            self.workers[arm] = await self.net.worker("core", f"sched-{arm}")

        await asyncio.gather(*(one(a) for a in names))

    async def start(self, groups: dict[str, tuple[str, dict[str, Any]]]) -> None:
        """Start the schedulers of ``groups``: group -> (arm, config)."""
        for group, (arm, cfg) in groups.items():
            await self.workers[arm].call(
                "kvbus.app.testbed.ops:scheduler_start", url=self.net.url("core"), group=group, config=cfg
            )
            self.groups[group] = arm

    async def stats(self, group: str) -> dict[str, Any]:
        """The counters of ``group``'s scheduler."""
        return dict(await self.workers[self.groups[group]].call("kvbus.app.testbed.ops:scheduler_stats", group=group))

    async def stop(self) -> None:
        """Close the schedulers started so far (the workers stay for the next experiment)."""
        for group, arm in list(self.groups.items()):
            await self.workers[arm].call("kvbus.app.testbed.ops:scheduler_stop", group=group)
        self.groups.clear()


async def _with_receiver(
    net: BenchNet,
    rx: Worker,
    group: str,
    name: str,
    declared: float,
    job: Any,
    priority: float = 1.0,
    arrivals: dict[str, Any] | None = None,
    path: str = "",
) -> Any:
    """Run ``job`` while the receiver ``name`` (payloads on ``path``, `sched_ops.pinned`) drains
    its inbox; ``arrivals``: filled with when each transfer reached it (`sched_ops.receiver_arrivals`)."""
    await rx.call(
        f"{OPS}:receiver", url=net.url("rx"), name=name, group=group, link_bps=declared, priority=priority, path=path
    )
    try:
        res = await job
        if arrivals is not None:
            arrivals.update(await rx.call(f"{OPS}:receiver_arrivals", name=name))
        return res
    finally:
        await rx.call(f"{OPS}:receiver_stop", name=name)


#: Payloads up to this size go inline in the `Open` (`BusConfig.inline_limit`, the bench's agents keep it).
INLINE = BusConfig().inline_limit
#: The critical experiment's reference run: the ``wrr`` arm's critical senders with no bulk at
#: all, the floor any arm's critical latency can reach on this machine and link.
IDLE = "idle"
#: The phases of a critical transfer, in order (`phases`).
PHASES = ("request_to_grant", "encode", "grant_to_receiver", "receiver", "verdict")


def phases(sends: list[dict[str, Any]], arrivals: dict[str, Any]) -> list[dict[str, float]]:
    """Where each transfer's time went, in ms, from the sender's records (`sched_ops.sent`) and
    the receiver's arrivals (one monotonic clock for every process of the machine):

    - ``request_to_grant``: `send` to the grant (the request's round trip and any wait in the queue);
    - ``encode``: the codec;
    - ``grant_to_receiver``: the end of the encode to the receiver's decode starting: hashing, the
      sender's pacing, the `Open` (and chunks) crossing NATS or a direct path and the link's queue,
      the receiving event loop's wait; ``pacing`` (a part of it) is what the granted rate alone
      asks of the payload (the pacing starts empty, a rate budget's may not; 0 for an inline
      payload, paid after it went);
    - ``receiver``: the receiver's own `Delivery.transfer_s` + `decode_s`;
    - ``verdict``: the receiver's inbox to the sender's verdict (its way back, and the inbox's wake-up).

    ``budget``: 1 when it ran under a rate budget (no request), else 0.
    """
    out = []
    for s in sends:
        got = arrivals.get(s["transfer_id"])
        if got is None:
            continue
        t_recv, rx_transfer, rx_decode = got
        t_enc = s["t0"] + s["queued_s"] + s["encode_s"]
        budget = s["reason"] == "rate budget"
        rate = s["rate_bps"]
        out.append(
            {
                "total": 1e3 * s["total_s"],
                "request_to_grant": 1e3 * s["queued_s"],
                "encode": 1e3 * s["encode_s"],
                "grant_to_receiver": 1e3 * (t_recv - rx_decode - rx_transfer - t_enc),
                # An inline payload (one message) is paid to the pacing after it went: no wait.
                "pacing": 1e3 * s["nbytes"] / rate if rate > 0 and not budget and s["nbytes"] > INLINE else 0.0,
                "receiver": 1e3 * (rx_transfer + rx_decode),
                "verdict": 1e3 * (s["t0"] + s["total_s"] - t_recv),
                "budget": 1.0 if budget else 0.0,
            }
        )
    return out


def phase_summary(rounds: list[list[dict[str, float]]]) -> dict[str, Any]:
    """Per phase, the median over rounds of its p50 and p99, and its mean over the slowest 5 % of
    each round's transfers (``tail``: what the critical p99 is made of)."""
    keys = ("total", *PHASES, "pacing")
    out: dict[str, Any] = {"p50": {}, "p99": {}, "tail": {}}
    for k in keys:
        out["p50"][k] = median(pct([x[k] for x in r], 0.5) for r in rounds if r)
        out["p99"][k] = median(pct([x[k] for x in r], 0.99) for r in rounds if r)
        tails = []
        for r in rounds:
            if not r:
                continue
            slow = sorted(r, key=lambda x: -x["total"])[: max(1, len(r) // 20)]
            tails.append(sum(x[k] for x in slow) / len(slow))
        out["tail"][k] = median(tails)
    out["budget_share"] = median(sum(x["budget"] for x in r) / len(r) for r in rounds if r)
    out["n"] = sum(len(r) for r in rounds)
    out["phases"] = list(PHASES)
    return out


def bench_paths(mode: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """(the data paths the critical experiment pins the bulk to in turn, the first one being the
    path the bus takes between these hosts by default; why each other path is left out) on a
    network of ``mode``."""
    shm = "the senders and the receiver are on different hosts: shm carries nothing over the shaped link"
    if mode == "netns":
        return ("tcp", "nats"), {"shm": shm}
    why = "the emulated link is a relay in front of nats-server: a direct path would go around it"
    return ("nats",), {"tcp": why, "shm": why}


async def _critical(
    net: BenchNet, phase: Schedulers, tx: Worker, rx: Worker, rounds: int, seconds: float, path: str
) -> dict[str, Any]:
    net.set_link("host:rx", rate_mbit=CRIT_LINK * 8 / 1e6)
    groups = {f"crit-{path}-{a}": (a, arm_config(a, CRIT_LINK)[0]) for a in ARMS}
    groups[f"crit-{path}-idle"] = ("wrr", arm_config("wrr", CRIT_LINK)[0])
    await phase.start(groups)
    per: dict[str, list[dict[str, Any]]] = {a: [] for a in (*ARMS, IDLE)}
    try:
        for r in range(rounds):
            for arm in (*ARMS, IDLE):
                group, name = f"crit-{path}-{arm}", f"cr{r}-{path}-{arm}"
                job = tx.call(
                    f"{OPS}:critical",
                    url=net.url("tx"),
                    group=group,
                    prefix=name,
                    rx=f"{name}-rx",
                    seconds=seconds,
                    bulk_bytes=8 * MB,
                    crit_bytes=64 * 1024,
                    every=0.2,
                    n_bulk=0 if arm == IDLE else N_BULK,
                    n_crit=N_CRIT,
                    path=path,
                )
                arrivals: dict[str, Any] = {}
                declared = arm_config("wrr" if arm == IDLE else arm, CRIT_LINK)[1]
                res = await _with_receiver(net, rx, group, f"{name}-rx", declared, job, arrivals=arrivals, path=path)
                res["phases"] = phases(res.pop("crit_sends"), arrivals)
                res["stats"] = await phase.stats(group)
                per[arm].append(res)
                print(
                    f"  {path} round {r + 1}/{rounds} {arm:<11}: critical p99 "
                    f"{1e3 * pct(res['crit_lat'], 0.99):7.1f} ms "
                    f"(n={len(res['crit_lat'])}), bulk {res['bulk_mb_s']:.1f} MB/s",
                    flush=True,
                )
    finally:
        await phase.stop()
    out: dict[str, Any] = {}
    p99 = {a: [1e3 * pct(x["crit_lat"], 0.99) for x in per[a]] for a in (*ARMS, IDLE)}
    for a in (*ARMS, IDLE):
        out[a] = {
            "critical_p99_ms": median(p99[a]),
            "critical_p99_ms_rounds": spread(p99[a]),
            "critical_p50_ms": median(1e3 * pct(x["crit_lat"], 0.5) for x in per[a]),
            "critical_n": sum(len(x["crit_lat"]) for x in per[a]),
            "bulk_p50_s": median(pct(x["bulk_lat"], 0.5) for x in per[a]),
            "bulk_p99_s": median(pct(x["bulk_lat"], 0.99) for x in per[a]),
            "bulk_mb_s": median(x["bulk_mb_s"] for x in per[a]),
            "preemptions": sum(x["stats"]["preemptions"] for x in per[a]),
            "jitter_p99_over_p50": median(ratio(pct(x["crit_lat"], 0.99), pct(x["crit_lat"], 0.5)) for x in per[a]),
            "bulk_jitter_p99_over_p50": median(
                ratio(pct(x["bulk_lat"], 0.99), pct(x["bulk_lat"], 0.5)) for x in per[a]
            ),
            "phases": phase_summary([x["phases"] for x in per[a]]),
            "bulk_paths": dict(sum((collections.Counter(x["bulk_paths"]) for x in per[a]), collections.Counter())),
        }
    ratios = {a: [ratio(p99[a][i], p99["wrr"][i]) for i in range(rounds)] for a in BASELINES}
    ratios["wrr_vs_idle"] = [ratio(p99["wrr"][i], p99[IDLE][i]) for i in range(rounds)]
    ratios["bulk_wrr_vs_unscheduled"] = [
        ratio(per["wrr"][i]["bulk_mb_s"], per["unscheduled"][i]["bulk_mb_s"]) for i in range(rounds)
    ]
    return {"arms": out, "ratios": ratios}


def _path_figures(crit: dict[str, Any]) -> dict[str, Any]:
    """The critical experiment's figures of one path (`_critical`'s result), as the bench reports them."""
    out: dict[str, Any] = {}
    for a in BASELINES:
        out[f"critical_p99_ratio_{a}_vs_wrr"] = median(crit["ratios"][a])
        out[f"critical_p99_ratio_{a}_vs_wrr_rounds"] = spread(crit["ratios"][a])
    out["bulk_throughput_ratio_wrr_vs_unscheduled"] = median(crit["ratios"]["bulk_wrr_vs_unscheduled"])
    out["bulk_throughput_ratio_wrr_vs_unscheduled_rounds"] = spread(crit["ratios"]["bulk_wrr_vs_unscheduled"])
    out["critical_p99_ratio_wrr_vs_idle"] = median(crit["ratios"]["wrr_vs_idle"])
    out["critical_p99_ratio_wrr_vs_idle_rounds"] = spread(crit["ratios"]["wrr_vs_idle"])
    arms = crit["arms"]
    out["critical_p99_ms"] = {a: arms[a]["critical_p99_ms"] for a in ARMS}
    out["critical_phases"] = arms["wrr"]["phases"]
    out["bulk_paths"] = {a: arms[a]["bulk_paths"] for a in ARMS}
    return out


async def _fairness(
    net: BenchNet, phase: Schedulers, tx: Worker, rx: Worker, rounds: int, seconds: float
) -> dict[str, Any]:
    net.set_link("host:rx", rate_mbit=FAIR_LINK * 8 / 1e6)
    priorities = [0.0, 1.0, 2.0, 4.0]
    cfg = SchedulerConfig()
    weights = [p + 0.0 + cfg.urgency_base + cfg.urgency_alpha for p in priorities]
    await phase.start({f"fair-{a}": (a, arm_config(a, FAIR_LINK)[0]) for a in ARMS})
    per: dict[str, list[dict[str, Any]]] = {a: [] for a in ARMS}
    try:
        for r in range(rounds):
            for arm in ARMS:
                group, name = f"fair-{arm}", f"fr{r}-{arm}"
                job = tx.call(
                    f"{OPS}:fairness",
                    url=net.url("tx"),
                    group=group,
                    prefix=name,
                    rx=f"{name}-rx",
                    seconds=seconds,
                    nbytes=6 * MB,
                    priorities=priorities,
                )
                res = await _with_receiver(
                    net, rx, group, f"{name}-rx", arm_config(arm, FAIR_LINK)[1], job, priority=0.0
                )
                res["jain"] = jain([x / w for x, w in zip(res["rates"], weights)])
                per[arm].append(res)
                print(
                    f"  round {r + 1}/{rounds} {arm:<11}: jain {res['jain']:.3f}, {sum(res['rates']) / MB:.1f} MB/s",
                    flush=True,
                )
    finally:
        await phase.stop()
    out = {}
    for a in ARMS:
        totals = [sum(x["rates"]) for x in per[a]]
        out[a] = {
            "jain": median(x["jain"] for x in per[a]),
            "jain_rounds": spread(x["jain"] for x in per[a]),
            "shares": [
                median(x["rates"][i] / max(sum(x["rates"]), 1e-9) for x in per[a]) for i in range(len(priorities))
            ],
            "weights": weights,
            "weight_shares": [w / sum(weights) for w in weights],
            "total_mb_s": median(t / MB for t in totals),
        }
    return out


async def _sweep(
    net: BenchNet, phase: Schedulers, tx: Worker, rx: Worker, thresholds: tuple[float, ...], seconds: float
) -> list[Any]:
    net.set_link("host:rx", rate_mbit=SWEEP_LINK * 8 / 1e6)
    groups = {
        f"pre-{int(t * 100)}": ("wrr", arm_config("wrr", SWEEP_LINK, preempt_threshold=t, critical_boost=7.0)[0])
        for t in thresholds
    }
    await phase.start(groups)
    rows = []
    try:
        for t in thresholds:
            group = f"pre-{int(t * 100)}"
            job = tx.call(
                f"{OPS}:urgent",
                url=net.url("tx"),
                group=group,
                prefix=group,
                rx=f"{group}-rx",
                seconds=seconds,
                bulk_bytes=8 * MB,
                urgent_bytes=4 * MB,
            )
            res = await _with_receiver(net, rx, group, f"{group}-rx", BUDGET_SHARE * SWEEP_LINK, job)
            stats = await phase.stats(group)
            rows.append(
                {
                    "threshold": t,
                    "throughput_mb_s": res["throughput_mb_s"],
                    "urgent_p50_ms": 1e3 * pct(res["urgent_lat"], 0.5),
                    "urgent_p99_ms": 1e3 * pct(res["urgent_lat"], 0.99),
                    "bulk_p99_s": pct(res["bulk_lat"], 0.99),
                    "urgent_n": len(res["urgent_lat"]),
                    "pauses_asked": stats["preemptions"],
                    "pauses_declined": stats["declined_pauses"],
                }
            )
    finally:
        await phase.stop()
    return rows


def _decision(rounds: int, steps: int) -> dict[str, Any]:
    adaptive = default_selector(SchedulerConfig())
    sizes = DECISION_SIZES
    plain: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
    selected: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
    for r in range(rounds):
        for n in sizes:
            plain[n].append(decision_cost(n, steps, FixedSelector(), seed=1 + r))
            selected[n].append(decision_cost(n, max(50, steps // 2), adaptive, seed=1 + r))
    out: dict[str, Any] = {}
    for key, src, field in (
        ("decision_us_p99", plain, "p99"),
        ("decision_us_p50", plain, "p50"),
        ("decision_us_p99_with_selection", selected, "p99"),
        ("adjust_us_p99", plain, "adjust_p99"),
        ("adjust_us_p50", plain, "adjust_p50"),
    ):
        out[key] = {str(n): median(c[field] for c in src[n]) for n in sizes}
        out[key + "_rounds"] = {str(n): spread((c[field] for c in src[n]), digits=2) for n in sizes}
    # How the cost grows with the group: per round, the p99 at the largest size over the smallest.
    lo, hi = sizes[0], sizes[-1]
    for key, src, field in (("decision_us_p99", plain, "p99"), ("adjust_us_p99", plain, "adjust_p99")):
        growth = [ratio(src[hi][r][field], src[lo][r][field]) for r in range(rounds)]
        out[f"{key}_growth_{lo}_to_{hi}"] = median(growth)
        out[f"{key}_growth_{lo}_to_{hi}_rounds"] = spread(growth)
    return out


async def _run(*, quick: bool, smoke: bool, network: str | None, nats_url: str | None) -> dict[str, Any]:
    rounds = 1 if smoke else 2 if quick else FULL_ROUNDS
    crit_s, fair_s, sweep_s = (2.0, 2.0, 2.0) if smoke else (6.0, 5.0, 4.0) if quick else (12.0, 10.0, 8.0)
    thresholds = (0.3,) if smoke else (0.1, 0.3, 0.8) if quick else (0.1, 0.2, 0.3, 0.5, 0.8)
    net = open_net(topology(), network=network, nats_url=nats_url)
    results: dict[str, Any] = {}
    try:
        phase = Schedulers(net)
        tx, rx, _ = await asyncio.gather(
            net.worker("tx", "sched-tx"), net.worker("rx", "sched-rx"), phase.start_workers()
        )
        paths, left_out = bench_paths(net.mode)
        print(
            f"network: {net.mode}; {rounds} interleaved round(s) of {', '.join(ARMS)}; bulk on "
            f"{', '.join(paths)} in turn",
            flush=True,
        )
        by_path: dict[str, Any] = {}
        for path in paths:
            by_path[path] = await _critical(net, phase, tx, rx, rounds, crit_s, path)
        # The top-level figures are those of the path the bus takes between these hosts by default.
        crit = by_path[paths[0]]
        results["by_path"] = {p: _path_figures(c) for p, c in by_path.items()}
        results.update(results["by_path"][paths[0]])
        results["by_path_left_out"] = left_out
        results["default_path"] = paths[0]
        results["fifo_concurrency_lets_critical_pass_bulk"] = FIFO_PASSES
        idle = crit["arms"].pop(IDLE)
        results["critical"] = crit["arms"]
        results["critical_idle"] = idle
        results["jitter_p99_over_p50"] = crit["arms"]["wrr"]["jitter_p99_over_p50"]
        results["jitter"] = {
            f"{a}_{kind}": crit["arms"][a][key]
            for a in ARMS
            for kind, key in (("critical", "jitter_p99_over_p50"), ("bulk", "bulk_jitter_p99_over_p50"))
        }
        fair = await _fairness(net, phase, tx, rx, rounds, fair_s)
        results["jain_fairness"] = fair["wrr"]["jain"]
        results["jain_fairness_rounds"] = fair["wrr"]["jain_rounds"]
        results["fairness"] = fair
        results["preempt_threshold_sweep"] = await _sweep(net, phase, tx, rx, thresholds, sweep_s)
        described = net.describe()
    finally:
        await net.close()
    results.update(_decision(rounds, 100 if smoke else 2000 if quick else 6000))
    results["rounds"] = rounds
    return {"results": results, "net": described}


def run(
    *, quick: bool = False, smoke: bool = False, network: str | None = None, nats_url: str | None = None, **_: Any
) -> dict[str, Any]:
    """Run the suite (``smoke``: one short round of everything, for the test suite)."""
    t0 = time.perf_counter()
    out = asyncio.run(_run(quick=quick, smoke=smoke, network=network, nats_url=nats_url))
    results = out["results"]
    config = {
        "network": out["net"]["network"],
        "net": out["net"],
        "rounds": results["rounds"],
        "interleaving": "per round: " + ", ".join(ARMS) + f" (same order every round; the critical experiment "
        f"then runs {IDLE}: wrr's critical senders without bulk)",
        "signature": SIG.to_dict(),
        "budget_share": BUDGET_SHARE,
        "arms": {
            "wrr": f"weighted round robin, budget {BUDGET_SHARE} x link rate, receiver declares the same, max_active "
            "8, per_pair 1, preemption on (kvbus defaults)",
            "fifo": f"first come first served, the same budget ({BUDGET_SHARE} x link rate) and concurrency "
            "(max_active 8, one per sender), receiver declares the same. Its concurrency lets critical transfers "
            "pass bulk: 4 bulk + 2 critical senders fit in max_active 8, so a critical request is granted at once "
            "and shares the link with the running bulk",
            "fifo1": "the usual FIFO: first come first served, one transfer at a time on the receiver's link "
            "(max_active 1: the bench has one receiver), the same budget and declaration; a critical request "
            "waits for the bulk transfer ahead of it",
            "strict": "strict priority, no weights: queued critical transfers before bulk (past max_active 8, one "
            "per sender), running critical ones share the budget and bulk gets what is left (1 % floor), rate "
            "controls at once when a critical transfer starts or ends; the same budget and declaration",
            "unscheduled": "no scheduling: every transfer granted at once and unpaced (no budget, max_active and "
            "per_pair 1e6, no preemption, no declared link); the flows share the link itself",
        },
        "critical": "4 bulk x 8 MB + 2 x 64 KB critical every 200 ms (open loop), 40 MB/s link; the whole "
        "experiment once per data path the bulk is pinned to (results.by_path; the top-level figures are "
        "results.default_path's, the path the bus takes between these hosts by default); payloads up to "
        f"{INLINE} bytes (the critical ones) go inline in the Open over NATS on every path",
        "critical_idle": "the wrr arm's 2 x 64 KB critical every 200 ms with no bulk, same link and scheduler "
        "config: the floor of the critical latency here; critical_p99_ratio_wrr_vs_idle is wrr's p99 over it",
        "fairness": "priorities 0/1/2/4 -> W 2/3/4/6, 6 MB transfers, 30 MB/s link, every arm",
        "sweep": "wrr only: 3 bulk x 8 MB + critical 4 MB every 0.2-0.6 s (critical_boost 7), 40 MB/s link, one pass",
        "decision": "n/2 running, n/2 waiting; one done + one arrival per step; thread CPU time of decide() per "
        "grant (gc frozen), in process",
        "seconds": round(time.perf_counter() - t0, 1),
    }
    _print(results)
    return {"suite": "sched", "config": config, "results": results}


def _print(r: dict[str, Any]) -> None:
    c = r["critical"]
    print(
        "critical p99: "
        + ", ".join(f"{a} {c[a]['critical_p99_ms']:.1f} ms" for a in ARMS)
        + " -> over WRR: "
        + ", ".join(f"{a} {r[f'critical_p99_ratio_{a}_vs_wrr_rounds']}" for a in BASELINES)
    )
    print(
        f"critical p99 without bulk (wrr): {r['critical_idle']['critical_p99_ms']:.1f} ms; wrr over it: "
        f"{r['critical_p99_ratio_wrr_vs_idle_rounds']}"
    )
    print(f"bulk throughput WRR / unscheduled: {r['bulk_throughput_ratio_wrr_vs_unscheduled_rounds']}")
    for path, f in r["by_path"].items():
        print(
            f"  bulk on {path}: critical p99 over WRR: unscheduled "
            f"{f['critical_p99_ratio_unscheduled_vs_wrr_rounds']}, fifo1 "
            f"{f['critical_p99_ratio_fifo1_vs_wrr_rounds']}; bulk WRR / unscheduled "
            f"{f['bulk_throughput_ratio_wrr_vs_unscheduled_rounds']}; bulk took {f['bulk_paths']['wrr']}"
        )
    f = r["fairness"]
    print("jain fairness: " + ", ".join(f"{a} {f[a]['jain']:.3f}" for a in ARMS))
    for s in r["preempt_threshold_sweep"]:
        print(
            f"  threshold {s['threshold']:.0%}: {s['throughput_mb_s']:.1f} MB/s, urgent p50 {s['urgent_p50_ms']:.0f} "
            f"p99 {s['urgent_p99_ms']:.0f} ms, bulk p99 {s['bulk_p99_s']:.2f} s, pauses {s['pauses_asked']} "
            f"({s['pauses_declined']} declined)"
        )
    print(
        f"decision us p99 per grant: {r['decision_us_p99']} (with the cost model: "
        f"{r['decision_us_p99_with_selection']}); adjust us p99: {r['adjust_us_p99']}; growth 16 -> 1024: "
        f"decide {r['decision_us_p99_growth_16_to_1024_rounds']}, adjust {r['adjust_us_p99_growth_16_to_1024_rounds']}"
    )
