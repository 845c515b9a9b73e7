"""The agents of `kvbus bench chaos`: receiving and sending OS processes the bench kills with
SIGKILL, the transport wrapper that damages chunks, and a hostile peer that forges them.

    python -m kvbus.app.bench.chaos_agents receiver URL NAME [--die-after-delivery P] [--seed S]
    python -m kvbus.app.bench.chaos_agents sender URL NAME [--p-drop P] [--p-corrupt P] [--p-forge P] [--p-dup P]

Both print JSON lines on stdout, ``{"event": "ready"}`` first. A receiver prints
``{"event": "accepted", "rx", "tid", "incarnation", "attempt", ...}`` when its bus records a
transfer as done (verified and decoded; the verdict goes out next) and
``{"event": "delivered", "rx", "tid", "sender", "digest"}`` the moment the delivery enters its
inbox (before its final ack goes out for a small context; just after it for a large one, whose
delta-base copy is made first); with ``--die-after-delivery`` it then exits at once with that
probability (exit code `DIED_AFTER_DELIVERY`): a receiver that dies between delivery and its
final ack. On stdin, ``restart <seconds>`` closes its agent and opens it again (a graceful
leave). A sender reads ``send <k> <rx> <j>`` lines and sends pool context ``j`` to ``rx``,
several at a time, printing ``{"event": "ok" | "error" | "crash", "k", "tid", ...}`` per send
(an ``error`` names the error's type and, for a `TransferInDoubt`, the type of its ``cause``:
`error_fields`) and ``{"event": "fault", "kind"}`` per chunk its transport dropped, corrupted, forged or duplicated.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import hashlib
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvbus.bus import Bus, BusConfig, TransferError, TransferInDoubt
from kvbus.bus.chunking import ChunkPlan, chunk_digest, tree_digest
from kvbus.errors import WireFormatError
from kvbus.kvcache import KVCache
from kvbus.net.transport import TransportWrapper
from kvbus.protocol import CHUNK_INDEX_HEADER, CHUNK_SUM_HEADER, ROOT_SUM_HEADER, Open
from kvbus.signature import ModelSignature

SIG = ModelSignature("chaos-model", n_layers=4, n_kv_heads=4, head_dim=64, dtype="bfloat16", vocab_size=32000)
GROUP = "chaos"
#: The bus settings of both chaos suites (this one and `kvbus.app.bench.chaos_cluster`): short
#: timeouts, so that a fault is repaired or reported well within a run.
BASE_CONFIG = BusConfig(
    chunk_size=256 * 1024,
    ack_timeout=0.3,
    peer_timeout=3.0,
    request_timeout=1.0,
    grant_timeout=15.0,
    partial_timeout=3.0,
    regrant_interval=0.3,
    inline_limit=64 * 1024,
)
#: This suite's: credit for 4 chunks, so a 3 MB stream waits for acks, which gives the forger its chance.
CONFIG = dataclasses.replace(BASE_CONFIG, window=4)
#: Exit code of a receiver that died (on purpose) between a delivery and its final ack.
DIED_AFTER_DELIVERY = 86
#: Contexts every process builds alike: (bytes, seed).
POOL_SPEC = [((16 << 10, 200 << 10, 1 << 20, 3 << 20)[s % 4], s) for s in range(16)]


def make_kv(nbytes: int, seed: int) -> KVCache:
    """A random context of about ``nbytes`` of KV (deterministic in ``seed``)."""
    n_tokens = max(1, nbytes // SIG.kv_bytes_per_token())
    g = torch.Generator().manual_seed(seed)
    shape = (1, SIG.n_kv_heads, n_tokens, SIG.head_dim)
    keys = [torch.randn(shape, generator=g).to(SIG.torch_dtype) for _ in range(SIG.n_layers)]
    values = [torch.randn(shape, generator=g).to(SIG.torch_dtype) for _ in range(SIG.n_layers)]
    return KVCache(torch.randint(0, SIG.vocab_size, (1, n_tokens), generator=g), SIG, keys, values)


def kv_digest(kv: KVCache) -> str:
    """A blake2b digest of a context's tokens and every key and value byte."""
    h = hashlib.blake2b(digest_size=16)
    h.update(kv.tokens.contiguous().numpy().tobytes())
    for t in (*kv.keys, *kv.values):
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def build_pool() -> list[KVCache]:
    """The contexts senders pick from (the same in every process)."""
    return [make_kv(n, seed) for n, seed in POOL_SPEC]


class ChaosTransport(TransportWrapper):
    """Wraps a sender's transport: drops, corrupts, forges (bytes changed, own checksum made to
    match) or duplicates chunk messages at random; ``on_fault`` hears of each."""

    def __init__(
        self,
        inner: Any,
        rng: random.Random,
        *,
        p_drop: float,
        p_corrupt: float,
        p_forge: float,
        p_dup: float = 0.0,
        on_fault: Any = None,
    ) -> None:
        self.inner, self.rng = inner, rng
        self.p_drop, self.p_corrupt, self.p_forge, self.p_dup = p_drop, p_corrupt, p_forge, p_dup
        self.counts: collections.Counter[str] = collections.Counter()
        self.on_fault = on_fault

    def _count(self, kind: str) -> None:
        self.counts[kind] += 1
        if self.on_fault is not None:
            self.on_fault(kind)

    def fault(self) -> str | None:
        """Roll the dice for one chunk: ``dropped``, ``corrupted``, ``forged``,
        ``duplicated_chunks`` (counted), or None for no fault."""
        roll = self.rng.random()
        edges = [("dropped", self.p_drop), ("corrupted", self.p_corrupt), ("forged", self.p_forge)]
        edges.append(("duplicated_chunks", self.p_dup))
        for kind, p in edges:
            if roll < p:
                self._count(kind)
                return kind
            roll -= p
        return None

    def damaged(self, data: bytes | bytearray | memoryview) -> bytes:
        """``data`` with one byte changed."""
        out = bytearray(data)
        out[self.rng.randrange(len(out))] ^= 0x5A
        return bytes(out)

    async def publish(self, subject: str, payload: Any, headers: dict[str, str] | None = None) -> None:
        """Publish, unless the dice say to drop, damage or repeat a chunk."""
        if headers and CHUNK_INDEX_HEADER in headers:
            kind = self.fault()
            if kind == "dropped":
                return
            if kind in ("corrupted", "forged"):
                payload = self.damaged(payload)
                if kind == "forged":
                    headers = {**headers, CHUNK_SUM_HEADER: chunk_digest(payload)}
            elif kind == "duplicated_chunks":
                await self.inner.publish(subject, payload, headers)
        await self.inner.publish(subject, payload, headers)


def damage_tcp(chaos: ChaosTransport) -> None:
    """The same damage, at the same odds, on the direct ``tcp`` path (which bypasses the NATS
    transport): a chunk's frame is dropped (the receiver sees the gap), its bytes corrupted
    under the announced digest, forged (bytes changed, the frame's digest made to match: only the
    `Open`'s digests tell), or sent twice. (``shm`` is left alone: its bytes are the sender's own
    segment, and damaging them would damage every resend too.)"""
    from kvbus.bus.paths.base import chunk_digest as path_digest
    from kvbus.bus.paths.tcp import TcpSendSession

    original = TcpSendSession.send_chunk

    async def send_chunk(
        self: TcpSendSession, index: int, pieces: Sequence[memoryview], digest: str, *, root: str = ""
    ) -> None:
        kind = chaos.fault()
        if kind == "dropped":
            return
        if kind in ("corrupted", "forged"):
            data = chaos.damaged(b"".join(pieces))
            if kind == "forged":
                digest = path_digest(data)
            pieces = [memoryview(data)]
        elif kind == "duplicated_chunks":
            await original(self, index, pieces, digest, root=root)
        await original(self, index, pieces, digest, root=root)

    TcpSendSession.send_chunk = send_chunk  # type: ignore[method-assign,assignment]


class Forger:
    """A hostile peer on the same (non-secure) server: it watches other agents' Opens and chunks
    and, for some streamed transfers, once it has seen the sender's first window of chunks (the
    receiver has those), sends the receiver every later chunk before the sender may: random
    bytes, each with its own checksum right, the last with a whole-payload digest made over the
    real digests it saw and its own. A receiver that takes that digest from a chunk delivers the
    forgery.

    Args:
        transport: its own connection.
        rng: the dice.
        p_forge: the share of streamed transfers it attacks.
    """

    def __init__(self, transport: Any, rng: random.Random, p_forge: float) -> None:
        self.transport, self.rng, self.p_forge = transport, rng, p_forge
        self.forged: set[str] = set()
        """Transfer ids it sent a forged stream for."""
        self.chunks = 0
        """Forged chunks it sent."""
        self._plans: dict[str, tuple[Open, ChunkPlan, dict[int, str], dict[int, tuple[bytes, str]]]] = {}
        self._subs: list[Any] = []

    async def start(self) -> None:
        """Watch every inbox and data subject."""
        self._subs = [
            await self.transport.subscribe("kvbus.agent.*.inbox.*", self._on_open),
            await self.transport.subscribe("kvbus.agent.*.data.>", self._on_chunk),
        ]

    async def stop(self) -> None:
        """Stop watching."""
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - the server may be down at that moment
                pass

    async def _on_open(self, msg: Any) -> None:
        try:
            open_msg, _ = Open.unframe(msg.data)
        except WireFormatError:
            return
        tid = open_msg.transfer_id
        if open_msg.inline or tid in self._plans or tid in self.forged or self.rng.random() >= self.p_forge:
            return
        plan = ChunkPlan(open_msg.sizes, open_msg.chunk_size)
        if plan.n_chunks > open_msg.window:  # the sender must wait for credit: there is room to get ahead
            # Made now, so that they go out the moment the first window has passed.
            forged = {}
            for index in range(open_msg.window, plan.n_chunks):
                start, end = plan.ranges[index]
                pattern = bytes(self.rng.randrange(256) for _ in range(64))
                data = (pattern * ((end - start) // 64 + 1))[: end - start]
                forged[index] = (data, chunk_digest(data))
            self._plans[tid] = (open_msg, plan, {}, forged)
        while len(self._plans) > 256:
            del self._plans[next(iter(self._plans))]

    async def _on_chunk(self, msg: Any) -> None:
        tid = msg.subject.rsplit(".", 1)[-1]
        entry = self._plans.get(tid)
        headers = msg.headers or {}
        if entry is None:
            return
        open_msg, plan, seen, forged = entry
        try:
            seen[int(headers[CHUNK_INDEX_HEADER])] = headers[CHUNK_SUM_HEADER]
        except (KeyError, ValueError):
            return
        if len(seen) < open_msg.window or not all(i in seen for i in range(open_msg.window)):
            return
        del self._plans[tid]
        self.forged.add(tid)
        digests = [seen[i] if i < open_msg.window else forged[i][1] for i in range(plan.n_chunks)]
        last = plan.n_chunks - 1
        root = tree_digest(digests, plan.total)
        for index, (data, digest) in forged.items():
            hdrs = {CHUNK_INDEX_HEADER: str(index), CHUNK_SUM_HEADER: digest}
            if index == last:
                hdrs[ROOT_SUM_HEADER] = root
            await self.transport.publish(open_msg.data_subject, data, headers=hdrs)
            self.chunks += 1


# -- the processes ---------------------------------------------------------------------------------------------


def _emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


async def _lines() -> Any:
    """stdin, line by line, without blocking the event loop."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = await reader.readline()
        if not line:
            return
        yield line.decode().split()


async def _receiver(args: argparse.Namespace) -> None:
    from kvbus.bus.inbox import Inbox
    from kvbus.bus.receiver import Receiver

    rng = random.Random(args.seed)
    put = Inbox.put
    decode = Receiver._decode
    record = Receiver._deliver
    opens: dict[str, tuple[int, str, float]] = {}

    async def decoding(self: Receiver, open_msg: Open, buffers: Any, transfer_s: float, **kw: Any) -> Any:
        opens[open_msg.transfer_id] = (open_msg.attempt, open_msg.incarnation, open_msg.retry_age)
        return await decode(self, open_msg, buffers, transfer_s, **kw)

    def recording(self: Receiver, delivery: Any, **kw: Any) -> None:
        attempt, inc, age = opens.pop(delivery.transfer_id, (-1, "", 0.0))
        _emit(
            "accepted",
            rx=args.name,
            tid=delivery.transfer_id,
            incarnation=self.incarnation,
            attempt=attempt,
            open_incarnation=inc,
            retry_age=round(age, 3),
            uptime=round(time.monotonic() - self.started, 3),
            pid=os.getpid(),
        )
        record(self, delivery, **kw)

    def deliver(self: Inbox, delivery: Any) -> None:
        put(self, delivery)
        _emit(
            "delivered", rx=args.name, tid=delivery.transfer_id, sender=delivery.sender, digest=kv_digest(delivery.kv)
        )
        if rng.random() < args.die_after_delivery:
            _emit("dying", tid=delivery.transfer_id)
            os._exit(DIED_AFTER_DELIVERY)  # after the delivery, before its final ack

    Inbox.put = deliver  # type: ignore[method-assign]
    Receiver._decode = decoding  # type: ignore[method-assign]
    Receiver._deliver = recording  # type: ignore[method-assign]
    bus = await Bus.connect(args.url, config=CONFIG)
    agent = await bus.agent(args.name, group=GROUP, signature=SIG)

    async def drain() -> None:
        while True:
            await agent.receive()

    drainer = asyncio.create_task(drain())
    _emit("ready")
    async for words in _lines():
        if words[:1] == ["restart"]:
            drainer.cancel()
            await agent.close()
            await asyncio.sleep(float(words[1]))
            agent = await bus.agent(args.name, group=GROUP, signature=SIG)
            drainer = asyncio.create_task(drain())
            _emit("restarted")
        elif words[:1] == ["quit"]:
            break
    drainer.cancel()
    await bus.close()


async def _sender(args: argparse.Namespace) -> None:
    pool = build_pool()
    bus = await Bus.connect(args.url, config=CONFIG)
    tx = await bus.agent(args.name, group=GROUP, signature=SIG)
    chaos = ChaosTransport(
        tx.transport,
        random.Random(args.seed),
        p_drop=args.p_drop,
        p_corrupt=args.p_corrupt,
        p_forge=args.p_forge,
        p_dup=args.p_dup,
        on_fault=lambda kind: _emit("fault", kind=kind),
    )
    tx.transport = chaos  # a wrapper: what it does not define goes to the inner transport
    damage_tcp(chaos)
    running: set[asyncio.Task[None]] = set()

    async def one(k: int, rx: str, j: int) -> None:
        try:
            report = await tx.send(rx, pool[j], medium="full")
            _emit("ok", k=k, tid=report.transfer_id, path=",".join(report.paths))
        except TransferError as exc:
            _emit("error", k=k, tid=exc.transfer_id, text=str(exc)[:200], **error_fields(exc))
        except Exception as exc:  # noqa: BLE001 - reported: the goal is none
            _emit("crash", k=k, error=f"{type(exc).__name__}: {exc}"[:300])

    _emit("ready")
    async for words in _lines():
        if words[:1] == ["send"]:
            task = asyncio.create_task(one(int(words[1]), words[2], int(words[3])))
            running.add(task)
            task.add_done_callback(running.discard)
        elif words[:1] == ["quit"]:
            break
    if running:
        await asyncio.wait(running)
    await bus.close()


def error_fields(exc: TransferError) -> dict[str, str]:
    """How a sender reports a failed send: ``error``, the error's type, and ``cause``, the type of
    the failure a `TransferInDoubt` wraps ("" for a plain `TransferError`: nothing can have arrived)."""
    cause = type(exc.cause).__name__ if isinstance(exc, TransferInDoubt) else ""
    return {"error": type(exc).__name__, "cause": cause}


def main(argv: list[str] | None = None) -> None:
    """Run one chaos agent (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m kvbus.app.bench.chaos_agents")
    parser.add_argument("role", choices=["receiver", "sender"])
    parser.add_argument("url")
    parser.add_argument("name")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--die-after-delivery", type=float, default=0.0)
    parser.add_argument("--p-drop", type=float, default=0.0)
    parser.add_argument("--p-corrupt", type=float, default=0.0)
    parser.add_argument("--p-forge", type=float, default=0.0)
    parser.add_argument("--p-dup", type=float, default=0.0)
    args = parser.parse_args(argv)
    asyncio.run(_receiver(args) if args.role == "receiver" else _sender(args))


if __name__ == "__main__":
    main()
