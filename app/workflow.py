"""A small multi-agent workflow on kvbus, the engine behind `kvbus demo` (and an example).

A coordinator agent decomposes a task, executor agents work on its parts, a verifier checks
them, and the coordinator aggregates; every round the shared context grows. All the
communication patterns occur: point-to-point (the plan to each executor, verifier ->
coordinator, coordinator -> archivist), gather (executors -> verifier) and broadcast (the
coordinator shares each round's outcome with its own group). Agents sit in groups with
different emulated links, and the archivist runs a different model, so for it only token media
are possible.

Each agent really generates with its model; the same workflow runs once per policy (adaptive,
or a static medium forced on every transfer) with the same prompts, so the runs can be compared
token by token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbus.bus import Bus, BusConfig, EmulatedLink
from kvbus.kvcache import KVCache


@dataclass(frozen=True)
class AgentSpec:
    """One agent of the workflow."""

    name: str
    role: str
    group: str
    priority: float
    runner: Any
    link: EmulatedLink | None = None


@dataclass
class TransferRecord:
    """One transfer as the report shows it."""

    round: int
    src: str
    dst: tuple[str, ...]
    medium: str
    nbytes: int
    context_bytes: int
    tokens: int
    start_s: float
    end_s: float
    decode_s: float

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class RunResult:
    """What one policy's run produced."""

    policy: str
    e2e_s: float = 0.0
    transfers: list[TransferRecord] = field(default_factory=list)
    outputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """Per agent, the tokens it generated at each step."""
    peak_kv_bytes: int = 0
    """Largest total of KV bytes the agents held at once."""
    recompute_s: float = 0.0


class Workflow:
    """Coordinator -> executors -> verifier -> coordinator, for a number of rounds."""

    def __init__(
        self,
        agents: list[AgentSpec],
        tasks: list[str],
        encode: Callable[[str], torch.Tensor],
        *,
        new_tokens: int = 24,
        bus_config: BusConfig | None = None,
        preamble: str = "You coordinate a small team. Keep every step short and concrete.\n",
        nats_options: dict[str, Any] | None = None,
    ) -> None:
        self.specs = {a.role if a.role != "executor" else a.name: a for a in agents}
        self.coordinator = next(a for a in agents if a.role == "coordinator")
        self.executors = [a for a in agents if a.role == "executor"]
        self.verifier = next(a for a in agents if a.role == "verifier")
        self.archivist = next((a for a in agents if a.role == "archivist"), None)
        self.tasks = tasks
        self.encode = encode
        self.new_tokens = new_tokens
        self.preamble = preamble
        self.bus_config = bus_config or BusConfig(peer_timeout=120, grant_timeout=300, request_timeout=30)
        self.nats_options = dict(nats_options or {})
        """`nats.connect` options (identity, TLS) for the workflow's bus connection."""

    async def run(self, nats_url: str, policy: str, *, progress: Callable[[str], None] | None = None) -> RunResult:
        """Run every round over the bus with ``policy`` (``adaptive`` or a medium forced on every transfer)."""
        bus = await Bus.connect(nats_url, config=self.bus_config, **self.nats_options)
        try:
            channel = await BusChannel.open(bus, self, policy)
            return await self._rounds(channel, policy, progress)
        finally:
            await bus.close()

    async def reference(self) -> RunResult:
        """The same rounds in one process with contexts handed over as objects: the ground truth."""
        return await self._rounds(LocalChannel(), "reference", None)

    async def _rounds(self, channel: Channel, policy: str, progress: Callable[[str], None] | None) -> RunResult:
        result = RunResult(policy)
        say = progress or (lambda _msg: None)
        t0 = time.perf_counter()
        channel.start(result, t0)
        held: dict[str, int] = {}

        def hold(agent: str, kv: KVCache) -> None:
            held[agent] = kv.nbytes if kv.has_kv else 0
            result.peak_kv_bytes = max(result.peak_kv_bytes, sum(held.values()))

        def out(agent: str, tokens: torch.Tensor) -> None:
            result.outputs.setdefault(agent, []).append(tokens)

        coord, verifier = self.coordinator, self.verifier
        history = self.encode(self.preamble)
        ctx: KVCache | None = None
        for r, task in enumerate(self.tasks):
            say(f"round {r + 1}/{len(self.tasks)}: coordinator plans")
            prompt = torch.cat([history, self.encode(f"\nTask: {task}\nPlan in {len(self.executors)} parts:")], dim=-1)
            ctx = await asyncio.to_thread(_extend, coord.runner, ctx, prompt, self.new_tokens)
            out(coord.name, ctx.tokens[:, -self.new_tokens :])
            hold(coord.name, ctx)
            say(f"round {r + 1}: the plan goes to {len(self.executors)} executors")
            plans = await asyncio.gather(*(channel.transfer(r, coord.name, [e.name], ctx) for e in self.executors))
            results: list[KVCache] = []
            for i, (ex, got) in enumerate(zip(self.executors, plans)):
                mine_ctx = got[ex.name]
                ask = torch.cat([mine_ctx.tokens, self.encode(f"\nExecutor {i + 1}, do part {i + 1}:")], dim=-1)
                say(f"round {r + 1}: executor {i + 1} works")
                mine = await asyncio.to_thread(_extend, ex.runner, mine_ctx, ask, self.new_tokens)
                out(ex.name, mine.tokens[:, -self.new_tokens :])
                hold(ex.name, mine)
                results.append(mine)
            say(f"round {r + 1}: executors -> verifier (gather)")
            gathered = await asyncio.gather(
                *(channel.transfer(r, ex.name, [verifier.name], kv) for ex, kv in zip(self.executors, results))
            )
            # The verifier reads the last executor's context and checks it.
            last = gathered[-1][verifier.name]
            hold(verifier.name, last)
            check = torch.cat([last.tokens, self.encode("\nVerifier: is the work correct? Answer:")], dim=-1)
            say(f"round {r + 1}: verifier checks")
            verdict = await asyncio.to_thread(_extend, verifier.runner, last, check, self.new_tokens)
            out(verifier.name, verdict.tokens[:, -self.new_tokens :])
            say(f"round {r + 1}: verdict -> coordinator")
            ctx = (await channel.transfer(r, verifier.name, [coord.name], verdict))[coord.name]
            hold(coord.name, ctx)
            history = ctx.tokens
            team = [a.name for a in [verifier, *self.executors] if a.group == coord.group]
            if len(team) > 1:
                say(f"round {r + 1}: coordinator broadcasts the outcome to its group")
                shared = await channel.transfer(r, coord.name, team, ctx)
                for name, kv in shared.items():
                    hold(name, kv)
            if self.archivist is not None:
                arch = self.archivist
                say(f"round {r + 1}: coordinator -> archivist (a different model)")
                got = (await channel.transfer(r, coord.name, [arch.name], ctx, foreign=True))[arch.name]
                note = torch.cat([got.tokens, self.encode("\nArchive note:")], dim=-1)
                kept = await asyncio.to_thread(_extend, arch.runner, got, note, 4)
                out(arch.name, kept.tokens[:, -4:])
                hold(arch.name, kept)
        result.e2e_s = time.perf_counter() - t0
        return result


class Channel:
    """How contexts move between the workflow's agents."""

    result: RunResult
    t0: float

    def start(self, result: RunResult, t0: float) -> None:
        self.result, self.t0 = result, t0

    async def transfer(
        self, round_: int, src: str, dst: list[str], kv: KVCache, *, foreign: bool = False
    ) -> dict[str, KVCache]:
        """Move ``kv`` from ``src`` to every agent of ``dst``; return what each one has."""
        raise NotImplementedError


class LocalChannel(Channel):
    """Hands the object over: no bus, no codec (the reference run)."""

    async def transfer(
        self, round_: int, src: str, dst: list[str], kv: KVCache, *, foreign: bool = False
    ) -> dict[str, KVCache]:
        return {d: kv.token_only() if foreign else kv for d in dst}


class BusChannel(Channel):
    """Real transfers on kvbus, one `send`/`broadcast` each, with a record per transfer."""

    def __init__(self, agents: dict[str, Any], medium: str | None) -> None:
        self.agents = agents
        self.medium = medium

    @classmethod
    async def open(cls, bus: Bus, flow: Workflow, policy: str) -> BusChannel:
        tag = policy.replace("(", "").replace(")", "").replace("+", "-").replace(".", "")
        agents = {}
        specs = [flow.coordinator, *flow.executors, flow.verifier, *([flow.archivist] if flow.archivist else [])]
        for spec in specs:
            agents[spec.name] = await bus.agent(
                f"{spec.name}-{tag}",
                group=spec.group,
                role=spec.role,
                priority=spec.priority,
                runner=spec.runner,
                link=spec.link,
            )
        return cls(agents, None if policy == "adaptive" else policy)

    async def transfer(
        self, round_: int, src: str, dst: list[str], kv: KVCache, *, foreign: bool = False
    ) -> dict[str, KVCache]:
        sender = self.agents[src]
        receivers = [self.agents[d] for d in dst]
        start = time.perf_counter() - self.t0
        # A static policy still cannot send KV to a different model: it falls back to tokens there.
        medium = "tokens" if foreign and self.medium is not None else self.medium
        if len(receivers) == 1:
            report = await sender.send(receivers[0].name, kv, medium=medium)
        else:
            report = await sender.broadcast([r.name for r in receivers], kv, medium=medium)
        got = {d: (await r.gather([sender.name], timeout=300))[sender.name].kv for d, r in zip(dst, receivers)}
        self.result.transfers.append(
            TransferRecord(
                round_,
                src,
                tuple(dst),
                report.medium,
                report.nbytes,
                kv.nbytes,
                kv.n_tokens,
                start,
                time.perf_counter() - self.t0,
                max(report.decode_s.values(), default=0.0),
            )
        )
        if report.medium in ("tokens", "summary") or report.medium.startswith("summary"):
            self.result.recompute_s += sum(report.decode_s.values())
        return got


def _extend(runner: Any, kv: KVCache | None, tokens: torch.Tensor, n: int) -> KVCache:
    """The context ``tokens`` (reusing ``kv``'s KV for its prefix) continued by ``n`` greedy tokens."""
    base = kv if kv is not None and kv.has_kv and _is_prefix(kv.tokens, tokens) else None
    ctx = (
        KVCache(
            tokens,
            runner.signature,
            base.keys if base else [],
            base.values if base else [],
            fidelity=base.fidelity if base else 1.0,
        )
        if base is not None
        else KVCache(tokens, runner.signature)
    )
    return runner.continue_context(ctx, n)


def _is_prefix(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape[-1] <= b.shape[-1] and bool(torch.equal(a[..., :], b[..., : a.shape[-1]]))
