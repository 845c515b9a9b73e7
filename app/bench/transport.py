r"""`kvbus bench transport`: kvbus send/receive vs a plain nats-py loop vs Redis SET/GET.

The same bytes (a Llama-3-8B-shaped bf16 KV-cache of 64 MB, one of 1 MB and, in a full run, one of
512 MB: 4096 tokens) move between two OS processes on the same embedded servers three ways:

(a) kvbus ``send``/``receive`` with the ``full`` codec, through a group scheduler (its own
    process), timed from ``send`` until the receiver's verdict (verified and decoded);
(b) a plain nats-py publish/subscribe loop that publishes exactly the messages kvbus publishes
    (the same chunk plan over the same bytes) with the same credit window and acknowledgement
    interval, timed until the receiver has every chunk;
(c) redis-py ``SET`` then a ``GET`` by the receiver process (one command each, the whole payload);
(d) the loop a competent redis-py user writes for large values: the payload in chunks (1 MB or
    4 MB), ``SET`` in pipelines of several chunks (no transaction), then the receiver ``GET``\ s them
    in pipelines the same way; both chunkings run and the faster (by median) is the figure.

The data plane (`kvbus.app.bench.transport_paths`): (a) is the bus on the path it picks (two
agents of one host: ``shm``); the same sends from buses allowed ``tcp,nats`` and ``nats`` only
give ``results.shm_ratio_vs_nats_py``, ``tcp_ratio_vs_nats_py`` and
``nats_path_ratio_vs_nats_py``; a plain socket loop and a ``copy_`` of the same bytes give
``tcp_vs_loopback_limit`` and ``shm_vs_memcpy`` (the same context built in a shared segment by
its producer, `Agent.kv_buffer`, sent with no copy: ``kvbus_zero_copy``; the copying send's
figure is ``shm_copying_vs_memcpy``, and ``zero_copy_vs_copying`` compares the two sends).
``first_transfer_vs_steady``: the median
time of a send of the size over the time of this process's first (at 64 MB also the first to the
receiver, so not staged in a segment: the path is not known yet). At 1 MB the baseline is a plain nats-py
request/reply carrying the bytes, and ``results.round_trips_1MB`` counts the control round
trips (requests) one 1 MB ``send`` makes. ``by_size["64KB"]`` is a SmolLM2-135M-shaped context of
three tokens (67.5 KB; a Llama-3-8B token alone is 128 KB) between two more agents, against the
same request/reply, the two ways alternating.

Runs alternate between the three ways; the figure per way is the median of its runs. A fourth
way, alternating with them, is (a) with tracing and metrics on in all three processes (spans
exported over OTLP/HTTP to a local endpoint the benchmark runs in a process of its own, as a
collector would be; metrics on Prometheus endpoints), through a second scheduler and receiver
process: ``results.tracing_overhead`` is its throughput over (a)'s.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import nats
import redis.asyncio as aioredis
import torch

from kvbus import telemetry
from kvbus.app.bench import transport_paths as tp
from kvbus.app.bench.paths import _socket_server
from kvbus.app.bench.rounds import spread
from kvbus.app.local import NatsServer, RedisServer
from kvbus.bus import Bus, BusConfig
from kvbus.bus.chunking import ChunkPlan
from kvbus.bus.paths import PathsConfig
from kvbus.codecs import get_codec
from kvbus.kvcache import KVCache
from kvbus.net.transport import flush
from kvbus.signature import ModelSignature

LLAMA3_8B = ModelSignature(
    "llama-3-8b-shape",
    n_layers=32,
    n_kv_heads=8,
    head_dim=128,
    dtype="bfloat16",
    vocab_size=128256,
    rope_theta=500000.0,
)
#: The model of the small size (a 64 KB context is half a Llama-3-8B token): SmolLM2-135M's KV shape.
SMOLLM2 = ModelSignature(
    "smollm2-135m-shape",
    n_layers=30,
    n_kv_heads=3,
    head_dim=64,
    dtype="bfloat16",
    vocab_size=49152,
    rope_theta=100000.0,
)
#: The small size: sent between agents of `SMOLLM2`, against a plain nats-py request/reply.
SMALL_LABEL, SMALL_BYTES, SMALL_RX, SMALL_TX = "64KB", 64 * 1024, "bench-rx-small", "bench-tx-small"
RAW_SUBJECT = "kvbus.app.bench.raw"
CREDIT_SUBJECT = "kvbus.app.bench.raw.credit"
REDIS_SUBJECT = "kvbus.app.bench.redis"
REDIS_CHUNKED_SUBJECT = "kvbus.app.bench.redis.chunked"
#: (chunk bytes, chunks per pipeline) of the pipelined redis-py loops.
REDIS_PIPELINED = {"1MB_x8": (1 << 20, 8), "4MB_x4": (4 << 20, 4)}
GROUP = "bench"
#: The large size of a full run: 512 MB, Valkey's largest bulk string (its naive SET just fits).
LARGE_BYTES = 512 * 1024 * 1024
#: redis-py's socket timeout in the Redis loops (its default of 5 s fails the naive 512 MB SET).
REDIS_TIMEOUT_S = 120.0
#: The group, receiver and sender of the traced runs (their own scheduler and receiver process).
TRACED_GROUP, TRACED_RX, TRACED_TX = "bench-otel", "bench-rx-otel", "bench-tx-otel"


class OtlpSink:
    """A local OTLP/HTTP endpoint that accepts and counts exports, in a process of its own (where
    a collector would be: its work must not count against the traced processes)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvbus.app.bench.transport", "--sink"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http://"):
            raise RuntimeError("the OTLP sink did not start")
        self.requests = 0
        self.bytes = 0

    def close(self) -> None:
        """Stop it; ``requests`` and ``bytes`` then say what it received."""
        if self.proc.poll() is not None:
            return
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        counts = json.loads(self.proc.stdout.readline() or "{}")
        self.requests, self.bytes = int(counts.get("requests", 0)), int(counts.get("bytes", 0))
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _sink() -> None:
    """The sink's process: print its URL, count what it is sent, print the counts when stdin closes."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    counts = {"requests": 0, "bytes": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            counts["requests"] += 1
            counts["bytes"] += len(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="kvbus-otlp-sink").start()
    print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)
    sys.stdin.read()
    server.shutdown()
    print(json.dumps(counts), flush=True)


def make_kv(nbytes: int, signature: ModelSignature = LLAMA3_8B, seed: int = 0) -> KVCache:
    """A random KV-cache of about ``nbytes`` bytes of keys and values."""
    n_tokens = max(1, round(nbytes / signature.kv_bytes_per_token()))
    g = torch.Generator().manual_seed(seed)
    shape = (1, signature.n_kv_heads, n_tokens, signature.head_dim)
    dtype = signature.torch_dtype
    keys = [torch.randn(shape, generator=g).to(dtype) for _ in range(signature.n_layers)]
    values = [torch.randn(shape, generator=g).to(dtype) for _ in range(signature.n_layers)]
    return KVCache(torch.arange(n_tokens), signature, keys, values)


# -- the receiving process ---------------------------------------------------------------------


async def _peer(nats_url: str, redis_url: str, chunk_size: int, window: int, ack_every: int) -> None:
    traced = bool(os.environ.get("KVBUS_BENCH_TRACED"))
    bus = await Bus.connect(nats_url, config=BusConfig(chunk_size=chunk_size, window=window, ack_every=ack_every))
    agent = await bus.agent(
        TRACED_RX if traced else "bench-rx", group=TRACED_GROUP if traced else GROUP, signature=LLAMA3_8B
    )
    small = None if traced else await bus.agent(SMALL_RX, group=GROUP, signature=SMOLLM2)
    nc = await nats.connect(nats_url, pending_size=64 * 1024 * 1024)
    r = aioredis.Redis.from_url(redis_url, socket_timeout=REDIS_TIMEOUT_S)
    state: dict[str, Any] = {"n": 0, "bytes": 0, "chunks": []}

    async def on_raw(msg: Any) -> None:
        if msg.headers and "Bench-Start" in msg.headers:
            state.update(n=int(msg.headers["Bench-Start"]), bytes=0, count=0, chunks=[])
            return
        state["chunks"].append(msg.data)
        state["bytes"] += len(msg.data)
        state["count"] += 1
        if state["count"] % ack_every == 0 or state["count"] == state["n"]:
            await nc.publish(CREDIT_SUBJECT, str(state["count"]).encode())

    async def on_redis(msg: Any) -> None:
        data = await r.get(msg.data.decode())
        await nc.publish(msg.reply, str(len(data or b"")).encode())

    async def on_redis_chunked(msg: Any) -> None:
        prefix, n, per = msg.data.decode().split("|")
        total = 0
        keys = [f"{prefix}:{i}" for i in range(int(n))]
        for lo in range(0, len(keys), int(per)):
            async with r.pipeline(transaction=False) as pipe:
                for k in keys[lo : lo + int(per)]:
                    pipe.get(k)
                total += sum(len(x or b"") for x in await pipe.execute())
        await nc.publish(msg.reply, str(total).encode())

    if not traced:  # the traced receiver takes part in the kvbus runs only
        await nc.subscribe(RAW_SUBJECT, cb=on_raw, pending_bytes_limit=1 << 30)
        await nc.subscribe(REDIS_SUBJECT, cb=on_redis)
        await nc.subscribe(REDIS_CHUNKED_SUBJECT, cb=on_redis_chunked)
        await tp.serve_reqrep(nc)
    await flush(nc)
    print(f"ready {_socket_server([bytearray()])}", flush=True)

    async def drain_inbox(a: Any) -> None:
        async for _ in a.inbox():
            pass

    tasks = [asyncio.create_task(drain_inbox(a)) for a in (agent, small) if a is not None]
    try:
        await asyncio.Event().wait()
    finally:
        for task in tasks:
            task.cancel()
        await bus.close()
        await nc.close()


# -- the sending side --------------------------------------------------------------------------


async def _kvbus_once(agent: Any, kv: KVCache, to: str = "bench-rx") -> float:
    t = time.perf_counter()
    report = await agent.send(to, kv, medium="full")
    dt = time.perf_counter() - t
    assert report.nbytes >= kv.nbytes - kv.tokens.numel() * 8
    return dt


async def _nats_once(nc: Any, chunks: list[memoryview], window: int) -> float:
    n = len(chunks)
    credit = asyncio.Event()
    acked = [0]

    async def on_credit(msg: Any) -> None:
        acked[0] = int(msg.data)
        credit.set()

    sub = await nc.subscribe(CREDIT_SUBJECT, cb=on_credit)
    await nc.publish(RAW_SUBJECT, b"", headers={"Bench-Start": str(n)})
    await flush(nc)
    t = time.perf_counter()
    sent = 0
    while acked[0] < n:
        if sent < n and sent < acked[0] + window:
            await nc.publish(RAW_SUBJECT, chunks[sent])
            sent += 1
        else:
            credit.clear()
            await asyncio.wait_for(credit.wait(), 30)
    dt = time.perf_counter() - t
    await sub.unsubscribe()
    return dt


async def _redis_once(nc: Any, r: Any, payload: memoryview, key: str) -> float:
    t = time.perf_counter()
    await r.set(key, payload)
    reply = await nc.request(REDIS_SUBJECT, key.encode(), timeout=60)
    dt = time.perf_counter() - t
    if int(reply.data) != payload.nbytes:
        raise RuntimeError("redis GET returned the wrong size")
    await r.delete(key)
    return dt


async def _redis_pipelined_once(nc: Any, r: Any, payload: memoryview, key: str, chunk: int, per: int) -> float:
    """The payload in ``chunk``-byte pieces, SET in pipelines of ``per``; the receiver GETs them likewise."""
    pieces = [payload[lo : lo + chunk] for lo in range(0, payload.nbytes, chunk)]
    keys = [f"{key}:{i}" for i in range(len(pieces))]
    t = time.perf_counter()
    for lo in range(0, len(pieces), per):
        async with r.pipeline(transaction=False) as pipe:
            for k, piece in zip(keys[lo : lo + per], pieces[lo : lo + per]):
                pipe.set(k, piece)
            await pipe.execute()
    reply = await nc.request(REDIS_CHUNKED_SUBJECT, f"{key}|{len(pieces)}|{per}".encode(), timeout=60)
    dt = time.perf_counter() - t
    if int(reply.data) != payload.nbytes:
        raise RuntimeError("pipelined redis GETs returned the wrong size")
    await r.delete(*keys)
    return dt


async def _run(quick: bool, nats_url: str | None, smoke: bool = False) -> dict[str, Any]:
    cfg = BusConfig.from_env()
    chunk_size, window, ack_every = cfg.chunk_size, cfg.window, cfg.ack_every
    sizes = {"64MB": 64 * 1024 * 1024, "1MB": 1024 * 1024}
    reps = {"64MB": 1, "1MB": 2} if smoke else {"64MB": 3 if quick else 7, "1MB": 10 if quick else 30}
    if not (quick or smoke):
        # A 4096-token Llama-3-8B cache: every way once more at the size of a long context.
        sizes["512MB"], reps["512MB"] = LARGE_BYTES, 5
    nats_srv = None if nats_url else NatsServer().start()
    url = nats_url or nats_srv.url  # type: ignore[union-attr]
    redis_srv = RedisServer().start()
    procs: list[subprocess.Popen[bytes]] = []
    sink = OtlpSink()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "KVBUS_METRICS_PORT"}
        traced_env = {
            **env,
            "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "KVBUS_METRICS_PORT": "0",
            "KVBUS_BENCH_TRACED": "1",
        }
        peers = []
        for group, penv in ((GROUP, env), (TRACED_GROUP, traced_env)):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "kvbus.app.cli", "group-scheduler", "--group", group, "--nats-url", url],
                    env=penv,
                    stdout=subprocess.DEVNULL,
                )
            )
            peer = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvbus.app.bench.transport",
                    "--peer",
                    url,
                    redis_srv.url,
                    str(chunk_size),
                    str(window),
                    str(ack_every),
                ],
                stdout=subprocess.PIPE,
                env=penv,
            )
            procs.append(peer)
            peers.append(peer)
        ports = []
        for peer in peers:
            assert peer.stdout is not None
            line = await asyncio.to_thread(peer.stdout.readline)
            if b"ready" not in line:
                raise RuntimeError("benchmark peer did not start")
            ports.append(int(line.split()[1]))
        sockets = tp.SocketLoop(ports[0])
        # This process traces too; off for every way but the traced one.
        telemetry.setup("kvbus-bench", environ=traced_env)
        telemetry.set_enabled(False)
        bus = await Bus.connect(url, config=cfg)
        agent = await bus.agent("bench-tx", group=GROUP, signature=LLAMA3_8B)
        traced_agent = await bus.agent(TRACED_TX, group=TRACED_GROUP, signature=LLAMA3_8B)
        small_agent = await bus.agent(SMALL_TX, group=GROUP, signature=SMOLLM2)
        # The same sends restricted to tcp, and to NATS only (each bus is one process's data plane).
        path_buses = {
            path: await Bus.connect(url, config=cfg, paths=PathsConfig(allowed=allowed, tcp_host="127.0.0.1"))
            for path, allowed in tp.PATH_BUSES.items()
            if path != "shm"
        }
        path_agents = {"shm": agent}
        for path, b in path_buses.items():
            path_agents[path] = await b.agent(f"bench-tx-{path}", group=GROUP, signature=LLAMA3_8B)
        nc = await nats.connect(url, pending_size=64 * 1024 * 1024)
        r = aioredis.Redis.from_url(redis_srv.url, socket_timeout=REDIS_TIMEOUT_S)
        results: dict[str, Any] = {}
        for label, nbytes in sizes.items():
            # Seconds of tensor work at 512 MB (more on a loaded machine): in a thread, so that
            # this process's agents keep probing their schedulers meanwhile.
            kv, payload, chunks, src, dst = await asyncio.to_thread(_prepare, nbytes, min(chunk_size, bus.chunk_size))
            small = nbytes <= cfg.inline_limit
            # The same context built in place by its producer (`Agent.kv_buffer`): sent on shm
            # with no copy (the fill is the producer's work, not the transfer's).
            built = None if small else await asyncio.to_thread(_built_in_place, agent, kv)

            # Warm up every way twice (connections, first-touch allocations: each receiver keeps
            # its last shm segment mapped as its delta base, so a sender's first two segments of a
            # size are fresh, and a fresh 512 MB one faults its pages in for about half a second).
            warm: dict[str, list[float]] = collections.defaultdict(list)
            first: list[float] = []
            first_built: list[float] = []
            for _ in range(1 if smoke else 2):
                first.append(await _kvbus_once(agent, kv))
                if built is not None:
                    first_built.append(await _kvbus_once(agent, built))
                await _nats_baseline(nc, payload, small, chunks, window)
                await _path_ways(warm, path_agents, kv, sockets, payload, (src, dst))
                await _redis_once(nc, r, payload, "kvbus-bench")
                for cs, per in REDIS_PIPELINED.values():
                    await _redis_pipelined_once(nc, r, payload, "kvbus-bench-p", cs, per)
                await _traced_once(traced_agent, kv)
            times: dict[str, list[float]] = collections.defaultdict(list)
            for i in range(reps[label]):
                # Traced and untraced runs back to back, in turn first (what ran before a run,
                # a 64 MB Redis GET say, must not favour one of them).
                if i % 2:
                    times["kvbus_traced"].append(await _traced_once(traced_agent, kv))
                times["kvbus"].append(await _kvbus_once(agent, kv))
                if built is not None:
                    times["kvbus_zero_copy"].append(await _kvbus_once(agent, built))
                if not i % 2:
                    times["kvbus_traced"].append(await _traced_once(traced_agent, kv))
                times["nats_py"].append(await _nats_baseline(nc, payload, small, chunks, window))
                times["redis"].append(await _redis_once(nc, r, payload, "kvbus-bench"))
                for name, (cs, per) in REDIS_PIPELINED.items():
                    times[f"redis_pipelined_{name}"].append(
                        await _redis_pipelined_once(nc, r, payload, "kvbus-bench-p", cs, per)
                    )
                await _path_ways(times, path_agents, kv, sockets, payload, (src, dst))
            round_trips, picked = await tp.count_round_trips(agent, "bench-rx", kv)
            times["kvbus_shm"] = times["kvbus"]
            medians = {k: statistics.median(v) for k, v in times.items()}
            mbps = {k: kv.nbytes / statistics.median(v) / 1e6 for k, v in times.items()}
            best_pipe = max(REDIS_PIPELINED, key=lambda k: mbps[f"redis_pipelined_{k}"])
            mbps["redis_pipelined"] = mbps[f"redis_pipelined_{best_pipe}"]
            # Per run (kvbus and the pipelined loop ran back to back): the ratio's spread.
            per_run = [b / a for a, b in zip(times["kvbus"], times[f"redis_pipelined_{best_pipe}"])]
            results[label] = {
                "bytes": kv.nbytes,
                "kvbus_MBps": round(mbps["kvbus"], 1),
                "nats_py_MBps": round(mbps["nats_py"], 1),
                "redis_MBps": round(mbps["redis"], 1),
                "ratio_vs_nats_py": round(mbps["kvbus"] / mbps["nats_py"], 3),
                "kvbus_ms": round(medians["kvbus"] * 1e3, 3),
                "nats_py_ms": round(medians["nats_py"] * 1e3, 3),
                "ratio_vs_redis": round(mbps["kvbus"] / mbps["redis"], 3),
                "redis_pipelined_MBps": round(mbps["redis_pipelined"], 1),
                "redis_pipelined_loop": best_pipe,
                "redis_pipelined_by_loop_MBps": {k: round(mbps[f"redis_pipelined_{k}"], 1) for k in REDIS_PIPELINED},
                "ratio_vs_redis_pipelined": round(mbps["kvbus"] / mbps["redis_pipelined"], 3),
                "ratio_vs_redis_pipelined_runs": spread(per_run, digits=3),
                "ratio_vs_nats_py_runs": spread((b / a for a, b in zip(times["kvbus"], times["nats_py"])), digits=3),
                "kvbus_traced_MBps": round(mbps["kvbus_traced"], 1),
                "tracing_overhead": round(mbps["kvbus_traced"] / mbps["kvbus"], 3),
                # This process's first send of the size (a fresh segment; at 64 MB also the first
                # to the receiver: its path not known yet, so not staged) against the steady ones.
                "first_transfer_ms": round(first[0] * 1e3, 3),
                "first_transfer_vs_steady": round(medians["kvbus"] / first[0], 3),
                **(
                    {
                        "first_transfer_zero_copy_ms": round(first_built[0] * 1e3, 3),
                        "first_transfer_zero_copy_vs_steady": round(medians["kvbus_zero_copy"] / first_built[0], 3),
                        "zero_copy_vs_copying": round(medians["kvbus"] / medians["kvbus_zero_copy"], 3),
                        "zero_copy_vs_copying_runs": spread(
                            (a / b for a, b in zip(times["kvbus"], times["kvbus_zero_copy"])), digits=3
                        ),
                    }
                    if built is not None
                    else {}
                ),
                "runs": reps[label],
                "chunks": len(chunks),
                "path": picked,
                "round_trips": round_trips,
                "nats_py_baseline": "request/reply" if small else "publish loop with credit",
                **tp.path_results(kv.nbytes, medians),
            }
        results[SMALL_LABEL] = await _small_size(small_agent, nc, reps["1MB"], warm=1 if smoke else 2)
        await bus.close()
        for b in path_buses.values():
            await b.close()
        sockets.close()
        await nc.close()
        await r.aclose()
        telemetry.set_enabled(True)
        await asyncio.to_thread(telemetry.shutdown)  # flush this process's spans to the sink
        # The peers flush their spans as they stop: stop them before the sink, so that their
        # last exports are counted, and do not fail and retry against a closed port.
        await asyncio.to_thread(_stop, procs)
        sink.close()
        top = results["64MB"]
        return {
            "suite": "transport",
            "config": {
                "network": "loopback",
                "chunk_size": chunk_size,
                "window": window,
                "ack_every": ack_every,
                "redis_baselines": {
                    "redis": "one SET of the whole payload, then one GET (the naive loop)",
                    "redis_pipelined": "chunked SETs in pipelines, then chunked GETs in "
                    "pipelines; the faster of "
                    + ", ".join(
                        f"{k} ({c >> 20} MB chunks, {n} per pipeline)" for k, (c, n) in REDIS_PIPELINED.items()
                    ),
                },
                "runs": reps,
                "sizes": {**sizes, SMALL_LABEL: SMALL_BYTES},
                "kv_shape": "llama-3-8b (32 layers, 8 kv heads, head_dim 128, bf16)",
                "timing": "median of alternating runs, two processes, embedded nats-server and valkey",
            },
            "results": {
                "ratio_vs_nats_py": top["ratio_vs_nats_py"],
                "ratio_vs_redis": top["ratio_vs_redis"],
                "ratio_vs_redis_pipelined": top["ratio_vs_redis_pipelined"],
                "redis_pipelined_MBps": top["redis_pipelined_MBps"],
                "kvbus_MBps": top["kvbus_MBps"],
                "nats_py_MBps": top["nats_py_MBps"],
                "redis_MBps": top["redis_MBps"],
                "tracing_overhead": top["tracing_overhead"],
                "tracing_overhead_1MB": results["1MB"]["tracing_overhead"],
                "otlp_exports": {"requests": sink.requests, "bytes": sink.bytes},
                "shm_ratio_vs_nats_py": top["shm_ratio_vs_nats_py"],
                "tcp_ratio_vs_nats_py": top["tcp_ratio_vs_nats_py"],
                "nats_path_ratio_vs_nats_py": top["nats_path_ratio_vs_nats_py"],
                "tcp_vs_loopback_limit": top["tcp_vs_loopback_limit"],
                "shm_vs_memcpy": top["shm_vs_memcpy"],
                "shm_copying_vs_memcpy": top["shm_copying_vs_memcpy"],
                "zero_copy_vs_copying": top.get("zero_copy_vs_copying"),
                "first_transfer_vs_steady": top["first_transfer_vs_steady"],
                "first_transfer_zero_copy_vs_steady": top.get("first_transfer_zero_copy_vs_steady"),
                "path": top["path"],
                "GBps": {k[:-5]: v for k, v in top.items() if k.endswith("_GBps")},
                "round_trips_1MB": results["1MB"]["round_trips"],
                "round_trips_64KB": results[SMALL_LABEL]["round_trips"],
                "by_size": results,
            },
        }
    finally:
        _stop(procs)
        telemetry.set_enabled(True)
        sink.close()
        redis_srv.stop()
        if nats_srv:
            nats_srv.stop()


async def _small_size(agent: Any, nc: Any, runs: int, *, warm: int) -> dict[str, Any]:
    """The small size: a `SMOLLM2` context of about 64 KB (three tokens) against a plain nats-py
    request/reply carrying its bytes, in alternating runs (only these two ways: at this size the
    others measure their own per-call costs)."""
    kv = await asyncio.to_thread(make_kv, SMALL_BYTES, SMOLLM2)
    payload = torch.cat([t.reshape(-1) for t in kv.keys + kv.values]).view(torch.uint8).numpy().data
    for _ in range(warm):
        await _kvbus_once(agent, kv, SMALL_RX)
        await tp.reqrep_once(nc, payload)
    times: dict[str, list[float]] = collections.defaultdict(list)
    for i in range(runs):
        # In turn first: what ran before a run must not favour one of them.
        for way in ("kvbus", "nats_py") if i % 2 == 0 else ("nats_py", "kvbus"):
            if way == "kvbus":
                times[way].append(await _kvbus_once(agent, kv, SMALL_RX))
            else:
                times[way].append(await tp.reqrep_once(nc, payload))
    round_trips, picked = await tp.count_round_trips(agent, SMALL_RX, kv)
    mbps = {k: kv.nbytes / statistics.median(v) / 1e6 for k, v in times.items()}
    return {
        "bytes": kv.nbytes,
        "kv_shape": "smollm2-135m (30 layers, 3 kv heads, head_dim 64, bf16), 3 tokens",
        "kvbus_MBps": round(mbps["kvbus"], 1),
        "nats_py_MBps": round(mbps["nats_py"], 1),
        "kvbus_ms": round(statistics.median(times["kvbus"]) * 1e3, 3),
        "nats_py_ms": round(statistics.median(times["nats_py"]) * 1e3, 3),
        "ratio_vs_nats_py": round(mbps["kvbus"] / mbps["nats_py"], 3),
        "ratio_vs_nats_py_runs": spread((b / a for a, b in zip(times["kvbus"], times["nats_py"])), digits=3),
        "runs": runs,
        "path": picked,
        "round_trips": round_trips,
        "nats_py_baseline": "request/reply",
    }


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate the bench's processes and wait for each (5 s, then kill); again is a no-op."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _prepare(nbytes: int, chunk_size: int) -> tuple[KVCache, memoryview, list[memoryview], torch.Tensor, torch.Tensor]:
    """The KV of one size, its bytes, the chunks the plain loop sends (exactly the messages kvbus
    sends: the same chunk plan over the same bytes), and the two buffers of the memcpy way."""
    kv = make_kv(nbytes)
    encoded = get_codec("full").encode(kv)
    payload = torch.cat([t.reshape(-1) for t in kv.keys + kv.values]).view(torch.uint8).numpy().data
    plan = ChunkPlan(encoded.sizes, chunk_size)
    flat = memoryview(b"".join(encoded.buffers))
    chunks = [flat[lo:hi] for lo, hi in plan.ranges]
    src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return kv, payload, chunks, src, torch.empty_like(src)


def _built_in_place(agent: Any, kv: KVCache) -> KVCache:
    """``kv`` copied into a cache of ``agent.kv_buffer``, as a producer that built it there would hold it."""
    built: KVCache = agent.kv_buffer(kv.n_tokens)
    built.tokens.copy_(kv.tokens)
    for dst, src in zip((*built.keys, *built.values), (*kv.keys, *kv.values)):
        dst.copy_(src)
    return built


async def _nats_baseline(nc: Any, payload: memoryview, small: bool, chunks: list[memoryview], window: int) -> float:
    """The plain nats-py figure: one request carrying a small payload, else the credit loop."""
    return await (tp.reqrep_once(nc, payload) if small else _nats_once(nc, chunks, window))


async def _path_ways(
    times: dict[str, list[float]],
    agents: dict[str, Any],
    kv: KVCache,
    sockets: tp.SocketLoop,
    payload: memoryview,
    copy: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """One round of the data-path ways: the bus restricted to tcp and to NATS, the socket loop, memcpy."""
    for path, agent in agents.items():
        if path != "shm":
            times[f"kvbus_{path}"].append(await _kvbus_once(agent, kv))
    times["socket"].append(await sockets.once(payload))
    # In a thread (timed there): a 512 MB copy holds the event loop, and the agents' probes, for a while.
    times["memcpy"].append(await asyncio.to_thread(tp.memcpy_once, *copy))


async def _traced_once(agent: Any, kv: KVCache) -> float:
    """One kvbus run with this process's tracing and metrics on (its peers have them on too)."""
    telemetry.set_enabled(True)
    try:
        return await _kvbus_once(agent, kv, TRACED_RX)
    finally:
        telemetry.set_enabled(False)


def run(*, quick: bool = False, smoke: bool = False, nats_url: str | None = None, **_: Any) -> dict[str, Any]:
    """Run the suite (``smoke``: one timed run per size)."""
    out = asyncio.run(_run(quick, nats_url, smoke))
    for label, row in out["results"]["by_size"].items():
        if "redis_MBps" not in row:  # the small size: kvbus against a nats-py request/reply only
            print(
                f"{label:>5}: kvbus {row['kvbus_ms']:.2f} ms  nats-py request/reply {row['nats_py_ms']:.2f} ms  "
                f"kvbus/nats-py {row['ratio_vs_nats_py']:.2f}  round_trips {row['round_trips']}  path {row['path']}"
            )
            continue
        print(
            f"{label:>5}: kvbus {row['kvbus_MBps']:8.1f} MB/s  nats-py {row['nats_py_MBps']:8.1f} MB/s  "
            f"redis {row['redis_MBps']:8.1f} MB/s  redis pipelined {row['redis_pipelined_MBps']:8.1f} MB/s  "
            f"kvbus/nats-py {row['ratio_vs_nats_py']:.2f}  kvbus/redis {row['ratio_vs_redis']:.2f}  "
            f"kvbus/redis pipelined {row['ratio_vs_redis_pipelined']:.2f}  traced/untraced "
            f"{row['tracing_overhead']:.3f}"
        )
        keys: tuple[str, ...] = ("shm_ratio_vs_nats_py", "tcp_ratio_vs_nats_py", "nats_path_ratio_vs_nats_py")
        keys += ("tcp_vs_loopback_limit", "shm_vs_memcpy", "shm_copying_vs_memcpy", "round_trips")
        print(
            f"       path {row['path']}  "
            + "  ".join(f"{k[:-5]} {v:.2f}" for k, v in row.items() if k.endswith("_GBps"))
            + " GB/s  "
            + "  ".join(f"{k} {row[k]}" for k in keys)
        )
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer", nargs=5, metavar=("NATS", "REDIS", "CHUNK", "WINDOW", "ACK_EVERY"))
    parser.add_argument("--sink", action="store_true", help="run the OTLP sink")
    ns = parser.parse_args()
    if ns.sink:
        _sink()
    elif ns.peer:
        url, rurl, cs, w, ae = ns.peer
        telemetry.setup("kvbus-bench-peer")  # on when the OTEL_* variables say so (the traced peer)
        try:
            asyncio.run(_peer(url, rurl, int(cs), int(w), int(ae)))
        except KeyboardInterrupt:
            pass
