"""`kvbus bench chaos --nats-cluster N`: N transfers with faults injected at random times; count what went wrong.

The cluster variant of `kvbus.app.bench.chaos`: its agents live in this one process (the
single-server suite runs them as OS processes killed with SIGKILL); here the faults are the
cluster's.

Four senders and four receivers (one process, each on its own NATS connection, an embedded
nats-server and a group scheduler) run ``transfers`` sends of 16 KB to 3 MB contexts, 16 at a
time. Meanwhile, at random times:

- the senders' transports drop, corrupt or forge chunk messages (each with a small probability);
- a receiver leaves and comes back (its inbox is gone for a moment, then it registers again);
- the group scheduler is closed and a new one started;
- the nats-server is killed (SIGKILL) and started again on the same port after up to a second
  (every client reconnects by itself).

Every send ends with a report or a `TransferError`. Each delivery is matched by transfer id
against what its sender sent (a blake2b digest of the tokens and KV bytes). Figures:
``delivered`` (reported and received intact), ``failed_with_error``, ``lost`` (reported to the
sender as delivered but never received), ``duplicated`` (received more than once),
``corrupted`` (received with other bytes than were sent), ``crashed`` (a send raised anything
but a `TransferError`). The goal is 0 for the last four.

With ``nats_cluster=N`` (``kvbus bench chaos --nats-cluster 3``) the run uses a real N-server NATS
cluster (`kvbus.app.cluster.NatsCluster`, buckets at R3) and every client is given every server;
instead of restarting the one server, a random server is killed (SIGKILL) every few seconds and
started again on its ports and store once it was down a moment (one at a time: R3 keeps a
quorum). Extra figures: ``cluster_servers``, ``server_kills``, the transfer p99 overall and of the
transfers in flight while a server was down, and the time from each kill to the next completed
transfer (``resume_s``).
"""

from __future__ import annotations

import asyncio
import collections
import io
import logging
import random
import time
from typing import Any

from kvbus.app.bench.chaos_agents import GROUP, SIG, kv_digest, make_kv
from kvbus.app.cluster import NatsCluster
from kvbus.app.local import NatsServer
from kvbus.bus import Bus, BusConfig, TransferError
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig
from kvbus.net.buckets import key_value
from kvbus.protocol import CHUNK_INDEX_HEADER, CHUNK_SUM_HEADER

logger = logging.getLogger(__name__)

#: The bucket the cluster run writes to after each server kill (to time the control plane's return).
PROBE_BUCKET = "kvbus_chaos_probe"
CONFIG = BusConfig(
    chunk_size=256 * 1024,
    ack_timeout=0.3,
    peer_timeout=3.0,
    request_timeout=1.0,
    grant_timeout=15.0,
    partial_timeout=3.0,
    regrant_interval=0.3,
    inline_limit=64 * 1024,
)


class ChaosTransport:
    """Wraps a transport: drops, corrupts or forges chunk messages at random."""

    def __init__(self, inner: Any, rng: random.Random, p_drop: float, p_corrupt: float, p_forge: float) -> None:
        self.inner, self.rng = inner, rng
        self.p_drop, self.p_corrupt, self.p_forge = p_drop, p_corrupt, p_forge
        self.counts: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def publish(self, subject: str, payload: Any, headers: dict[str, str] | None = None) -> None:
        """Publish through the inner transport; a chunk message may first be dropped, corrupted or forged.

        Forged chunks have one byte flipped and a checksum header recomputed over the flipped bytes
        (so only the end-to-end digest can catch them); corrupted ones keep the original checksum.
        Each injection is counted in ``counts``. Other messages pass through untouched.
        """
        if headers and CHUNK_INDEX_HEADER in headers:
            roll = self.rng.random()
            if roll < self.p_drop:
                self.counts["dropped"] += 1
                return
            if roll < self.p_drop + self.p_corrupt + self.p_forge:
                data = bytearray(payload)
                data[self.rng.randrange(len(data))] ^= 0x5A
                if roll >= self.p_drop + self.p_corrupt:
                    headers = {**headers, CHUNK_SUM_HEADER: _digest(bytes(data))}
                    self.counts["forged"] += 1
                else:
                    self.counts["corrupted"] += 1
                payload = bytes(data)
        await self.inner.publish(subject, payload, headers)


def _digest(data: bytes) -> str:
    from kvbus.bus.chunking import chunk_digest

    return chunk_digest(data)


class Receiver:
    """A receiving agent that can be restarted; collects every delivery of every incarnation."""

    def __init__(self, bus: Bus, name: str, deliveries: list[tuple[str, str, str]]) -> None:
        self.bus, self.name, self.deliveries = bus, name, deliveries
        self.agent: Any = None
        self._drain: asyncio.Task[None] | None = None
        self.restarts = 0

    async def start(self) -> None:
        """Open a fresh agent under this name and start collecting its deliveries."""
        self.agent = await self.bus.agent(self.name, group=GROUP, signature=SIG)
        self._drain = asyncio.create_task(self._collect(self.agent))

    async def _collect(self, agent: Any) -> None:
        while True:
            d = await agent.receive()
            self.deliveries.append((self.name, d.transfer_id, kv_digest(d.kv)))

    async def stop(self) -> None:
        """Stop collecting, close the agent, and record what was still in its inbox."""
        if self._drain is not None:
            self._drain.cancel()
        agent, self.agent = self.agent, None
        if agent is not None:
            await agent.close()
            for d in agent._inbox.drain():
                self.deliveries.append((self.name, d.transfer_id, kv_digest(d.kv)))

    async def restart(self, down_s: float) -> None:
        """Stop, stay down for ``down_s`` seconds, start again, and count the restart."""
        await self.stop()
        await asyncio.sleep(down_s)
        await self.start()
        self.restarts += 1


async def _chaos(transfers: int, seed: int, concurrency: int = 16, nats_cluster: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    cluster = NatsCluster(nats_cluster).start() if nats_cluster > 1 else None
    server = None if cluster is not None else NatsServer().start()
    buses: list[Bus] = []
    timings: list[tuple[float, float]] = []  # (start, end) of every send, perf_counter
    resumes: list[tuple[float, float]] = []  # per kill: seconds to reconnect its clients, to write control state
    outages: list[tuple[float, float]] = []  # (kill, back) of every server kill
    try:
        url = cluster.url if cluster is not None else server.url  # type: ignore[union-attr]
        sched_cfg = SchedulerConfig(max_active=16)
        sched = await GroupScheduler.connect(url, GROUP, config=sched_cfg)
        deliveries: list[tuple[str, str, str]] = []
        senders, receivers, chaos = [], [], []
        for i in range(4):
            b = await Bus.connect(url, config=CONFIG)
            buses.append(b)
            tx = await b.agent(f"chaos-tx{i}", group=GROUP, signature=SIG)
            wrapper = ChaosTransport(tx._transport, rng, p_drop=0.01, p_corrupt=0.005, p_forge=0.0005)
            tx._transport = wrapper
            chaos.append(wrapper)
            senders.append(tx)
        for i in range(4):
            b = await Bus.connect(url, config=CONFIG)
            buses.append(b)
            r = Receiver(b, f"chaos-rx{i}", deliveries)
            await r.start()
            receivers.append(r)
        # A pool of contexts (making one costs more than sending it); each send picks one.
        pool = [make_kv(rng.choice([16 << 10, 200 << 10, 1 << 20, 3 << 20]), seed=s) for s in range(24)]
        digests = [kv_digest(kv) for kv in pool]
        sent: dict[str, tuple[str, str]] = {}  # transfer id -> (receiver, digest)
        ok_ids: set[str] = set()
        failed = 0
        crashed: list[str] = []
        errors: collections.Counter[str] = collections.Counter()
        sem = asyncio.Semaphore(concurrency)
        done = 0
        faults = {"receiver_restarts": 0, "scheduler_restarts": 0, "nats_restarts": 0}

        async def one(k: int) -> None:
            nonlocal failed, done
            tx = senders[k % len(senders)]
            rx = receivers[rng.randrange(len(receivers))]
            j = rng.randrange(len(pool))
            async with sem:
                started = time.perf_counter()
                try:
                    report = await tx.send(rx.name, pool[j], medium="full")
                    sent[report.transfer_id] = (rx.name, digests[j])
                    ok_ids.add(report.transfer_id)
                except TransferError as exc:
                    failed += 1
                    errors[type(exc).__name__] += 1
                    if exc.transfer_id:
                        sent[exc.transfer_id] = (rx.name, digests[j])
                except Exception as exc:  # noqa: BLE001 - counted: the goal is none
                    crashed.append(f"{type(exc).__name__}: {exc}")
                finally:
                    done += 1
                    timings.append((started, time.perf_counter()))

        async def inject() -> None:
            nonlocal sched
            while done < transfers:
                await asyncio.sleep(rng.uniform(0.05, 0.4))
                roll = rng.random()
                if roll < 0.55:
                    await rng.choice(receivers).restart(rng.uniform(0.05, 0.5))
                    faults["receiver_restarts"] += 1
                elif roll < 0.8:
                    if server is None:
                        continue  # on a cluster, `kill_servers` kills the servers
                    server.kill()
                    await asyncio.sleep(rng.uniform(0.1, 1.0))
                    await asyncio.to_thread(server.start)
                    faults["nats_restarts"] += 1
                    await asyncio.sleep(1.0)  # let everyone reconnect before the next fault
                else:
                    await sched.close()
                    await asyncio.sleep(rng.uniform(0.05, 0.5))
                    sched = await GroupScheduler.connect(url, GROUP, config=sched_cfg)
                    faults["scheduler_restarts"] += 1

        async def kill_servers() -> None:
            assert cluster is not None
            probes = []
            probe_kv = await key_value(buses[0].transport.nc.jetstream(), PROBE_BUCKET)  # type: ignore[attr-defined]
            while done < transfers:
                await asyncio.sleep(rng.uniform(2.0, 5.0))
                victim = rng.randrange(cluster.size)
                port = cluster.servers[victim].port
                on_victim = [b for b in buses if _server_port(b) == port]
                killed = time.perf_counter()
                cluster.kill(victim)
                faults["server_kills"] = faults.get("server_kills", 0) + 1
                probes.append(asyncio.create_task(_resume_after_kill(killed, port, on_victim, probe_kv, resumes)))
                await asyncio.sleep(rng.uniform(0.5, 2.0))
                await asyncio.to_thread(cluster.restart, victim)
                outages.append((killed, time.perf_counter()))
            await asyncio.gather(*probes, return_exceptions=True)

        t0 = time.perf_counter()
        injectors = [asyncio.create_task(inject()), asyncio.create_task(_watchdog(lambda: done))]
        if cluster is not None:
            injectors.append(asyncio.create_task(kill_servers()))
        await asyncio.gather(*(one(k) for k in range(transfers)))
        for injector in injectors:
            injector.cancel()
            try:
                await injector
            except asyncio.CancelledError:
                pass
        elapsed = time.perf_counter() - t0
        await asyncio.sleep(0.5)
        for r in receivers:
            await r.stop()
        await sched.close()

        seen: collections.Counter[str] = collections.Counter(tid for _, tid, _ in deliveries)
        corrupted = sum(1 for name, tid, d in deliveries if tid not in sent or sent[tid] != (name, d))
        duplicated = sum(n - 1 for n in seen.values() if n > 1)
        delivered = sum(1 for tid in ok_ids if seen[tid] >= 1)
        lost = sum(1 for tid in ok_ids if seen[tid] == 0)
        injected: collections.Counter[str] = collections.Counter()
        for w in chaos:
            injected.update(w.counts)
        return {
            "transfers": transfers,
            "delivered": delivered,
            "failed_with_error": failed,
            "lost": lost,
            "duplicated": duplicated,
            "corrupted": corrupted,
            "crashed": len(crashed),
            "delivered_after_sender_error": sum(1 for tid in seen if tid in sent and tid not in ok_ids),
            "errors_by_type": dict(errors),
            "crash_samples": crashed[:5],
            "faults": {**faults, **dict(injected)},
            "seconds": round(elapsed, 2),
            **(cluster_figures(cluster.size, timings, outages, resumes) if cluster is not None else {}),
        }
    finally:
        for b in buses:
            await b.close()
        if server is not None:
            server.stop()
        if cluster is not None:
            cluster.stop()


def _p99_ms(durations: list[float]) -> float | None:
    if not durations:
        return None
    ordered = sorted(durations)
    return round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 1)


async def _watchdog(progress: Any, quiet_s: float = 120.0) -> None:
    """Log the stack of every task when no send finished for ``quiet_s`` (a hang is a bug: every
    send must end with a report or an error), once per stall."""
    last, since, dumped = progress(), time.monotonic(), False
    while True:
        await asyncio.sleep(5.0)
        now = progress()
        if now != last:
            last, since, dumped = now, time.monotonic(), False
        elif not dumped and time.monotonic() - since > quiet_s:
            dumped = True
            out = io.StringIO()
            for task in asyncio.all_tasks():
                task.print_stack(limit=15, file=out)
            logger.error("chaos: no send finished for %.0f s (%d done); tasks:\n%s", quiet_s, now, out.getvalue())


def _server_port(bus: Bus) -> int | None:
    url = getattr(getattr(bus.transport, "nc", None), "connected_url", None)
    return url.port if url is not None else None


async def _resume_after_kill(
    killed: float, port: int, on_victim: list[Bus], probe: Any, out: list[tuple[float, float]], limit_s: float = 30.0
) -> None:
    """Seconds from a kill until every client of the dead server is connected to a survivor, and
    until control state can be written again (a put in an R3 bucket of its own, whose stream may
    have to elect a new leader, as kvbus's own buckets do)."""
    reconnect = control = None
    directory = probe
    while time.perf_counter() - killed < limit_s and (reconnect is None or control is None):
        now = time.perf_counter()
        if reconnect is None and all(_server_port(b) not in (None, port) for b in on_victim):
            reconnect = now - killed
        if control is None and directory is not None:
            try:
                await asyncio.wait_for(directory.put("probe", str(now).encode()), 1.0)
                control = time.perf_counter() - killed
            except Exception:  # noqa: BLE001 - not yet: the stream has no leader
                pass
        await asyncio.sleep(0.01)
    out.append((reconnect if reconnect is not None else limit_s, control if control is not None else limit_s))


def _median_max(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "max": None}
    return {"median": round(sorted(values)[len(values) // 2], 3), "max": round(max(values), 3)}


def cluster_figures(
    servers: int,
    timings: list[tuple[float, float]],
    outages: list[tuple[float, float]],
    resumes: list[tuple[float, float]],
) -> dict[str, Any]:
    """The cluster run's figures: transfer p99 overall and while a server was down, time to resume."""
    during = [end - start for start, end in timings if any(start < back and end > kill for kill, back in outages)]
    return {
        "cluster_servers": servers,
        "server_kills": len(outages),
        "transfer_p99_ms": _p99_ms([end - start for start, end in timings]),
        "transfer_p99_during_failover_ms": _p99_ms(during),
        "transfers_during_failover": len(during),
        "resume_s": {
            "reconnect": _median_max([r for r, _ in resumes]),
            "control_state": _median_max([c for _, c in resumes]),
        },
    }


def run_cluster(
    *, quick: bool = False, transfers: int | None = None, seed: int = 1, nats_cluster: int = 3, **_: Any
) -> dict[str, Any]:
    """Run the chaos suite (``transfers`` defaults to 1000, 200 with ``quick``; ``nats_cluster``
    servers in a real NATS cluster instead of one server)."""
    n = transfers or (200 if quick else 1000)
    results = asyncio.run(_chaos(n, seed, nats_cluster=nats_cluster))
    print(
        f"chaos: {results['delivered']} delivered, {results['failed_with_error']} failed with an error, "
        f"{results['lost']} lost, {results['duplicated']} duplicated, {results['corrupted']} corrupted, "
        f"{results['crashed']} crashed; faults {results['faults']}"
    )
    if nats_cluster > 1:
        print(
            f"chaos on a {results['cluster_servers']}-server cluster: {results['server_kills']} server kills; "
            f"transfer p99 {results['transfer_p99_ms']} ms, {results['transfer_p99_during_failover_ms']} ms while a "
            f"server was down; resume after a kill {results['resume_s']} s"
        )
    return {
        "suite": "chaos",
        "config": {
            "transfers": n,
            "seed": seed,
            "nats_cluster": nats_cluster,
            "bus": {"ack_timeout": CONFIG.ack_timeout, "peer_timeout": CONFIG.peer_timeout},
        },
        "results": results,
    }
