"""The demo workflow with every agent in its own process on its own host (`RemoteTeam`), and the
worker operations those processes run (``wf_*``).

Each agent process loads its model once and, for every run, registers a fresh agent (the name
carries the policy and the round, so nothing learnt in one run carries into another). Contexts
stay in the process that holds them; the driver only sends token ids and handles over the
workers' pipes, and every context moves between agents over the network through kvbus.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvbus.app.testbed.benchnet import BenchNet
from kvbus.app.testbed.worker import Worker, WorkerContext
from kvbus.app.workflow import Mailbox, Moved, SentLog, Team, TransferRecord, extend_context, policy_tag, recompute_of
from kvbus.kvcache import KVCache

logger = logging.getLogger(__name__)

OPS = "kvbus.app.workflow_remote"
ARCHIVIST = "archivist-random-4x2x32"


def archivist_model(vocab_size: int) -> Any:
    """The archivist's model: random weights, another shape than SmolLM2 (only tokens reach it)."""
    from kvbus.app.models import random_model

    return random_model(n_layers=4, n_kv_heads=2, head_dim=32, vocab_size=vocab_size, name=ARCHIVIST)


def small_model(vocab_size: int) -> Any:
    """A tiny random model for smoke runs."""
    from kvbus.app.models import random_model

    return random_model(n_layers=2, n_kv_heads=2, head_dim=16, vocab_size=vocab_size, name="small-random-2x2x16")


@dataclass(frozen=True, slots=True)
class Placement:
    """One agent of the remote team: where it runs and what it declares."""

    name: str
    role: str
    group: str
    priority: float
    host: str
    model: str = "smollm2"
    """``smollm2``, ``archivist`` (a random model of another shape: only tokens reach it) or
    ``small`` (a tiny random model, for smoke runs)."""
    link_bps: float = 0.0
    """The capacity of its path to the server, declared to its scheduler (0 = none)."""


class RemoteTeam(Team):
    """Agents in worker processes on ``net``'s hosts (see the module docstring)."""

    def __init__(self, net: BenchNet, placements: list[Placement], workers: dict[str, Worker]) -> None:
        self.net = net
        self.placements = {p.name: p for p in placements}
        self.workers = workers
        self.names: dict[str, str] = {}
        self.medium: str | None = None
        self.prefill: list[dict[str, Any]] = []
        """Per ``tokens`` delivery: receiver, tokens, seconds (the receiver's real prefill speed)."""

    @classmethod
    async def start(cls, net: BenchNet, placements: list[Placement], *, vocab_size: int) -> RemoteTeam:
        """One worker per agent on its host, each loading its model (in turn, to keep memory peaks low)."""
        workers = await asyncio.gather(*(net.worker(p.host, f"agent-{p.name}") for p in placements))
        by_name = dict(zip((p.name for p in placements), workers))
        for p in placements:
            await by_name[p.name].call(f"{OPS}:wf_load", model=p.model, vocab_size=vocab_size, timeout=600)
        return cls(net, placements, by_name)

    async def begin(self, policy: str, round_: int) -> None:
        """Before a run: fresh agents for ``policy``."""
        tag = f"{policy_tag(policy)}-r{round_}"
        self.names = {n: f"{n}-{tag}" for n in self.placements}
        self.medium = None if policy == "adaptive" else policy
        await asyncio.gather(
            *(
                self.workers[n].call(
                    f"{OPS}:wf_join",
                    url=self.net.url(p.host),
                    name=self.names[n],
                    group=p.group,
                    role=p.role,
                    priority=p.priority,
                    link_bps=p.link_bps,
                )
                for n, p in self.placements.items()
            )
        )

    async def end(self) -> None:
        """After a run: close its agents."""
        await asyncio.gather(*(w.call(f"{OPS}:wf_leave") for w in self.workers.values()))

    async def seed(self, agent: str, handle: str, tokens: torch.Tensor) -> None:
        """Give ``agent`` a token-only context ``handle``."""
        await self.workers[agent].call(f"{OPS}:wf_seed", handle=handle, tokens=tokens.tolist())

    async def extend(self, agent: str, src: str, tokens: torch.Tensor, n: int, dst: str) -> tuple[torch.Tensor, int]:
        """``agent`` continues context ``src`` + ``tokens`` by ``n`` tokens into ``dst``."""
        got = await self.workers[agent].call(f"{OPS}:wf_extend", src=src, tokens=tokens.tolist(), n=n, dst=dst)
        return torch.tensor(got["tokens"], dtype=torch.int64), int(got["nbytes"])

    async def transfer(
        self, round_: int, src: str, handle: str, dst: list[str], dst_handle: str, *, foreign: bool = False
    ) -> Moved:
        """Move ``src``'s context ``handle`` to ``dst`` (stored as ``dst_handle``)."""
        medium = "tokens" if foreign and self.medium is not None else self.medium
        start = time.perf_counter() - self.t0
        receiving = [
            self.workers[d].submit(f"{OPS}:wf_receive", sender=self.names[src], handle=dst_handle) for d in dst
        ]
        report = await self.workers[src].call(
            f"{OPS}:wf_send", to=[self.names[d] for d in dst], handle=handle, medium=medium
        )
        got = await asyncio.gather(*receiving)
        end = time.perf_counter() - self.t0
        decode = {str(k): float(v) for k, v in report["decode_s"].items()}
        if report["medium"] == "tokens":
            for d, g in zip(dst, got):
                self.prefill.append({"agent": d, "tokens": report["tokens"], "seconds": g["decode_s"]})
        record = TransferRecord(
            round_,
            src,
            tuple(dst),
            report["medium"],
            int(report["nbytes"]),
            int(report["context_bytes"]),
            int(report["tokens"]),
            start,
            end,
            max(decode.values(), default=0.0),
            dict(report.get("decision") or {}),
        )
        return Moved(record, {d: int(g["nbytes"]) for d, g in zip(dst, got)}, recompute_of(report["medium"], decode))


# -- the agent processes' operations ----------------------------------------------------------------


async def wf_load(ctx: WorkerContext, *, model: str, vocab_size: int) -> dict[str, Any]:
    """Load this agent's model (SmolLM2, or the archivist's random model) and warm it up."""
    from kvbus.app.models import load_smollm2

    if model == "smollm2":
        runner, _ = await asyncio.to_thread(load_smollm2)
    elif model == "archivist":
        runner = await asyncio.to_thread(archivist_model, vocab_size)
    elif model == "small":  # smoke runs: a tiny random model with SmolLM2's vocabulary
        runner = await asyncio.to_thread(small_model, vocab_size)
    else:
        raise ValueError(f"model {model!r} must be smollm2, archivist or small")
    await asyncio.to_thread(runner.prefill, torch.tensor([[1, 2, 3]]))
    ctx.state["runner"] = runner
    return {"model": runner.signature.model}


async def wf_join(
    ctx: WorkerContext, *, url: str, name: str, group: str, role: str, priority: float, link_bps: float
) -> str:
    """Register this process's agent for one run (a fresh name, empty contexts)."""
    from kvbus.bus import Bus, BusConfig, EmulatedLink

    if "bus" not in ctx.state:
        ctx.state["bus"] = await Bus.connect(
            url, config=BusConfig(peer_timeout=120.0, grant_timeout=300.0, request_timeout=30.0)
        )
        ctx.on_close(ctx.state["bus"].close)
    link = EmulatedLink(link_bps, 0.0) if link_bps else None
    ctx.state["agent"] = await ctx.state["bus"].agent(
        name, group=group, role=role, priority=priority, runner=ctx.state["runner"], link=link
    )
    ctx.state["ctx"] = {}
    ctx.state["sent"] = SentLog()
    ctx.state["mail"] = Mailbox(ctx.state["agent"])
    return name


async def wf_leave(ctx: WorkerContext) -> None:
    """Close the run's agent and drop its contexts."""
    agent = ctx.state.pop("agent", None)
    ctx.state["ctx"] = {}
    mail = ctx.state.pop("mail", None)
    if mail is not None:
        await mail.close()
    if agent is not None:
        await agent.close()


async def wf_seed(ctx: WorkerContext, *, handle: str, tokens: list[list[int]]) -> None:
    """A token-only context ``handle``."""
    ctx.state["ctx"][handle] = KVCache(torch.tensor(tokens, dtype=torch.int64), ctx.state["runner"].signature)


async def wf_extend(ctx: WorkerContext, *, src: str, tokens: list[list[int]], n: int, dst: str) -> dict[str, Any]:
    """Continue context ``src`` + ``tokens`` by ``n`` greedy tokens into ``dst``."""
    base: KVCache = ctx.state["ctx"][src]
    prompt = torch.cat([base.tokens, torch.tensor(tokens, dtype=torch.int64)], dim=-1)
    t = time.perf_counter()
    out = await asyncio.to_thread(extend_context, ctx.state["runner"], base, prompt, n)
    ctx.state["ctx"][dst] = out
    return {
        "tokens": out.tokens[:, -n:].tolist(),
        "nbytes": out.nbytes if out.has_kv else 0,
        "seconds": time.perf_counter() - t,
    }


async def wf_send(ctx: WorkerContext, *, to: list[str], handle: str, medium: str | None) -> dict[str, Any]:
    """Send context ``handle`` to ``to`` (one receiver: `send`, more: `broadcast`)."""
    agent = ctx.state["agent"]
    kv: KVCache = ctx.state["ctx"][handle]
    log: SentLog = ctx.state["sent"]
    medium = log.medium(medium, to, kv)
    report = await (agent.send(to[0], kv, medium=medium) if len(to) == 1 else agent.broadcast(to, kv, medium=medium))
    log.delivered(to, kv)
    return {
        "medium": report.medium,
        "nbytes": report.nbytes,
        "context_bytes": kv.nbytes,
        "tokens": kv.n_tokens,
        "decode_s": dict(report.decode_s),
        "total_s": report.total_s,
        "decision": report.decision,
    }


async def wf_receive(ctx: WorkerContext, *, sender: str, handle: str, timeout: float = 300.0) -> dict[str, Any]:
    """Wait for the context from ``sender``; keep it as ``handle``."""
    got = await ctx.state["mail"].get(sender, timeout)
    ctx.state["ctx"][handle] = got.kv
    return {"nbytes": got.kv.nbytes if got.kv.has_kv else 0, "decode_s": got.decode_s, "medium": got.medium}
