"""Where `kvbus bench select` sends its contexts: a pair of agents in this process on emulated links,
or on the testbed, a sender on host ``tx`` and a receiver on host ``rx`` (each a worker process
with its own SmolLM2) behind a real htb-shaped link.

On the testbed the cell's link is the receiver's veth, set by ``tc`` before the cell; no agent
declares a link, so the scheduler (a worker on host ``core``) knows the link only from the
transfers it sees, and the sender is paced by nothing but the kernel's queue and TCP.
Both kinds of pair offer the same three calls: ``once`` (one send of a fresh context of ``n``
tokens, waited on until the receiver has it), ``set_link`` and ``close``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

from kvbus.app.testbed import ops
from kvbus.app.testbed.benchnet import BenchNet
from kvbus.app.testbed.topology import Topology, one_rack
from kvbus.app.testbed.worker import Worker, WorkerContext
from kvbus.bus import EmulatedLink
from kvbus.kvcache import KVCache

if TYPE_CHECKING:
    from kvbus.app.bench.select import Harness

OPS = "kvbus.app.bench.select_net"
GROUP = "select"
#: Latency of an emulated link per round trip (the testbed's links have their own).
EMULATED_LATENCY_MS = 0.5
#: How long a receiver waits for one context (a tokens transfer of 2048 tokens prefills on a busy CPU).
RECEIVE_TIMEOUT_S = 600.0


def topology() -> Topology:
    """One rack: ``core`` (nats-server, the scheduler), ``tx`` (senders), ``rx`` (receivers; its link
    is the cell's)."""
    return one_rack("select", {"core": 10000, "tx": 10000, "rx": 1000}, nats="core")


def shifted(kv: KVCache, shift: int) -> KVCache:
    """``kv`` with its token ids shifted by ``shift`` over the same tensors: a context the receiver
    holds no prefix of, so delta media cannot make a repeated send look free."""
    return dataclasses.replace(kv, tokens=(kv.tokens + shift) % kv.signature.vocab_size)


class Pair(Protocol):
    """A sender and a receiver of one cell."""

    last_decision: dict[str, Any]
    """The scheduler's decision record of the last `once`, with the sender's measured phases."""
    last_path: str
    """The data path the last `once` took."""
    last_phases_s: dict[str, float]
    """Its phases as the sender's report gives them (queued, encode, transfer, decode)."""

    async def once(self, n: int, shift: int, medium: str | None) -> tuple[float, str, int]:
        """Send the ``n``-token context with token ids shifted by ``shift``; (latency, medium, bytes)."""

    async def set_link(self, mbit: float) -> None:
        """The link between them is now ``mbit``."""

    async def close(self) -> None:
        """Close both agents."""


class LocalPair:
    """Two agents of the harness's buses; the sender paced by an `EmulatedLink`."""

    def __init__(self, h: Harness, tx: Any, rx: Any) -> None:
        self.h, self.tx, self.rx = h, tx, rx
        self.last_decision: dict[str, Any] = {}
        self.last_path = ""
        self.last_phases_s: dict[str, float] = {}

    async def once(self, n: int, shift: int, medium: str | None) -> tuple[float, str, int]:
        """`Pair.once` in this process."""
        report = await self.tx.send(self.rx.name, shifted(self.h.quality.context(n), shift), medium=medium)
        await self.rx.receive(timeout=RECEIVE_TIMEOUT_S)
        self.last_decision = dict(report.decision or {})
        self.last_path = report.path
        self.last_phases_s = _phases(report)
        return report.total_s, report.medium, report.nbytes

    async def set_link(self, mbit: float) -> None:
        """The sender's emulated link is now ``mbit`` (its pacing and what it declares)."""
        await self.tx.set_link(EmulatedLink.mbit(mbit, EMULATED_LATENCY_MS))

    async def close(self) -> None:
        """Close both agents."""
        await self.tx.close()
        await self.rx.close()


class TestbedPair:
    """A sender in the worker on ``tx``, a receiver in the worker on ``rx``; the link is ``host:rx``."""

    __test__ = False  # not a pytest class

    def __init__(self, site: TestbedSite, tx: str, rx: str) -> None:
        self.site, self.tx, self.rx = site, tx, rx
        self.last_decision: dict[str, Any] = {}
        self.last_path = ""
        self.last_phases_s: dict[str, float] = {}

    async def once(self, n: int, shift: int, medium: str | None) -> tuple[float, str, int]:
        """`Pair.once` across the testbed: the receive is asked for before the send starts."""
        recv = asyncio.ensure_future(self.site.rx.call(f"{OPS}:receive", receiver=self.rx, wait_s=RECEIVE_TIMEOUT_S))
        try:
            sent = await self.site.tx.call(f"{OPS}:send", sender=self.tx, to=self.rx, n=n, shift=shift, medium=medium)
            await recv
        finally:
            if not recv.done():
                recv.cancel()
        self.site.paths.append(sent["path"])
        self.last_decision = dict(sent.get("decision") or {})
        self.last_path = str(sent["path"])
        self.last_phases_s = dict(sent["phases_s"])
        return float(sent["total_s"]), str(sent["medium"]), int(sent["nbytes"])

    async def set_link(self, mbit: float) -> None:
        """``tc`` changes rx's veth to ``mbit`` (nothing tells the agents)."""
        self.site.net.set_link("host:rx", rate_mbit=float(mbit))

    async def close(self) -> None:
        """Close both agents in their workers."""
        await asyncio.gather(
            self.site.tx.call("kvbus.app.testbed.ops:close_agent", name=self.tx),
            self.site.rx.call("kvbus.app.testbed.ops:close_agent", name=self.rx),
        )


@dataclasses.dataclass
class TestbedSite:
    """The select bench's processes on the testbed: the scheduler on ``core``, a SmolLM2 worker on
    ``tx`` and one on ``rx``."""

    __test__ = False  # not a pytest class

    net: BenchNet
    core: Worker
    tx: Worker
    rx: Worker
    bus_config: dict[str, Any]
    paths: list[str] = dataclasses.field(default_factory=list)
    """The data path of every transfer sent here (``tcp`` between two hosts, unless it fell back)."""
    n: int = 0

    @classmethod
    async def start(cls, net: BenchNet, media: list[str], bus_config: dict[str, Any]) -> TestbedSite:
        """Start the workers, the scheduler and the models (the codecs warmed up in each worker)."""
        core, tx, rx = await asyncio.gather(
            net.worker("core", "select-core"), net.worker("tx", "select-tx"), net.worker("rx", "select-rx")
        )
        await core.call("kvbus.app.testbed.ops:scheduler_start", url=net.url("core"), group=GROUP)
        await asyncio.gather(tx.call(f"{OPS}:prepare", media=media), rx.call(f"{OPS}:prepare", media=media))
        return cls(net, core, tx, rx, bus_config)

    async def pair(self, mbit: float) -> TestbedPair:
        """Two fresh agents (no estimate of their link yet) across ``host:rx`` set to ``mbit``."""
        self.n += 1
        self.net.set_link("host:rx", rate_mbit=float(mbit))
        tx, rx = f"sel-tx{self.n}", f"sel-rx{self.n}"
        await asyncio.gather(
            self.tx.call(f"{OPS}:open_agent", url=self.net.url("tx"), name=tx, bus_config=self.bus_config),
            self.rx.call(f"{OPS}:open_agent", url=self.net.url("rx"), name=rx, bus_config=self.bus_config),
        )
        return TestbedPair(self, tx, rx)

    async def close(self) -> None:
        """Stop the scheduler (the net closes the workers)."""
        await self.core.call("kvbus.app.testbed.ops:scheduler_stop", group=GROUP)


# ---- worker operations (in the processes on tx and rx) ----


async def _model(ctx: WorkerContext) -> tuple[Any, Any]:
    if "smollm2" not in ctx.state:
        from kvbus.app.models import load_smollm2

        ctx.state["smollm2"] = await asyncio.to_thread(load_smollm2)
    return ctx.state["smollm2"]  # type: ignore[no-any-return]


async def prepare(ctx: WorkerContext, *, media: list[str]) -> None:
    """Load SmolLM2 and run each codec once (first calls pay one-time costs that no cell should)."""
    from kvbus.app.bench.select_quality import heldout_ids
    from kvbus.codecs import get_codec

    runner, tokenizer = await _model(ctx)
    ctx.state["ids"] = heldout_ids(tokenizer)

    def warm() -> None:
        kv = runner.prefill(ctx.state["ids"][:, :64])
        for m in media:
            codec = get_codec(m)
            if codec.needs_kv:
                codec.decode(codec.encode(kv, runner=runner), runner=runner)

    await asyncio.to_thread(warm)


async def open_agent(ctx: WorkerContext, *, url: str, name: str, bus_config: dict[str, Any]) -> str:
    """Register agent ``name`` (with this worker's SmolLM2, no declared link) in group ``select``."""
    runner, _ = await _model(ctx)
    b = await ops.bus(ctx, url, "select", bus_config)
    ctx.state.setdefault("agents", {})[name] = await b.agent(name, group=GROUP, runner=runner)
    return name


async def _context(ctx: WorkerContext, n: int) -> Any:
    """The first ``n`` tokens of the held-out text, prefilled here (as the driver's `Quality` does)."""
    contexts: dict[int, Any] = ctx.state.setdefault("contexts", {})
    if n not in contexts:
        runner, _ = await _model(ctx)
        contexts[n] = await asyncio.to_thread(runner.prefill, ctx.state["ids"][:, :n])
    return contexts[n]


async def send(ctx: WorkerContext, *, sender: str, to: str, n: int, shift: int, medium: str | None) -> dict[str, Any]:
    """Send the ``n``-token context with its token ids shifted by ``shift`` (a context the receiver
    holds no prefix of); the report's figures."""
    report = await ops.get_agent(ctx, sender).send(to, shifted(await _context(ctx, n), shift), medium=medium)
    return {
        "total_s": report.total_s,
        "medium": report.medium,
        "nbytes": report.nbytes,
        "path": report.path,
        "decision": report.decision,
        "phases_s": _phases(report),
    }


def _phases(report: Any) -> dict[str, float]:
    """A transfer report's phases, seconds: queued (to the grant), encode, transfer, and the
    slowest receiver's decode (its prefill for ``tokens``)."""
    return {
        "queued": report.queued_s,
        "encode": report.encode_s,
        "transfer": report.transfer_s,
        "decode": max(dict(report.decode_s).values(), default=0.0),
    }


async def receive(ctx: WorkerContext, *, receiver: str, wait_s: float) -> int:
    """Wait up to ``wait_s`` for one context; its length."""
    d = await ops.get_agent(ctx, receiver).receive(timeout=wait_s)
    return int(d.kv.n_tokens)
