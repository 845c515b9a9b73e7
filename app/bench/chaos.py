"""`kvbus bench chaos`: N transfers with faults injected at random times; count what went wrong.

Four senders and four receivers, each an OS process of its own (`kvbus.app.bench.chaos_agents`),
an embedded nats-server and a group scheduler (in this process) run ``transfers`` sends of
16 KB to 3 MB contexts, 16 at a time. Meanwhile, at random times:

- the senders' transports drop, corrupt, forge (bytes changed, checksum made to match) or
  duplicate chunk messages (each with a small probability);
- a hostile peer on the same server forges whole streams into some transfers: its own chunks
  with their checksums right and a whole-payload digest made to match (`chaos_agents.Forger`);
- a receiver leaves and comes back (graceful close), or is killed with SIGKILL and started again;
- a sender is killed with SIGKILL and started again (its sends in flight get no outcome);
- a receiver dies between a delivery and its final ack (a small probability per delivery) and is
  started again at once under the same name;
- the group scheduler is closed and a new one started;
- the nats-server is killed (SIGKILL) and started again on the same port (every client
  reconnects by itself).

When this machine can build the network testbed (root, iproute2; ``KVBUS_BENCH_NETWORK`` decides
as for the other benches), the run is spread over three hosts of a one-rack testbed: the
nats-server, the scheduler, the forger and this process's bench loop on ``core``, the senders on
``tx``, the receivers on ``rx`` (each host its own namespace, identity and address, on htb-shaped
1 Gbit/s veths), so the KV bytes go sender to receiver on the direct ``tcp`` path between two
namespaces, and a killed process leaves its peer a real half-open connection; else everything
runs on loopback. ``config.network`` says which.
Every send ends with a report or a `TransferError` (or with its sender killed). Each delivery is
matched by transfer id against what was sent (a blake2b digest of the tokens and KV bytes).
Figures: ``delivered`` (reported and received intact), ``failed_with_error``, ``sender_killed``
(no outcome: the sender died), ``lost`` (reported delivered, never received), ``duplicated``
(received more than once, across a receiver's incarnations), ``corrupted`` (received with other
bytes than were sent), ``forged_delivered`` (a forged stream delivered as a transfer's content),
``crashed`` (a send raised anything but a `TransferError`, or an agent process died by itself).
The goal is 0 for the last five. A failed send is one of two kinds: a plain `TransferError`
says nothing can have arrived, so ``delivered_after_sender_error`` (such a send that the
receiver did deliver) is a wrong answer, goal 0; a `TransferInDoubt` says the bytes may have
arrived, and is counted as ``in_doubt`` (``in_doubt_delivered``: how many of those the receiver
had; ``in_doubt_causes``: the failures they wrap, by type).

How ``lost`` is told apart from a receiver killed at the wrong moment: a receiver process prints
``accepted`` when its bus has verified and decoded a transfer and recorded it as done (its
verdict goes out next) and ``delivered`` when the delivery is in its inbox. For a large context
the inbox gets it only after the verdict (the receiver first keeps a private copy as the delta
base, in a thread, off the sender's path), and the line itself follows a digest of the context:
a receiver the bench SIGKILLs in those milliseconds acknowledged a transfer it then took down
with it. No bus can hand a context to an application that is killed after acknowledging it (an
inbox lives in the process), so such a transfer is not ``lost`` but counted as
``receiver_killed_after_verdict``: only when that very process (by pid) printed ``accepted`` and
was then killed by the bench. A transfer reported delivered that no process accepted, or whose
accepting process lived on without printing it, stays ``lost``.

``duplicated`` counts every second ``delivered`` line of a transfer id, whichever process (or
incarnation) printed it. With ``KVBUS_CHAOS_TRACE=path`` the bench writes, per lost or
duplicated transfer id, its lines (with the receiver's pid, incarnation, the attempt of the `Open`
it delivered from) and the faults around it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import random
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from kvbus.app.bench.chaos_agents import (
    CONFIG,
    DIED_AFTER_DELIVERY,
    GROUP,
    POOL_SPEC,
    Forger,
    kv_digest,
    make_kv,
)
from kvbus.app.local import NatsServer
from kvbus.app.processes import spawn
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig
from kvbus.net.transport import NatsTransport

if TYPE_CHECKING:
    from kvbus.app.testbed.fabric import Testbed

logger = logging.getLogger(__name__)

__all__ = ["run"]

#: Chunk damage by the senders' transports (per chunk message).
P_DROP, P_CORRUPT, P_FORGE, P_DUP = 0.01, 0.005, 0.0005, 0.005
#: Share of streamed transfers the hostile peer forges.
P_PEER_FORGE = 0.05
#: Chance that a receiver dies right after a delivery, before its final ack.
P_DIE_AFTER_DELIVERY = 0.01
#: The error type of a send whose bytes may have arrived (`kvbus.bus.TransferInDoubt`).
IN_DOUBT = "TransferInDoubt"
#: How long an agent process may take to start (a loaded machine imports torch slowly).
START_TIMEOUT_S = 180.0


@dataclass
class Send:
    """One transfer the bench asked for."""

    k: int
    sender: str
    rx: str
    j: int
    outcome: str = ""
    """``ok``, ``error``, ``crash`` or ``killed`` (its sender died before it ended)."""
    tid: str = ""
    error: str = ""
    """The type of the `TransferError` its sender got (``TransferInDoubt``: the bytes may have arrived)."""
    cause: str = ""
    """For a ``TransferInDoubt``: the type of the failure it wraps."""
    done: asyncio.Event = field(default_factory=asyncio.Event)


class AgentProcess:
    """One agent in an OS process of its own, restartable; its JSON lines go to ``on_event``."""

    def __init__(
        self,
        role: str,
        name: str,
        url: str,
        options: list[str],
        on_event: Any,
        spawner: Callable[[AgentProcess, list[str]], subprocess.Popen[bytes]] | None = None,
    ) -> None:
        self.role, self.name, self.url, self.options = role, name, url, options
        self.on_event = on_event
        self.spawner = spawner
        """Starts the process (on its testbed host); None: a local process."""
        self.ready = asyncio.Event()
        self.inflight: dict[int, Send] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.killing = False
        self.incarnations = 0
        self.killed: set[int] = set()
        """Process ids the bench killed (SIGKILL) while they ran."""
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the process and wait until its agent is registered."""
        cmd = [sys.executable, "-m", "kvbus.app.bench.chaos_agents", self.role, self.url, self.name]
        seed = str(zlib.crc32(self.name.encode()) % 10_000 * 100 + self.incarnations)
        err = None if os.environ.get("KVBUS_BENCH_DEBUG") else subprocess.DEVNULL
        argv = [*cmd, "--seed", seed, *self.options]
        if self.spawner is not None:
            self.proc = self.spawner(self, argv)
        else:
            self.proc = spawn(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        self.incarnations += 1
        self.killing = False
        self.ready.clear()
        self._reader = asyncio.create_task(self._read(self.proc))
        await asyncio.wait_for(self.ready.wait(), START_TIMEOUT_S)

    async def _read(self, proc: subprocess.Popen[bytes]) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 20)
        if proc.stdout is None:
            return
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), proc.stdout)
        while True:
            line = await reader.readline()
            if not line:
                break
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "ready":
                self.ready.set()
            event["pid"] = proc.pid  # which process (incarnation) said it
            self.on_event(self, event)
        code = await asyncio.to_thread(proc.wait)
        if proc is self.proc and not self.killing:
            self.on_event(self, {"event": "exited", "code": code})

    def tell(self, line: str) -> bool:
        """Write a command line to the process; False when it is gone."""
        proc = self.proc
        if proc is None or proc.stdin is None or proc.poll() is not None:
            return False
        try:
            proc.stdin.write((line + "\n").encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return False
        return True

    def kill(self) -> list[Send]:
        """SIGKILL it; returns the sends it had in flight (their outcome is unknown)."""
        self.killing = True
        self.ready.clear()
        if self.proc is not None and self.proc.poll() is None:
            self.killed.add(self.proc.pid)
            self.proc.kill()
        lost = list(self.inflight.values())
        self.inflight.clear()
        return lost

    async def stop(self) -> None:
        """Ask it to finish, then make sure it is gone."""
        self.tell("quit")
        self.killing = True
        if self.proc is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), 30)
            except TimeoutError:
                self.proc.kill()
        if self._reader is not None:
            try:
                await asyncio.wait_for(self._reader, 10)
            except (TimeoutError, Exception):  # noqa: BLE001 - it is going away either way
                pass


class TestbedSite:
    """Where the chaos run's processes live on the testbed: senders on ``tx``, receivers on
    ``rx``, nats-server and this process (its scheduler and forger) on ``core``."""

    HOSTS: ClassVar[dict[str, float]] = {"core": 1000.0, "tx": 1000.0, "rx": 1000.0}

    def __init__(self, tb: Testbed) -> None:
        self.tb = tb

    def nats(self) -> NatsServer:
        """A nats-server on every address of ``core`` (this process is in its namespace)."""
        return NatsServer(host="0.0.0.0", advertise=self.tb.ip("core"))

    def spawn(self, agent: AgentProcess, argv: list[str]) -> subprocess.Popen[bytes]:
        """Start ``agent``'s process on its host (its stderr goes to the run folder's log)."""
        host = "tx" if agent.role == "sender" else "rx"
        return self.tb.spawn(
            host, argv, name=f"{agent.name}-{agent.incarnations}", stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )

    def describe(self) -> dict[str, Any]:
        """What `config` records."""
        return {
            **self.tb.describe(),
            "placement": {"core": "nats-server, scheduler, forger, bench", "tx": "senders", "rx": "receivers"},
        }


async def _chaos(transfers: int, seed: int, concurrency: int = 16, site: TestbedSite | None = None) -> dict[str, Any]:
    rng = random.Random(seed)
    server = (site.nats() if site is not None else NatsServer()).start()
    url = server.url
    spawner = site.spawn if site is not None else None
    sched_cfg = SchedulerConfig(max_active=16)
    sched = await GroupScheduler.connect(url, GROUP, config=sched_cfg)
    forger_transport = await NatsTransport.connect(url, name="kvbus-chaos-forger")
    forger = Forger(forger_transport, random.Random(seed + 1), P_PEER_FORGE)
    await forger.start()
    deliveries: list[tuple[str, str, str, str]] = []  # (receiver, transfer id, sender, digest)
    accepted: list[tuple[str, int]] = []  # (transfer id, receiver process): decided to deliver, verdict going out
    sends: dict[int, Send] = {}
    faults: collections.Counter[str] = collections.Counter()
    paths: collections.Counter[str] = collections.Counter()  # data paths of the sends that reported
    crashed: list[str] = []
    restarts: set[asyncio.Task[None]] = set()
    trace: list[dict[str, Any]] = []
    t_start = time.perf_counter()

    def note(who: str, incarnation: int, event: dict[str, Any]) -> None:
        trace.append({"t": round(time.perf_counter() - t_start, 3), "who": who, "inc": incarnation, **event})

    def restart_later(agent: AgentProcess, delay: float) -> None:
        async def go() -> None:
            await asyncio.sleep(delay)
            await agent.start()

        task = asyncio.create_task(go())
        restarts.add(task)
        task.add_done_callback(restarts.discard)

    def finish(send: Send, outcome: str, tid: str = "", error: str = "", cause: str = "") -> None:
        if send.done.is_set():
            return
        send.outcome, send.tid, send.error, send.cause = outcome, tid or send.tid, error, cause
        send.done.set()

    def on_event(agent: AgentProcess, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind != "fault":
            note(agent.name, agent.incarnations, event)
        if kind == "delivered":
            deliveries.append((event["rx"], event["tid"], event["sender"], event["digest"]))
        elif kind == "accepted":
            accepted.append((event["tid"], event["pid"]))
        elif kind in ("ok", "error", "crash"):
            if kind == "ok":
                paths[str(event.get("path", "?"))] += 1
            send = agent.inflight.pop(int(event["k"]), None)
            if send is not None:
                finish(send, kind, event.get("tid", ""), event.get("error", ""), event.get("cause", ""))
            if kind == "crash":
                crashed.append(event.get("error", ""))
        elif kind == "fault":
            faults[event["kind"]] += 1
        elif kind == "dying":
            faults["receiver_deaths_after_delivery"] += 1
        elif kind == "exited":
            for send in agent.kill():
                finish(send, "killed")
            if event.get("code") != DIED_AFTER_DELIVERY:
                crashed.append(f"{agent.name} exited with {event.get('code')}")
            restart_later(agent, 0.0)  # at once, under the same name

    pool = [make_kv(n, s) for n, s in POOL_SPEC]
    digests = [kv_digest(kv) for kv in pool]
    damage = ["--p-drop", str(P_DROP), "--p-corrupt", str(P_CORRUPT), "--p-forge", str(P_FORGE), "--p-dup", str(P_DUP)]
    senders = [AgentProcess("sender", f"chaos-tx{i}", url, damage, on_event, spawner) for i in range(4)]
    receivers = [
        AgentProcess(
            "receiver", f"chaos-rx{i}", url, ["--die-after-delivery", str(P_DIE_AFTER_DELIVERY)], on_event, spawner
        )
        for i in range(4)
    ]
    agents = [*senders, *receivers]
    try:
        await asyncio.gather(*(a.start() for a in agents))
        sem = asyncio.Semaphore(concurrency)
        done = 0

        async def one(k: int) -> None:
            nonlocal done
            async with sem:
                tx = senders[k % len(senders)]
                send = Send(k, tx.name, rng.choice(receivers).name, rng.randrange(len(pool)))
                sends[k] = send
                while not send.done.is_set():
                    await tx.ready.wait()
                    tx.inflight[k] = send
                    if tx.tell(f"send {k} {send.rx} {send.j}"):
                        break
                    tx.inflight.pop(k, None)
                    await asyncio.sleep(0.1)
                await send.done.wait()
                done += 1

        async def inject() -> None:
            nonlocal sched
            while done < transfers:
                await asyncio.sleep(rng.uniform(0.3, 1.2))
                roll = rng.random()
                if roll < 0.2:
                    rx = rng.choice(receivers)
                    if rx.ready.is_set() and rx.tell(f"restart {rng.uniform(0.05, 0.5):.2f}"):
                        faults["receiver_restarts"] += 1
                        note(rx.name, rx.incarnations, {"event": "FAULT_restart"})
                elif roll < 0.35:
                    rx = rng.choice(receivers)
                    if rx.ready.is_set():
                        rx.kill()
                        faults["receiver_kills"] += 1
                        note(rx.name, rx.incarnations, {"event": "FAULT_rx_kill"})
                        restart_later(rx, rng.uniform(0.05, 0.5))
                elif roll < 0.5:
                    tx = rng.choice(senders)
                    if tx.ready.is_set():
                        for send in tx.kill():
                            finish(send, "killed")
                        faults["sender_kills"] += 1
                        note(tx.name, tx.incarnations, {"event": "FAULT_tx_kill"})
                        restart_later(tx, rng.uniform(0.05, 0.5))
                elif roll < 0.7:
                    server.kill()
                    note("nats", 0, {"event": "FAULT_nats_kill"})
                    await asyncio.sleep(rng.uniform(0.1, 1.0))
                    await asyncio.to_thread(server.start)
                    faults["nats_restarts"] += 1
                    note("nats", 0, {"event": "FAULT_nats_up"})
                    await asyncio.sleep(1.0)  # let everyone reconnect before the next fault
                else:
                    note("sched", 0, {"event": "FAULT_sched_close"})
                    await sched.close()
                    await asyncio.sleep(rng.uniform(0.05, 0.5))
                    sched = await GroupScheduler.connect(url, GROUP, config=sched_cfg)
                    faults["scheduler_restarts"] += 1

        t0 = time.perf_counter()
        injector = asyncio.create_task(inject())
        await asyncio.gather(*(one(k) for k in range(transfers)))
        injector.cancel()
        try:
            await injector
        except asyncio.CancelledError:
            pass
        elapsed = time.perf_counter() - t0
        for task in list(restarts):
            try:
                await task
            except Exception:
                logger.warning("an agent did not restart", exc_info=True)
        await asyncio.sleep(1.0)  # the last verdicts and deliveries
    finally:
        for a in agents:
            await a.stop()
        await forger.stop()
        await forger_transport.close()
        await sched.close()
        server.stop()
    killed_rx = {pid for rx in receivers for pid in rx.killed}
    figures = _figures(transfers, sends, deliveries, digests, forger, faults, crashed, elapsed, accepted, killed_rx)
    figures["paths"] = dict(paths)
    if os.environ.get("KVBUS_CHAOS_TRACE"):
        _dump_trace(os.environ["KVBUS_CHAOS_TRACE"], sends, trace)
    return figures


def _dump_trace(path: str, sends: dict[int, Send], trace: list[dict[str, Any]]) -> None:
    """Write, per lost or duplicated transfer id, its events and the faults around them (debugging)."""
    seen = collections.Counter(e["tid"] for e in trace if e.get("event") == "delivered")
    ok = {s.tid for s in sends.values() if s.outcome == "ok"}
    odd = {tid: "duplicated" for tid, n in seen.items() if n > 1} | {tid: "lost" for tid in ok if not seen[tid]}
    out = []
    for tid, why in odd.items():
        events = [e for e in trace if e.get("tid") == tid]
        t0, t1 = min(e["t"] for e in events) - 3, max(e["t"] for e in events) + 1
        around = [
            e
            for e in trace
            if e["event"].startswith("FAULT") or e["event"] in ("ready", "restarted", "exited", "dying")
        ]
        out.append({"tid": tid, "why": why, "events": events, "around": [e for e in around if t0 <= e["t"] <= t1]})
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def _figures(
    transfers: int,
    sends: dict[int, Send],
    deliveries: list[tuple[str, str, str, str]],
    digests: list[str],
    forger: Forger,
    faults: collections.Counter[str],
    crashed: list[str],
    elapsed: float,
    accepted: list[tuple[str, int]] | None = None,
    killed_pids: set[int] | None = None,
) -> dict[str, Any]:
    """What went right and wrong, from what was sent and what arrived.

    A transfer reported delivered whose ``delivered`` line never came is `lost`, unless a receiver
    process said it ``accepted`` it (verified, decoded, recorded as done: its verdict was going
    out) and the bench then SIGKILLed that very process: ``receiver_killed_after_verdict``.
    """
    by_tid = {s.tid: s for s in sends.values() if s.tid}
    killed = [s for s in sends.values() if s.outcome == "killed"]
    seen: collections.Counter[str] = collections.Counter(tid for _, tid, _, _ in deliveries)
    corrupted = forged_delivered = 0
    for rx, tid, sender, digest in deliveries:
        sent = by_tid.get(tid)
        if sent is not None:
            right = sent.rx == rx and sent.sender == sender and digests[sent.j] == digest
        else:
            # A send whose sender was killed has no transfer id here: it must be one of those.
            right = any(s.rx == rx and s.sender == sender and digests[s.j] == digest for s in killed)
        if not right:
            corrupted += 1
            forged_delivered += tid in forger.forged
    ok = [s.tid for s in sends.values() if s.outcome == "ok"]
    # Transfers a receiver process took and was then killed by the bench, before it printed them.
    taken_by_killed = {tid for tid, pid in accepted or [] if pid in (killed_pids or set())}
    unseen = [tid for tid in ok if seen[tid] == 0]
    errors = collections.Counter(s.error for s in sends.values() if s.outcome == "error")
    failed = [s for s in sends.values() if s.outcome == "error"]
    in_doubt = [s for s in failed if s.error == IN_DOUBT]
    return {
        "transfers": transfers,
        "delivered": sum(1 for tid in ok if seen[tid] >= 1),
        "failed_with_error": len(failed),
        "sender_killed": len(killed),
        "lost": sum(1 for tid in unseen if tid not in taken_by_killed),
        "receiver_killed_after_verdict": sum(1 for tid in unseen if tid in taken_by_killed),
        "duplicated": sum(n - 1 for n in seen.values() if n > 1),
        "corrupted": corrupted,
        "forged_delivered": forged_delivered,
        "crashed": len(crashed),
        "delivered_after_sender_error": sum(1 for s in failed if s.error != IN_DOUBT and s.tid and seen[s.tid] >= 1),
        "in_doubt": len(in_doubt),
        "in_doubt_delivered": sum(1 for s in in_doubt if s.tid and seen[s.tid] >= 1),
        "in_doubt_causes": dict(collections.Counter(s.cause for s in in_doubt)),
        "delivered_after_sender_killed": sum(1 for tid in seen if tid not in by_tid),
        "errors_by_type": dict(errors),
        "crash_samples": crashed[:5],
        "faults": {**dict(faults), "forged_by_peer": len(forger.forged), "forged_chunks_by_peer": forger.chunks},
        "seconds": round(elapsed, 2),
    }


def run(
    *,
    quick: bool = False,
    smoke: bool = False,
    transfers: int | None = None,
    seed: int = 1,
    nats_cluster: int = 0,
    **_: Any,
) -> dict[str, Any]:
    """Run the chaos suite (``transfers`` defaults to 1000, 200 with ``quick``, 30 for a smoke run);
    with ``nats_cluster`` > 1, its cluster variant (`kvbus.app.bench.chaos_cluster`: a real NATS
    cluster whose servers are killed at random)."""
    n = transfers or (30 if smoke else 200 if quick else 1000)
    if nats_cluster > 1:
        from kvbus.app.bench.chaos_cluster import run_cluster

        return run_cluster(transfers=n, seed=seed, nats_cluster=nats_cluster)
    results, where = _run_where(n, seed)
    print(
        f"chaos: {results['delivered']} delivered, {results['failed_with_error']} failed with an error "
        f"({results['in_doubt']} of them in doubt, {results['in_doubt_delivered']} of those delivered; "
        f"{results['delivered_after_sender_error']} delivered after a plain error), "
        f"{results['sender_killed']} lost to killed senders, {results['lost']} lost, "
        f"{results['duplicated']} duplicated, {results['corrupted']} corrupted, "
        f"{results['forged_delivered']} forged delivered, {results['crashed']} crashed; faults {results['faults']}"
    )
    return {
        "suite": "chaos",
        "config": {
            "transfers": n,
            "seed": seed,
            "agents": "4 sender and 4 receiver processes",
            "bus": {"ack_timeout": CONFIG.ack_timeout, "peer_timeout": CONFIG.peer_timeout},
            "chunk_faults": {"drop": P_DROP, "corrupt": P_CORRUPT, "forge": P_FORGE, "duplicate": P_DUP},
            "peer_forge": P_PEER_FORGE,
            "die_after_delivery": P_DIE_AFTER_DELIVERY,
            **where,
        },
        "results": results,
    }


def _run_where(n: int, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run on the testbed when this machine can build it, else on loopback; and the
    ``config`` entries that say where it ran."""
    from kvbus.app.testbed import netns
    from kvbus.app.testbed.benchnet import choose_network

    network, why = choose_network()
    if network != "netns":
        return asyncio.run(_chaos(n, seed)), {"network": "loopback", "network_reason": why}
    from kvbus.app.testbed.fabric import Testbed
    from kvbus.app.testbed.topology import one_rack

    tb = Testbed(one_rack("chaos", TestbedSite.HOSTS, nats="core")).build()
    try:
        site = TestbedSite(tb)
        with netns.entered(tb.ns("core")):  # so its scheduler and forger reach core's nats-server
            results = asyncio.run(_chaos(n, seed, site=site))
        return results, {"network": "netns", "testbed": site.describe()}
    finally:
        tb.teardown()
