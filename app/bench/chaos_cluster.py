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
but a `TransferError`), ``hung`` (a send that ended neither way within `SEND_LIMIT_S`). The goal
is 0 for the last five. A failed send that says nothing can
have arrived (a plain `TransferError`) and was delivered is ``delivered_after_sender_error``
(goal 0); one whose sender got `TransferInDoubt` is counted as ``in_doubt`` (and
``in_doubt_delivered``, those the receiver had).

With ``nats_cluster=N`` (``kvbus bench chaos --nats-cluster 3``) the run uses a real N-server NATS
cluster (`kvbus.app.cluster.NatsCluster`, buckets at R3) and every client is given every server;
instead of restarting the one server, servers are killed (SIGKILL) while transfers are in flight,
one at a time (R3 keeps a quorum), at least `MIN_SERVER_KILLS` times a run: kill ``i`` comes once
``i + 1`` of ``kills + 1`` equal shares of the transfers have started, with at least half the
concurrency in flight, and kills the server that holds most of the bench's connections; the
victim is started again on its ports and store after 0.5-2 s. A *failover* lasts from the kill
until the victim has rejoined, every client it had is connected to a survivor and control state
can be written again (a put in an R3 bucket of its own, whose stream may have to elect a new
leader, as kvbus's own buckets do). Faults are injected one at a time: a failover waits for the
receiver or scheduler restart under way, and no other fault comes until `SETTLE_S` and a moment
more after it; the feed of transfers waits, a concurrency's worth past each kill's share, until
that kill has been made (so no run ends before its kills). So every failover is measured on its
own, under load, however fast the transfers go, and what the transfers during it pay is the
kill's cost (the other faults' windows lie outside it). Extra figures:
``cluster_servers``, ``server_kills`` (kills made), ``failovers`` (per kill: the server, how long
it was down, the resume times, the transfers that met it and how many of them failed; a transfer
that met two failovers counts in both), ``transfers_during_failover``,
``transfer_p99_ms`` overall, ``transfer_p99_during_failover_ms`` and
``transfer_p99_without_failover_ms`` (the transfers that met no failover), and ``resume_s``.

Each failed transfer is counted against the fault that caused it, ``failed_by_cause``
(`attribute`, a pure function of the transfer and the faults' windows). A fault is a window of
time, from when it was injected until it was over, widened by `SETTLE_S` (an error surfaces a
request timeout after what caused it; peers resubscribe on their own schedule), and some faults
affect only one agent:

1. ``receiver_restart``: the transfer's own receiver was restarted (closed, down, registered
   again) in a window the transfer overlaps;
2. ``server_kill``: else, the transfer overlaps a failover (every transfer may meet one: an
   Open's request, an ack or the scheduler's grant may cross the dead server, or a stream whose
   leader it was);
3. ``scheduler_restart``: else, it overlaps a scheduler's restart (every transfer asks it for a
   grant);
4. ``unknown``: nothing injected explains it (chunk damage is repaired, so it explains nothing).

The order puts the fault that names the transfer's own receiver first, and the server kill
before the scheduler's restart, so that no failure a kill may have caused is counted elsewhere.
The transfers "during a failover" are those that overlap a failover's window as widened, the
ones the goal ``failed_by_cause.server_kill`` <= 1 % counts against.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import functools
import io
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvbus.app.bench.chaos_agents import BASE_CONFIG, GROUP, SIG, kv_digest, make_kv
from kvbus.app.cluster import NatsCluster
from kvbus.app.local import NatsServer
from kvbus.bus import Bus, TransferError, TransferInDoubt
from kvbus.bus.paths import PathsConfig
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig
from kvbus.net.buckets import key_value
from kvbus.net.transport import NatsTransport, TransportWrapper
from kvbus.protocol import CHUNK_INDEX_HEADER, CHUNK_SUM_HEADER

logger = logging.getLogger(__name__)

#: The bucket the cluster run writes to after each server kill (to time the control plane's return).
PROBE_BUCKET = "kvbus_chaos_probe"
#: The chaos suites' bus settings, with the default credit window (there is no forger to give a chance).
CONFIG = BASE_CONFIG
#: Every byte over NATS: in this one process the direct paths (``shm``, ``tcp`` on loopback) would
#: carry the streams past the servers, and a server kill would meet only Opens, grants and acks.
PATHS = PathsConfig(allowed="nats")
#: Server kills in every cluster run, at the least (one more per `TRANSFERS_PER_KILL` transfers).
MIN_SERVER_KILLS = 3
TRANSFERS_PER_KILL = 250
#: Seconds a fault's window is widened by after it was over: a request sent just before the end
#: times out one ``request_timeout`` later, and peers that reconnected subscribe again within it.
SETTLE_S = CONFIG.request_timeout
#: Seconds a kill waits for the load it is meant to meet (then it is made anyway).
LOAD_WAIT_S = 30.0
#: Seconds the run waits, after its last transfer, for the failover under way to be over.
FAILOVER_LIMIT_S = 120.0
#: Seconds a send may take before the bench gives up on it and counts it as ``hung`` (every send
#: must end with a report or an error well before: the grant timeout is 15 s, the peer timeout 3 s).
SEND_LIMIT_S = 90.0
#: The error type of a send whose bytes may have arrived.
IN_DOUBT = TransferInDoubt.__name__


class Cause(enum.StrEnum):
    """What a failed transfer is counted against (`attribute`)."""

    RECEIVER_RESTART = "receiver_restart"
    SERVER_KILL = "server_kill"
    SCHEDULER_RESTART = "scheduler_restart"
    UNKNOWN = "unknown"


#: The order in which the faults a failed transfer overlaps are asked to explain it.
ORDER = (Cause.RECEIVER_RESTART, Cause.SERVER_KILL, Cause.SCHEDULER_RESTART)


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault as a window of time (``time.perf_counter`` seconds)."""

    cause: Cause
    start: float
    """When it was injected."""
    end: float
    """When it was over: the receiver or scheduler up again; for a server kill, the end of its failover."""
    who: str = ""
    """The one receiver it affects (a restart), or "" when it may affect any transfer."""

    def touches(self, start: float, end: float, settle_s: float = SETTLE_S) -> bool:
        """Whether a transfer that ran from ``start`` to ``end`` overlaps the window (widened by ``settle_s``)."""
        return start < self.end + settle_s and end > self.start


@dataclass(frozen=True, slots=True)
class Outcome:
    """One send as the bench saw it."""

    receiver: str
    start: float
    end: float
    error: str = ""
    """The type of the `TransferError` its sender got; "" when it was reported delivered."""
    cause: str = ""
    """For a `TransferInDoubt`: the type of the failure it wraps."""
    tid: str = ""
    by: str = ""
    """Who the error names: the receiver, or the scheduler that refused or cancelled it."""
    detail: str = ""
    """The error's text."""
    queued_s: float = 0.0
    """For a delivered send: from `send` to the scheduler's grant (its report's ``queued_s``)."""

    @property
    def failed(self) -> bool:
        """Whether its sender got an error."""
        return bool(self.error)

    @property
    def seconds(self) -> float:
        """How long the send took."""
        return self.end - self.start


def attribute(outcome: Outcome, faults: Iterable[Fault], settle_s: float = SETTLE_S) -> Cause:
    """The fault a failed transfer is counted against (the rule in the module's docstring)."""
    touching = [
        f
        for f in faults
        if (not f.who or f.who == outcome.receiver) and f.touches(outcome.start, outcome.end, settle_s)
    ]
    for cause in ORDER:
        if any(f.cause is cause for f in touching):
            return cause
    return Cause.UNKNOWN


def failed_by_cause(
    outcomes: Iterable[Outcome], faults: Sequence[Fault], settle_s: float = SETTLE_S
) -> dict[str, dict[str, int]]:
    """Per cause (every `Cause`, 0 when none), the failed transfers counted against it, by error type."""
    table: dict[str, collections.Counter[str]] = {cause.value: collections.Counter() for cause in Cause}
    for o in outcomes:
        if o.failed:
            table[attribute(o, faults, settle_s)][o.error] += 1
    return {cause: dict(types) for cause, types in table.items()}


class ChaosTransport(TransportWrapper):
    """Wraps a transport: drops, corrupts or forges chunk messages at random."""

    def __init__(self, inner: Any, rng: random.Random, p_drop: float, p_corrupt: float, p_forge: float) -> None:
        self.inner, self.rng = inner, rng
        self.p_drop, self.p_corrupt, self.p_forge = p_drop, p_corrupt, p_forge
        self.counts: collections.Counter[str] = collections.Counter()

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
        self.windows: list[tuple[float, float]] = []
        """(stopped, registered again) of every restart, perf_counter."""

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
        stopped = time.perf_counter()
        at = len(self.windows)
        self.windows.append((stopped, math.inf))  # down until it is up again, should the run end first
        self.restarts += 1
        await self.stop()
        await asyncio.sleep(down_s)
        await self.start()
        self.windows[at] = (stopped, time.perf_counter())


async def _chaos(transfers: int, seed: int, concurrency: int = 16, nats_cluster: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    cluster = NatsCluster(nats_cluster).start() if nats_cluster > 1 else None
    server = None if cluster is not None else NatsServer().start()
    buses: list[Bus] = []
    outcomes: list[Outcome] = []
    injected_faults: list[Fault] = []  # scheduler restarts and server kills (receivers keep their own)
    failovers: list[dict[str, Any]] = []
    resumes: list[tuple[float, float]] = []  # per kill: seconds to reconnect its clients, to write control state
    kills = max(MIN_SERVER_KILLS, transfers // TRANSFERS_PER_KILL) if cluster is not None else 0
    thresholds = [(i + 1) * transfers // (kills + 1) for i in range(kills)]
    # The feed of transfers waits a concurrency's worth past kill i's share until it was made.
    gates = [asyncio.Event() for _ in thresholds]
    try:
        url = cluster.url if cluster is not None else server.url  # type: ignore[union-attr]
        sched_cfg = SchedulerConfig(max_active=16)
        sched = await GroupScheduler.connect(url, GROUP, config=sched_cfg)
        deliveries: list[tuple[str, str, str]] = []
        senders, receivers, chaos = [], [], []
        for i in range(4):
            b = await Bus.connect(url, config=CONFIG, paths=PATHS)
            buses.append(b)
            tx = await b.agent(f"chaos-tx{i}", group=GROUP, signature=SIG)
            wrapper = ChaosTransport(tx.transport, rng, p_drop=0.01, p_corrupt=0.005, p_forge=0.0005)
            tx.transport = wrapper  # a wrapper: what it does not define goes to the inner transport
            chaos.append(wrapper)
            senders.append(tx)
        for i in range(4):
            b = await Bus.connect(url, config=CONFIG, paths=PATHS)
            buses.append(b)
            r = Receiver(b, f"chaos-rx{i}", deliveries)
            await r.start()
            receivers.append(r)
        # A pool of contexts (making one costs more than sending it); each send picks one.
        pool = [make_kv(rng.choice([16 << 10, 200 << 10, 1 << 20, 3 << 20]), seed=s) for s in range(24)]
        digests = [kv_digest(kv) for kv in pool]
        sent: dict[str, tuple[str, str]] = {}  # transfer id -> (receiver, digest)
        ok_ids: set[str] = set()
        paths: collections.Counter[str] = collections.Counter()  # data paths of the sends that reported
        crashed: list[str] = []
        hung: list[int] = []
        sem = asyncio.Semaphore(concurrency)
        started = done = inflight = 0
        alone = asyncio.Lock()  # held by each fault while it is injected: one at a time
        faults = {"receiver_restarts": 0, "scheduler_restarts": 0, "nats_restarts": 0, "server_kills": 0}

        async def one(k: int) -> None:
            nonlocal started, done, inflight
            tx = senders[k % len(senders)]
            rx = receivers[rng.randrange(len(receivers))]
            j = rng.randrange(len(pool))
            for gate, at in zip(gates, thresholds, strict=True):
                if k >= at + concurrency:
                    await gate.wait()
            async with sem:
                started += 1
                inflight += 1
                t0 = time.perf_counter()
                error = cause = tid = by = detail = ""
                queued_s = 0.0
                try:
                    report = await asyncio.wait_for(tx.send(rx.name, pool[j], medium="full"), SEND_LIMIT_S)
                    tid, queued_s = report.transfer_id, report.queued_s
                    sent[tid] = (rx.name, digests[j])
                    ok_ids.add(tid)
                    paths[",".join(report.paths)] += 1
                except TransferError as exc:
                    error, tid = type(exc).__name__, exc.transfer_id
                    cause = type(exc.cause).__name__ if isinstance(exc, TransferInDoubt) else ""
                    by, detail = exc.peer, str(exc)
                    if tid:
                        sent[tid] = (rx.name, digests[j])
                except TimeoutError:
                    hung.append(k)  # neither a report nor an error: a bug of the bus (goal: none)
                except Exception as exc:  # noqa: BLE001 - counted: the goal is none
                    crashed.append(f"{type(exc).__name__}: {exc}")
                finally:
                    done += 1
                    inflight -= 1
                    outcomes.append(Outcome(rx.name, t0, time.perf_counter(), error, cause, tid, by, detail, queued_s))

        async def inject() -> None:
            nonlocal sched
            while done < transfers:
                await asyncio.sleep(rng.uniform(0.05, 0.4))
                roll = rng.random()
                async with alone:
                    if roll < 0.55:
                        faults["receiver_restarts"] += 1
                        await rng.choice(receivers).restart(rng.uniform(0.05, 0.5))
                    elif roll < 0.8:
                        if server is None:
                            continue  # on a cluster, `kill_servers` kills the servers
                        t0 = time.perf_counter()
                        server.kill()
                        await asyncio.sleep(rng.uniform(0.1, 1.0))
                        await asyncio.to_thread(server.start)
                        injected_faults.append(Fault(Cause.SERVER_KILL, t0, time.perf_counter()))
                        faults["nats_restarts"] += 1
                        await asyncio.sleep(1.0)  # let everyone reconnect before the next fault
                    else:
                        # Down until it is up again, should the run end first.
                        injected_faults.append(Fault(Cause.SCHEDULER_RESTART, time.perf_counter(), math.inf))
                        faults["scheduler_restarts"] += 1
                        await sched.close()
                        await asyncio.sleep(rng.uniform(0.05, 0.5))
                        sched = await GroupScheduler.connect(url, GROUP, config=sched_cfg)
                        injected_faults[-1] = dataclasses.replace(injected_faults[-1], end=time.perf_counter())

        def loaded(at: int) -> bool:
            return started >= at and inflight >= concurrency // 2

        async def kill_servers() -> None:
            assert cluster is not None
            try:
                probe_kv = await key_value(buses[0].transport.nc.jetstream(), PROBE_BUCKET)  # type: ignore[attr-defined]
                for gate, at in zip(gates, thresholds, strict=True):
                    await _until(functools.partial(loaded, at), LOAD_WAIT_S)
                    async with alone:  # no other fault during a failover, or within its widened window
                        failovers.append(await _failover(cluster, buses, probe_kv, rng, inflight, resumes, gate.set))
                        injected_faults.append(
                            Fault(Cause.SERVER_KILL, failovers[-1].pop("killed"), failovers[-1].pop("over"))
                        )
                        faults["server_kills"] += 1
                        await asyncio.sleep(SETTLE_S + rng.uniform(0.2, 1.0))
            finally:
                for gate in gates:
                    gate.set()

        t0 = time.perf_counter()
        injectors = [asyncio.create_task(inject()), asyncio.create_task(_watchdog(lambda: done))]
        if cluster is not None:
            injectors.append(asyncio.create_task(kill_servers()))
        await asyncio.gather(*(one(k) for k in range(transfers)))
        if cluster is not None:
            # The last failover is measured to its end (the last transfers may end before it).
            await asyncio.wait([injectors[-1]], timeout=FAILOVER_LIMIT_S)
        for injector in injectors:
            if injector.done() and not injector.cancelled() and injector.exception() is not None:
                logger.error("chaos: a fault injector failed", exc_info=injector.exception())
            injector.cancel()
            try:
                await injector
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - logged above
                pass
        elapsed = time.perf_counter() - t0
        await asyncio.sleep(0.5)
        for r in receivers:
            await r.stop()
        await sched.close()

        injected: collections.Counter[str] = collections.Counter()
        for w in chaos:
            injected.update(w.counts)
        restarts = [Fault(Cause.RECEIVER_RESTART, a, b, r.name) for r in receivers for a, b in r.windows]
        if os.environ.get("KVBUS_CHAOS_TRACE"):
            _dump_trace(os.environ["KVBUS_CHAOS_TRACE"], t0, outcomes, [*restarts, *injected_faults])
        return {
            "transfers": transfers,
            **delivery_figures(outcomes, deliveries, sent, ok_ids),
            "crashed": len(crashed),
            "hung": len(hung),
            **causes_figures(outcomes, [*restarts, *injected_faults]),
            "crash_samples": crashed[:5],
            "faults": {**faults, **dict(injected)},
            "paths": dict(paths),
            "seconds": round(elapsed, 2),
            **(
                cluster_figures(cluster.size, outcomes, [*restarts, *injected_faults], resumes, failovers)
                if cluster
                else {}
            ),
        }
    finally:
        for b in buses:
            await b.close()
        if server is not None:
            server.stop()
        if cluster is not None:
            cluster.stop()


def _dump_trace(path: str, t0: float, outcomes: Sequence[Outcome], faults: Sequence[Fault]) -> None:
    """Write every failed or slow (> 1 s) send and every fault, times from the run's start (debugging)."""
    rows = [
        {**dataclasses.asdict(o), "start": round(o.start - t0, 3), "end": round(o.end - t0, 3)}
        for o in outcomes
        if o.failed or o.seconds > 1.0
    ]
    windows = [{**dataclasses.asdict(f), "start": round(f.start - t0, 3), "end": round(f.end - t0, 3)} for f in faults]
    with open(path, "w") as f:
        json.dump({"failed": rows, "faults": sorted(windows, key=lambda w: w["start"])}, f, indent=1)


async def _until(condition: Callable[[], bool], limit_s: float) -> None:
    """Wait until ``condition()`` holds, for ``limit_s`` seconds at most."""
    give_up = time.monotonic() + limit_s
    while not condition() and time.monotonic() < give_up:
        await asyncio.sleep(0.01)


async def _failover(
    cluster: NatsCluster,
    buses: list[Bus],
    probe_kv: Any,
    rng: random.Random,
    inflight: int,
    resumes: list[tuple[float, float]],
    on_kill: Callable[[], None],
) -> dict[str, Any]:
    """Kill the server that holds most of ``buses``' connections (then call ``on_kill``), start it
    again 0.5-2 s later, and wait until the failover is over (it rejoined, its clients are on
    survivors, control state can be written: `_resume_after_kill`). Returns what `failovers`
    records, with ``killed`` and ``over`` (perf_counter) for the fault's window."""
    ports = [s.port for s in cluster.servers]
    held = [sum(1 for b in buses if _server_port(b) == port) for port in ports]
    most = max(held)
    victim = rng.choice([i for i, n in enumerate(held) if n == most])
    port = ports[victim]
    on_victim = [b for b in buses if _server_port(b) == port]
    killed = time.perf_counter()
    cluster.kill(victim)
    on_kill()
    probe = asyncio.create_task(_resume_after_kill(killed, port, on_victim, probe_kv, resumes))
    down_s = rng.uniform(0.5, 2.0)
    await asyncio.sleep(down_s)
    await asyncio.to_thread(cluster.restart, victim)
    back = time.perf_counter()
    await probe
    reconnect, control = resumes[-1]
    return {
        "server": cluster.servers[victim].server_name,
        "clients": len(on_victim),
        "inflight_at_kill": inflight,
        "down_s": round(back - killed, 3),
        "reconnect_s": round(reconnect, 3),
        "control_state_s": round(control, 3),
        "killed": killed,
        "over": max(back, killed + reconnect, killed + control),
    }


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
    transport = bus.transport
    url = transport.nc.connected_url if isinstance(transport, NatsTransport) else None
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


def delivery_figures(
    outcomes: Sequence[Outcome],
    deliveries: Sequence[tuple[str, str, str]],
    sent: dict[str, tuple[str, str]],
    ok_ids: set[str],
) -> dict[str, Any]:
    """What arrived against what the senders were told: ``deliveries`` are (receiver, transfer id,
    digest) as received, ``sent`` maps each transfer id to its (receiver, digest), ``ok_ids`` are
    the transfers reported delivered."""
    seen: collections.Counter[str] = collections.Counter(tid for _, tid, _ in deliveries)
    failed = [o for o in outcomes if o.failed]
    in_doubt = [o for o in failed if o.error == IN_DOUBT]
    return {
        "delivered": sum(1 for tid in ok_ids if seen[tid] >= 1),
        "failed_with_error": len(failed),
        "lost": sum(1 for tid in ok_ids if seen[tid] == 0),
        "duplicated": sum(n - 1 for n in seen.values() if n > 1),
        "corrupted": sum(1 for name, tid, d in deliveries if tid not in sent or sent[tid] != (name, d)),
        "delivered_after_sender_error": sum(1 for o in failed if o.error != IN_DOUBT and o.tid and seen[o.tid]),
        "in_doubt": len(in_doubt),
        "in_doubt_delivered": sum(1 for o in in_doubt if o.tid and seen[o.tid]),
        "in_doubt_causes": dict(collections.Counter(o.cause for o in in_doubt)),
        "errors_by_type": dict(collections.Counter(o.error for o in failed)),
    }


def causes_figures(outcomes: Sequence[Outcome], faults: Sequence[Fault]) -> dict[str, Any]:
    """``failed_by_cause`` (failed transfers per `Cause`) and ``failed_by_cause_types`` (the same, by error type)."""
    table = failed_by_cause(outcomes, faults)
    return {
        "failed_by_cause": {cause: sum(types.values()) for cause, types in table.items()},
        "failed_by_cause_types": table,
    }


def cluster_figures(
    servers: int,
    outcomes: Sequence[Outcome],
    faults: Sequence[Fault],
    resumes: list[tuple[float, float]],
    failovers: list[dict[str, Any]],
) -> dict[str, Any]:
    """The cluster run's figures: the transfers that met a failover (a server kill's window, as
    `attribute` widens it) and their p99 against the others', time to resume; per failover in
    ``failovers``, the transfers that met it and those that failed with the kill as cause."""
    kills = [f for f in faults if f.cause is Cause.SERVER_KILL]
    during = [o for o in outcomes if any(f.touches(o.start, o.end) for f in kills)]
    calm = [o for o in outcomes if not any(f.touches(o.start, o.end) for f in kills)]
    for entry, kill in zip(failovers, kills, strict=False):
        met = [o for o in outcomes if kill.touches(o.start, o.end)]
        entry["transfers"] = len(met)
        entry["failed"] = sum(1 for o in met if o.failed)
        entry["failed_server_kill"] = sum(1 for o in met if o.failed and attribute(o, faults) is Cause.SERVER_KILL)
    p99_during = _p99_ms([o.seconds for o in during])
    p99_calm = _p99_ms([o.seconds for o in calm])
    return {
        "cluster_servers": servers,
        "server_kills": len(kills),
        "failovers": failovers,
        "transfer_p99_ms": _p99_ms([o.seconds for o in outcomes]),
        "transfer_p99_during_failover_ms": p99_during,
        "transfer_p99_without_failover_ms": p99_calm,
        "p99_during_over_without_failover": round(p99_during / p99_calm, 2) if p99_during and p99_calm else None,
        "transfers_during_failover": len(during),
        # Where the time goes: the wait for the scheduler's grant of the delivered ones.
        "grant_wait_p99_during_failover_ms": _p99_ms([o.queued_s for o in during if not o.failed]),
        "grant_wait_p99_without_failover_ms": _p99_ms([o.queued_s for o in calm if not o.failed]),
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
        f"chaos: {results['delivered']} delivered, {results['failed_with_error']} failed with an error "
        f"({results['in_doubt']} in doubt), {results['lost']} lost, {results['duplicated']} duplicated, "
        f"{results['corrupted']} corrupted, {results['crashed']} crashed; failed by cause "
        f"{results['failed_by_cause']}; faults {results['faults']}"
    )
    if nats_cluster > 1:
        print(
            f"chaos on a {results['cluster_servers']}-server cluster: {results['server_kills']} server kills, "
            f"{results['transfers_during_failover']} transfers during a failover; transfer p99 "
            f"{results['transfer_p99_ms']} ms, {results['transfer_p99_during_failover_ms']} ms during a failover, "
            f"{results['transfer_p99_without_failover_ms']} ms without; resume after a kill {results['resume_s']} s"
        )
    return {
        "suite": "chaos",
        "config": {
            "transfers": n,
            "seed": seed,
            "nats_cluster": nats_cluster,
            "bus": {"ack_timeout": CONFIG.ack_timeout, "peer_timeout": CONFIG.peer_timeout},
            "min_server_kills": MIN_SERVER_KILLS,
            "settle_s": SETTLE_S,
            "paths": PATHS.allowed,
        },
        "results": results,
    }
