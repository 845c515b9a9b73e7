"""`kvbus bench scale`: scheduling overhead as agents grow, one flat group against groups of 64.

What is measured: ``sched_overhead_*`` is the time from a transfer's request leaving its agent to
its grant leaving the group scheduler (the request's ``ts`` to the grant's ``sched_s``: one
clock, one host), with no bandwidth budget, so no grant waits for bandwidth or a slot: what is
left is the scheduler's own overhead, its queueing included. ``client_seen_*`` adds the way back
and the client process's own event-loop delay (hundreds of agents share one client process
here, where each would have its own in a deployment). The load is steady and grows with the
agents, as in a real team: every agent asks for a transfer to its group neighbour at random
(Poisson) times, ``RATE_PER_AGENT`` per second on average, and probes its scheduler every second.

How it runs on a small machine:

- on the testbed (``network: netns``, the default where it can be built) every configuration
  gets a fresh one: nats-server, the coordinator and the group schedulers on host ``core``, each
  client process on a host of its own behind a 10 Gbit/s htb link, so every request and grant
  crosses veths and the bridge; without it, everything runs on loopback (``network: loopback``);
- every configuration gets a fresh nats-server and a coordinator (``python -m kvbus.app.cli
  coordinator``, its own OS process); every group scheduler is its own OS process (``python -m
  kvbus.app.cli group-scheduler``, ``max_active`` high, no bandwidth budget) and announces its
  group to the coordinator every ``heartbeat_s`` (the default 2 s), as in a deployment, so
  the hierarchy's cost at the top (the coordinator's CPU, ``coordinator_cpu``) is measured too;
- the agents are real `kvbus.bus.Agent` objects (registered in the directory, probing, receiving
  grants on their ctl subjects), many per OS process (``CLIENT_PROCESSES`` processes, 64 agents per
  NATS connection). They are *light*: each transfer runs the bus client's own request -> grant ->
  done exchange with its group scheduler and leaves out the data stream, whose cost does not
  depend on scheduling (on two cores it would be the client processes' CPU that the figure
  measured, not the scheduler's);
- after a warm-up, every request in a window of ``SECONDS`` counts; the figures are p50/p99;
- each process's CPU over the window is read from /proc: ``scheduler_cpu_busiest`` is the share
  of a core the busiest scheduler needed. A scheduler is one event loop: every request, probe and
  completion of its group passes through it, so it saturates when that share reaches 1. Groups
  of 64 keep that share flat however many agents there are; one group makes it grow with them.

Configurations run in interleaved rounds (flat 64, hier 64, flat 256, ..., then again), and each
headline ratio is taken per round and reported as median with min and max.

Run as ``kvbus bench scale --json out.json`` (``--quick``: 64 and 256 agents, shorter windows, 2
rounds).
With ``--nats-cluster N`` every configuration runs on a fresh N-server NATS cluster instead, the
groups spread over its servers: group k's scheduler and client process k connect to server
k mod N first (``KVBUS_NATS_PIN``), so requests and grants cross the routes between servers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import subprocess
import sys
import time
import uuid
from typing import Any

logger = logging.getLogger(__name__)

GROUP_SIZE = 64
GO = "kvbus.app.bench.scale.go"
RESULT = "kvbus.app.bench.scale.result"
#: Agents per bus connection inside a client process.
AGENTS_PER_CONNECTION = 64
#: Client processes the agents are spread over.
CLIENT_PROCESSES = 4
#: Mean transfers per second each agent asks for.
RATE_PER_AGENT = 1.0
WARMUP_S = 3.0
SECONDS = 12.0


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _tiny_kv() -> Any:
    import torch

    from kvbus.kvcache import KVCache
    from kvbus.signature import ModelSignature

    sig = ModelSignature("bench-tiny", n_layers=1, n_kv_heads=1, head_dim=8, dtype="float32", vocab_size=1000)
    shape = (1, 1, 4, 8)
    return KVCache(torch.arange(4).view(1, 4), sig, [torch.zeros(shape)], [torch.zeros(shape)])


async def _client(url: str, agents: list[tuple[str, str, str]], proc: int, rate: float) -> None:
    """One client process: register ``agents`` (name, group, receiver), then run the load on ``go``."""
    from kvbus.bus import Bus, BusConfig
    from kvbus.net.transport import flush

    kv = _tiny_kv()
    cfg = BusConfig(request_timeout=20.0, grant_timeout=60.0, peer_timeout=30.0, ack_timeout=5.0, partial_timeout=30.0)
    buses = []
    handles = []
    for i in range(0, len(agents), AGENTS_PER_CONNECTION):
        bus = await Bus.connect(url, config=cfg)
        buses.append(bus)
        for name, group, to in agents[i : i + AGENTS_PER_CONNECTION]:
            handles.append((await bus.agent(name, group=group, signature=kv.signature), to))
    nc = buses[0].transport.nc  # type: ignore[attr-defined]
    go: asyncio.Queue[tuple[float, float, float]] = asyncio.Queue()

    async def on_go(msg: Any) -> None:
        spec = json.loads(msg.data)
        await go.put((spec["start"], spec["count_from"], spec["stop"]))

    await nc.subscribe(GO, cb=on_go)
    await flush(nc)
    print("ready", flush=True)
    start, count_from, stop = await go.get()
    overhead: list[float] = []
    at_scheduler: list[float] = []
    errors: list[str] = []
    n_errors = 0
    lag: list[float] = []

    async def one_agent(agent: Any, to: str) -> None:
        nonlocal n_errors
        rng = random.Random(hash(agent.name))
        due = start + rng.expovariate(rate)
        while due < stop:
            await asyncio.sleep(max(0.0, due - time.time()))
            if due >= count_from:
                lag.append(max(0.0, time.time() - due))
            tid = uuid.uuid4().hex
            t_wall = time.time()
            t0 = time.perf_counter()
            try:
                # The bus client's own request -> grant exchange (what `Agent.send` does before it
                # streams), then its completion report, which frees the scheduler's slot.
                grant = await agent._scheduler.request_grant(tid, [to], kv, None, None, False)
                took = time.perf_counter() - t0
                # The wait the grant asks for (a later start: bandwidth) is not scheduling overhead;
                # the grant left the scheduler at about t_wall + sched_s.
                took -= max(0.0, grant.start_at - (t_wall + grant.sched_s))
                await agent._scheduler.report_done(tid, grant.medium, [to], 0, 0.0, None)
                if due >= count_from:
                    overhead.append(max(0.0, took))
                    at_scheduler.append(grant.sched_s)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                if due >= count_from:
                    n_errors += 1
                    if len(errors) < 3:
                        errors.append(repr(exc))
            due += rng.expovariate(rate)

    await asyncio.gather(*(one_agent(a, to) for a, to in handles))
    payload = {
        "proc": proc,
        "overhead_us": [round(x * 1e6) for x in overhead],
        "at_scheduler_us": [round(x * 1e6) for x in at_scheduler],
        "errors": errors,
        "n_errors": n_errors,
        "lag_p99_ms": 1000 * _percentile(lag, 0.99),
    }
    await nc.publish(RESULT, json.dumps(payload).encode())
    await flush(nc)
    # Stay registered until the parent kills this process (other processes' agents may still
    # be asking for transfers to ours).
    await asyncio.Event().wait()


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    stderr = None if os.environ.get("KVBUS_BENCH_DEBUG") else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)


async def _wait_line(p: subprocess.Popen[str], want: str, timeout: float) -> None:
    assert p.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(p.stdout.readline), timeout)
    if want not in line:
        raise RuntimeError(f"child process said {line!r}, expected {want!r}")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def _pinned_url(urls: list[str], k: int) -> str:
    """Every server, server ``k mod len(urls)`` first (with KVBUS_NATS_PIN=1: the one it prefers)."""
    k %= len(urls)
    return ",".join(urls[k:] + urls[:k])


async def _drive(urls: list[str], n_clients: int, start: float, count_from: float, stop: float) -> list[dict[str, Any]]:
    """Tell every client process the load's times (``GO``) and collect their results."""
    import nats

    from kvbus.net.transport import flush

    nc = await nats.connect(urls)
    try:
        inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def on_result(msg: Any) -> None:
            await inbox.put(json.loads(msg.data))

        await nc.subscribe(RESULT, cb=on_result)
        await flush(nc)
        await nc.publish(GO, json.dumps({"start": start, "count_from": count_from, "stop": stop}).encode())
        await flush(nc)
        return [await asyncio.wait_for(inbox.get(), 300 + max(0.0, stop - time.time())) for _ in range(n_clients)]
    finally:
        await nc.close()


async def drive_op(ctx: Any, urls: list[str], n_clients: int, start: float, count_from: float, stop: float) -> Any:
    """Worker operation: `_drive` from a testbed host (the bench's own process is outside the namespaces)."""
    return await _drive(urls, n_clients, start, count_from, stop)


def topology(clients: int) -> Any:
    """One rack: ``core`` (nats-server, coordinator, group schedulers) and a host per client
    process, ``c0`` ..., each on a 10 Gbit/s link (htb; no delay: the delay line would spend the
    CPU this bench measures)."""
    from kvbus.app.testbed.topology import one_rack

    return one_rack("scale", {"core": 10000, **{f"c{i}": 10000 for i in range(clients)}}, nats="core")


class _Loopback:
    """A configuration's processes on this machine: a fresh nats-server (or cluster), children of this process."""

    mode = "loopback"

    def __init__(self, env: dict[str, str], nats_cluster: int) -> None:
        from kvbus.app.cluster import NatsCluster
        from kvbus.app.local import NatsServer

        self.env = env
        self.procs: list[subprocess.Popen[str]] = []
        self.server: NatsServer | NatsCluster
        if nats_cluster > 1:
            self.server = NatsCluster(nats_cluster).start()
            self.urls = self.server.urls
            env["KVBUS_NATS_PIN"] = "1"
        else:
            self.server = NatsServer().start()
            self.urls = [self.server.url]

    def spawn(self, host: str, args: list[str], name: str) -> subprocess.Popen[Any]:
        proc = _spawn(args, self.env)
        self.procs.append(proc)
        return proc

    async def ready(self, proc: subprocess.Popen[Any], host: str, name: str, want: str, timeout: float) -> None:
        await _wait_line(proc, want, timeout)

    async def prepare(self) -> None:
        pass

    async def drive(self, n_clients: int, start: float, count_from: float, stop: float) -> list[dict[str, Any]]:
        return await _drive(self.urls, n_clients, start, count_from, stop)

    async def close(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.server.stop()


class _Testbed:
    """A configuration's processes on testbed hosts (`topology`): a fresh testbed per configuration."""

    mode = "netns"

    def __init__(self, env: dict[str, str], clients: int) -> None:
        from kvbus.app.testbed.fabric import Testbed
        from kvbus.app.testbed.services import start_nats

        self.env = env
        self.tb = Testbed(topology(clients)).build()
        try:
            self.urls = [start_nats(self.tb)]
        except BaseException:
            self.tb.teardown()
            raise
        self.driver: Any = None

    def spawn(self, host: str, args: list[str], name: str) -> subprocess.Popen[Any]:
        return self.tb.python(host, *args, name=name, env=self.env)

    async def ready(self, proc: subprocess.Popen[Any], host: str, name: str, want: str, timeout: float) -> None:
        await asyncio.to_thread(self.tb.wait_for_log, proc, name, want, host=host, timeout=timeout)

    async def prepare(self) -> None:
        from kvbus.app.testbed.worker import Worker

        self.driver = await Worker.on_host(self.tb, "core", "scale-driver")

    async def drive(self, n_clients: int, start: float, count_from: float, stop: float) -> list[dict[str, Any]]:
        return list(
            await self.driver.call(
                "kvbus.app.bench.scale:drive_op",
                urls=self.urls,
                n_clients=n_clients,
                start=start,
                count_from=count_from,
                stop=stop,
            )
        )

    async def close(self) -> None:
        if self.driver is not None:
            await self.driver.close(timeout=10)
        await asyncio.to_thread(self.tb.teardown)


async def _run_config(
    mode: str,
    n: int,
    *,
    seconds: float,
    rate: float,
    clients: int = CLIENT_PROCESSES,
    warmup: float = WARMUP_S,
    group_size: int = GROUP_SIZE,
    nats_cluster: int = 0,
    network: str = "loopback",
) -> dict[str, Any]:
    n_groups = 1 if mode == "flat" else max(1, n // group_size)
    groups = [f"s{g}" for g in range(n_groups)]
    by_group: dict[str, list[str]] = {}
    for i in range(n):
        by_group.setdefault(groups[i % n_groups], []).append(f"a{i}")
    triples = [
        (name, g, members[(k + 1) % len(members)]) for g, members in by_group.items() for k, name in enumerate(members)
    ]
    env = {
        **os.environ,
        "KVBUS_SCHEDULER_MAX_ACTIVE": "1000000",
        "KVBUS_SCHEDULER_PER_PAIR": "1000",
        "KVBUS_SCHEDULER_BANDWIDTH_BPS": "0",
        "KVBUS_SCHEDULER_PREEMPT": "false",
        "KVBUS_SCHEDULER_LEADER_TTL_S": "0",
    }
    stack: _Loopback | _Testbed = _Testbed(env, clients) if network == "netns" else _Loopback(env, nats_cluster)
    urls = stack.urls
    try:
        coord = stack.spawn("core", ["-m", "kvbus.app.cli", "coordinator", "--nats-url", ",".join(urls)], "coordinator")
        await stack.ready(coord, "core", "coordinator", "coordinator on", 120)
        scheds = [
            stack.spawn(
                "core",
                ["-m", "kvbus.app.cli", "group-scheduler", "--group", g, "--nats-url", _pinned_url(urls, k)],
                f"scheduler-{g}",
            )
            for k, g in enumerate(groups)
        ]
        for g, p in zip(groups, scheds):
            await stack.ready(p, "core", f"scheduler-{g}", "group scheduler", 120)
        # Whole groups per client process where they fit, so a process's agents share connections.
        chunks = [triples[i::clients] for i in range(clients)]
        cl = [
            (
                f"c{i}",
                stack.spawn(
                    f"c{i}",
                    ["-m", "kvbus.app.bench.scale", "--client", _pinned_url(urls, i), str(i), str(rate), json.dumps(c)],
                    f"client-{i}",
                ),
            )
            for i, c in enumerate(chunks)
            if c
        ]
        for host, p in cl:
            await stack.ready(p, host, f"client-{host[1:]}", "ready", 300)
        procs = [coord, *scheds, *(p for _, p in cl)]
        await stack.prepare()
        start = time.time() + 0.5
        count_from = start + warmup
        stop = count_from + seconds
        driving = asyncio.ensure_future(stack.drive(len(cl), start, count_from, stop))
        await asyncio.sleep(max(0.0, count_from - time.time()))
        cpu0 = {p.pid: _cpu_seconds(p.pid) for p in procs}
        await asyncio.sleep(max(0.0, stop - time.time()))
        cpu1 = {p.pid: _cpu_seconds(p.pid) for p in procs}
        got = await driving
        client_seen = [x / 1e6 for g in got for x in g["overhead_us"]]
        overhead = [x / 1e6 for g in got for x in g["at_scheduler_us"]]
        sched_cpu = [(cpu1[p.pid] - cpu0[p.pid]) / seconds for p in scheds]
        client_cpu = sum(cpu1[p.pid] - cpu0[p.pid] for _, p in cl) / seconds
        return {
            "agents": n,
            "groups": n_groups,
            "cluster_servers": len(urls),
            "groups_per_server": [len(groups[k :: len(urls)]) for k in range(len(urls))],
            "client_processes": len(cl),
            "offered_per_s": n * rate,
            "transfers": len(overhead),
            "achieved_per_s": len(overhead) / seconds,
            "errors": sum(g["n_errors"] for g in got),
            "error_samples": [e for g in got for e in g["errors"]][:3],
            "sched_overhead_p50_ms": 1000 * _percentile(overhead, 0.5),
            "sched_overhead_p99_ms": 1000 * _percentile(overhead, 0.99),
            "sched_overhead_max_ms": 1000 * max(overhead, default=float("nan")),
            "client_seen_p50_ms": 1000 * _percentile(client_seen, 0.5),
            "client_seen_p99_ms": 1000 * _percentile(client_seen, 0.99),
            "client_start_lag_p99_ms": max(g["lag_p99_ms"] for g in got),
            "scheduler_cpu_busiest": max(sched_cpu),
            "scheduler_cpu_total": sum(sched_cpu),
            "coordinator_cpu": (cpu1[coord.pid] - cpu0[coord.pid]) / seconds,
            "client_cpu_total": client_cpu,
        }
    finally:
        await stack.close()


def run(
    *,
    quick: bool = False,
    smoke: bool = False,
    nats_url: str | None = None,
    seconds: float | None = None,
    rounds: int | None = None,
    nats_cluster: int = 0,
    network: str | None = None,
    **_: Any,
) -> dict[str, Any]:
    """Flat and hierarchical at each size, in interleaved rounds; the growth and flat/hier ratios per round.

    ``network``: ``netns`` runs every configuration on a fresh testbed (each client process on
    its own host, the servers on ``core``), ``emulated`` on this machine's loopback (the JSON says
    ``loopback``: no link is emulated), ``auto`` (default) the testbed when available. A NATS
    cluster (``nats_cluster``) runs on loopback.
    """
    from kvbus.app.bench.rounds import FULL_ROUNDS, median, ratio, spread
    from kvbus.app.testbed.benchnet import choose_network

    sizes = [8, 16] if smoke else [64, 256] if quick else [64, 256, 1024]
    window = seconds or (1.5 if smoke else 5.0 if quick else SECONDS)
    rounds = rounds or (1 if smoke else 2 if quick else FULL_ROUNDS)
    clients, warmup, group_size = (1, 1.0, 8) if smoke else (CLIENT_PROCESSES, WARMUP_S, GROUP_SIZE)
    if nats_cluster > 1:
        mode_net, why = "loopback", "a NATS cluster runs on loopback"
    else:
        mode_net, why = choose_network(network)
        mode_net = "netns" if mode_net == "netns" else "loopback"
    per: dict[str, dict[str, list[dict[str, Any]]]] = {
        "flat": {str(n): [] for n in sizes},
        "hier": {str(n): [] for n in sizes},
    }
    for r in range(rounds):
        for n in sizes:
            for mode in ("flat", "hier"):
                res = asyncio.run(
                    _run_config(
                        mode,
                        n,
                        seconds=window,
                        rate=RATE_PER_AGENT,
                        clients=clients,
                        warmup=warmup,
                        group_size=group_size,
                        nats_cluster=nats_cluster,
                        network=mode_net,
                    )
                )
                per[mode][str(n)].append(res)
                print(
                    f"round {r + 1}/{rounds} {mode:5s} {n:5d} agents, {res['groups']:3d} groups, "
                    f"{res['achieved_per_s']:6.0f} transfers/s: request->grant p50 "
                    f"{res['sched_overhead_p50_ms']:7.2f} ms  p99 {res['sched_overhead_p99_ms']:8.2f} ms  busiest "
                    f"scheduler {res['scheduler_cpu_busiest']:.2f} CPU  coordinator {res['coordinator_cpu']:.2f} CPU"
                    f"  errors {res['errors']}",
                    flush=True,
                )
    numeric = (
        "sched_overhead_p50_ms",
        "sched_overhead_p99_ms",
        "sched_overhead_max_ms",
        "client_seen_p50_ms",
        "client_seen_p99_ms",
        "client_start_lag_p99_ms",
        "scheduler_cpu_busiest",
        "scheduler_cpu_total",
        "coordinator_cpu",
        "client_cpu_total",
        "achieved_per_s",
    )
    results: dict[str, Any] = {"flat": {}, "hier": {}}
    for mode in ("flat", "hier"):
        for n in sizes:
            runs = per[mode][str(n)]
            row = {k: v for k, v in runs[-1].items() if k not in numeric}
            row.update({k: median(x[k] for x in runs) for k in numeric})
            row["sched_overhead_p99_ms_rounds"] = spread(x["sched_overhead_p99_ms"] for x in runs)
            row["errors"] = sum(x["errors"] for x in runs)
            row["transfers"] = sum(x["transfers"] for x in runs)
            results[mode][str(n)] = row
    lo, top = str(sizes[0]), str(sizes[-1])

    def per_round(fn: Any) -> dict[str, Any]:
        return spread(fn(i) for i in range(rounds))

    def field(mode: str, n: str, key: str, i: int) -> float:
        return float(per[mode][n][i][key])

    figures = {
        f"hier_growth_{lo}_to_{top}": per_round(
            lambda i: ratio(
                field("hier", top, "sched_overhead_p99_ms", i), field("hier", lo, "sched_overhead_p99_ms", i)
            )
        ),
        f"flat_over_hier_at_{top}": per_round(
            lambda i: ratio(
                field("flat", top, "sched_overhead_p99_ms", i), field("hier", top, "sched_overhead_p99_ms", i)
            )
        ),
        # Capacity: the share of one core the busiest scheduler needs. With one core per scheduler
        # (the deployment) this is what decides whether a loop keeps up; on a small machine the
        # latency above also carries every other process's CPU.
        f"busiest_scheduler_cpu_growth_hier_{lo}_to_{top}": per_round(
            lambda i: ratio(
                field("hier", top, "scheduler_cpu_busiest", i), field("hier", lo, "scheduler_cpu_busiest", i)
            )
        ),
        f"busiest_scheduler_cpu_flat_over_hier_at_{top}": per_round(
            lambda i: ratio(
                field("flat", top, "scheduler_cpu_busiest", i), field("hier", top, "scheduler_cpu_busiest", i)
            )
        ),
    }
    for key, value in figures.items():
        results[key] = value["median"]
        results[f"{key}_rounds"] = value
    results["rounds"] = rounds
    config = {
        "network": mode_net,
        "why": why,
        "hosts": "a fresh testbed per configuration: nats-server, coordinator and group schedulers on host "
        "core, each client process on a host of its own (c0, ...), 10 Gbit/s htb links, no delay"
        if mode_net == "netns"
        else "every process on this machine's loopback",
        "sizes": sizes,
        "nats_cluster": nats_cluster,
        "group_size": group_size,
        "seconds": window,
        "warmup_s": warmup,
        "rounds": rounds,
        "interleaving": "per round: for each size, flat then hier",
        "rate_per_agent": RATE_PER_AGENT,
        "client_processes": clients,
        "agents_per_connection": AGENTS_PER_CONNECTION,
        "cpus": os.cpu_count(),
        "how": "one nats-server and one coordinator process per configuration; each group scheduler its own "
        "process (python -m kvbus.app.cli group-scheduler, max_active 1e6, no bandwidth budget, "
        "heartbeats to the coordinator every 2 s); agents are "
        f"real bus Agents (registered, probing every second), {CLIENT_PROCESSES} client processes; "
        f"each agent asks for a transfer to its group neighbour at Poisson times, {RATE_PER_AGENT}/s "
        "on average, running the bus client's request -> grant -> done exchange without the data "
        "stream; figure = p99 of request sent -> grant sent by the scheduler over the measured "
        "window (client_seen_*: as the client saw it)",
    }
    return {"config": config, "results": results}


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--client":
    _url, _proc, _rate, _spec = sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), json.loads(sys.argv[5])
    asyncio.run(_client(_url, [tuple(x) for x in _spec], _proc, _rate))
