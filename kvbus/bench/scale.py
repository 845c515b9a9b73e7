"""`kvbus bench scale`: scheduling overhead as agents grow, one flat group against groups of 64.

Every configuration gets a fresh nats-server. Each group scheduler runs in its own OS process
(``python -m kvbus.cli group-scheduler``, ``max_active`` high so no transfer waits for a slot and
no bandwidth budget, so the wait from request to grant is the scheduler's own overhead). The
agents are real bus clients spread over a few client processes (many agents per process, a few
NATS connections each); every agent sends one tiny inline context to its neighbour in its group.
A round is a synchronized burst: the parent publishes ``go`` and every agent sends at once. The
figure is the p99 over all rounds of the `TransferReport.queued_s` (request to grant).

Run as ``kvbus bench scale --json out.json`` (``--quick``: 64 and 256 agents, fewer rounds).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from typing import Any

logger = logging.getLogger(__name__)

GROUP_SIZE = 64
GO = "kvbus.bench.scale.go"
RESULT = "kvbus.bench.scale.result"
#: Agents per bus connection inside a client process.
AGENTS_PER_CONNECTION = 64


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def _tiny_kv() -> Any:
    import torch

    from kvbus.kvcache import KVCache
    from kvbus.signature import ModelSignature

    sig = ModelSignature("bench-tiny", n_layers=1, n_kv_heads=1, head_dim=8, dtype="float32", vocab_size=1000)
    shape = (1, 1, 4, 8)
    return KVCache(torch.arange(4).view(1, 4), sig, [torch.zeros(shape)], [torch.zeros(shape)])


async def _client(url: str, agents: list[tuple[str, str, str]], rounds: int, proc: int) -> None:
    """One client process: register ``agents`` (name, group, receiver), then one burst per ``go``."""
    from kvbus.bus import Bus, BusConfig

    kv = _tiny_kv()
    cfg = BusConfig(request_timeout=20.0, grant_timeout=60.0, peer_timeout=30.0, ack_timeout=5.0,
                    partial_timeout=30.0)
    buses = []
    handles = []
    for i in range(0, len(agents), AGENTS_PER_CONNECTION):
        bus = await Bus.connect(url, config=cfg)
        buses.append(bus)
        for name, group, to in agents[i:i + AGENTS_PER_CONNECTION]:
            handles.append((await bus.agent(name, group=group, signature=kv.signature), to))

    async def drain(agent: Any) -> None:
        while True:
            await agent.receive(timeout=3600)

    drains = [asyncio.create_task(drain(a)) for a, _ in handles]
    nc = buses[0].transport.nc  # type: ignore[attr-defined]
    go: asyncio.Queue[int] = asyncio.Queue()

    async def on_go(msg: Any) -> None:
        await go.put(int(msg.data))

    await nc.subscribe(GO, cb=on_go)
    await nc.flush()
    print("ready", flush=True)
    for _ in range(rounds):
        r = await go.get()
        results = await asyncio.gather(*(a.send(to, kv) for a, to in handles), return_exceptions=True)
        queued = [x.queued_s for x in results if not isinstance(x, BaseException)]
        errors = [repr(x) for x in results if isinstance(x, BaseException)]
        await nc.publish(RESULT, json.dumps({"proc": proc, "round": r, "queued": queued,
                                             "errors": errors[:3], "n_errors": len(errors)}).encode())
        await nc.flush()
    # Stay: agents of other processes may still be sending to ours. The parent kills this process.
    await asyncio.Event().wait()


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=None if os.environ.get("KVBUS_BENCH_DEBUG") else subprocess.DEVNULL,
                            text=True)


async def _wait_line(p: subprocess.Popen[str], want: str, timeout: float) -> None:
    assert p.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(p.stdout.readline), timeout)
    if want not in line:
        raise RuntimeError(f"child process said {line!r}, expected {want!r}")


async def _run_config(mode: str, n: int, *, rounds: int, clients: int) -> dict[str, Any]:
    import nats

    from kvbus.local import NatsServer

    n_groups = 1 if mode == "flat" else max(1, n // GROUP_SIZE)
    groups = [f"s{g}" for g in range(n_groups)]
    agents = []
    for i in range(n):
        g = i % n_groups if mode == "hier" else 0
        agents.append((f"a{i}", groups[g]))
    by_group: dict[str, list[str]] = {}
    for name, g in agents:
        by_group.setdefault(g, []).append(name)
    triples = []
    for name, g in agents:
        members = by_group[g]
        triples.append((name, g, members[(members.index(name) + 1) % len(members)]))
    env = {**os.environ, "KVBUS_SCHEDULER_MAX_ACTIVE": "1000000", "KVBUS_SCHEDULER_PER_PAIR": "1000",
           "KVBUS_SCHEDULER_BANDWIDTH_BPS": "0", "KVBUS_SCHEDULER_PREEMPT": "false",
           "KVBUS_SCHEDULER_LEADER_TTL_S": "0"}
    server = NatsServer().start()
    procs: list[subprocess.Popen[str]] = []
    try:
        scheds = [_spawn(["-m", "kvbus.cli", "group-scheduler", "--group", g, "--nats-url", server.url], env)
                  for g in groups]
        procs += scheds
        for p in scheds:
            await _wait_line(p, "group scheduler", 120)
        chunks = [triples[i::clients] for i in range(clients)]
        cl = [_spawn(["-m", "kvbus.bench.scale", "--client", server.url, str(rounds + 1), str(i), json.dumps(c)], env)
              for i, c in enumerate(chunks) if c]
        procs += cl
        for p in cl:
            await _wait_line(p, "ready", 300)
        nc = await nats.connect(server.url)
        inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def on_result(msg: Any) -> None:
            await inbox.put(json.loads(msg.data))

        await nc.subscribe(RESULT, cb=on_result)
        await nc.flush()
        queued: list[float] = []
        per_round = []
        n_errors = 0
        errors: list[str] = []
        for r in range(rounds + 1):  # round 0 warms up (directory caches, connections)
            await asyncio.sleep(0.5)
            t0 = time.perf_counter()
            await nc.publish(GO, str(r).encode())
            await nc.flush()
            got = [await asyncio.wait_for(inbox.get(), 300) for _ in cl]
            wall = time.perf_counter() - t0
            q = [x for g in got for x in g["queued"]]
            n_errors += sum(g["n_errors"] for g in got) if r else 0
            errors += [e for g in got for e in g["errors"]][:3] if r else []
            if r:
                queued += q
                per_round.append({"p99_ms": 1000 * _percentile(q, 0.99), "wall_s": wall})
        await nc.close()
        return {"agents": n, "groups": n_groups, "client_processes": len(cl), "rounds": rounds,
                "transfers": len(queued), "errors": n_errors, "error_samples": errors[:3],
                "sched_overhead_p50_ms": 1000 * _percentile(queued, 0.5),
                "sched_overhead_p99_ms": 1000 * _percentile(queued, 0.99),
                "sched_overhead_max_ms": 1000 * max(queued, default=float("nan")), "per_round": per_round}
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
        server.stop()


def run(*, quick: bool = False, nats_url: str | None = None, **_: Any) -> dict[str, Any]:
    """Flat and hierarchical at each size; the growth and flat/hier ratios the issue asks for."""
    sizes = [64, 256] if quick else [64, 256, 1024]
    rounds = 3 if quick else 5
    clients = 4
    results: dict[str, Any] = {"flat": {}, "hier": {}}
    for n in sizes:
        for mode in ("flat", "hier"):
            res = asyncio.run(_run_config(mode, n, rounds=rounds, clients=clients))
            results[mode][str(n)] = res
            print(f"{mode:5s} {n:5d} agents, {res['groups']:3d} groups: request->grant p50 "
                  f"{res['sched_overhead_p50_ms']:8.2f} ms  p99 {res['sched_overhead_p99_ms']:8.2f} ms  "
                  f"errors {res['errors']}", flush=True)
    top = str(sizes[-1])
    results["hier_growth_64_to_" + top] = (results["hier"][top]["sched_overhead_p99_ms"]
                                           / results["hier"]["64"]["sched_overhead_p99_ms"])
    results["flat_over_hier_at_" + top] = (results["flat"][top]["sched_overhead_p99_ms"]
                                           / results["hier"][top]["sched_overhead_p99_ms"])
    config = {"sizes": sizes, "group_size": GROUP_SIZE, "rounds": rounds, "client_processes": clients,
              "agents_per_connection": AGENTS_PER_CONNECTION, "cpus": os.cpu_count(),
              "how": "one nats-server per configuration; each group scheduler its own process "
                     "(python -m kvbus.cli group-scheduler, max_active 1e6, no budget); agents in "
                     f"{clients} client processes; every agent sends a tiny inline context to its group "
                     "neighbour in a synchronized burst per round; figure = p99 of TransferReport.queued_s"}
    return {"config": config, "results": results}


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--client":
    _url, _rounds, _proc, _spec = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
    asyncio.run(_client(_url, [tuple(x) for x in _spec], _rounds, _proc))
