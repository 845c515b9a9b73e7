"""A small multi-agent workflow on kvbus, the engine behind `kvbus demo` (and an example).

A coordinator agent decomposes a task, executor agents work on its parts, a verifier checks
them, and the coordinator aggregates; every round the shared context grows. All four
communication patterns occur: broadcast (plan -> executors), point-to-point (coordinator ->
archivist, verifier -> coordinator), and gather (executors -> verifier). Agents sit in two groups
with different emulated links, and the archivist runs a different model, so for it only token
media are possible.

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

    def __init__(self, agents: list[AgentSpec], tasks: list[str], encode: Callable[[str], torch.Tensor], *,
                 new_tokens: int = 24, bus_config: BusConfig | None = None) -> None:
        self.specs = {a.role if a.role != "executor" else a.name: a for a in agents}
        self.coordinator = next(a for a in agents if a.role == "coordinator")
        self.executors = [a for a in agents if a.role == "executor"]
        self.verifier = next(a for a in agents if a.role == "verifier")
        self.archivist = next((a for a in agents if a.role == "archivist"), None)
        self.tasks = tasks
        self.encode = encode
        self.new_tokens = new_tokens
        self.bus_config = bus_config or BusConfig(peer_timeout=120, grant_timeout=300, request_timeout=30)

    async def run(self, nats_url: str, policy: str, *, progress: Callable[[str], None] | None = None) -> RunResult:
        """Run every round with ``policy`` (``adaptive`` or a medium forced on every transfer)."""
        medium = None if policy == "adaptive" else policy
        result = RunResult(policy)
        say = progress or (lambda _msg: None)
        bus = await Bus.connect(nats_url, config=self.bus_config)
        t0 = time.perf_counter()
        held: dict[str, int] = {}

        def hold(agent: str, kv: KVCache) -> None:
            held[agent] = kv.nbytes if kv.has_kv else 0
            result.peak_kv_bytes = max(result.peak_kv_bytes, sum(held.values()))

        def out(agent: str, tokens: torch.Tensor) -> None:
            result.outputs.setdefault(agent, []).append(tokens)

        async def send(round_: int, agent: Any, to: list[str], kv: KVCache, *, foreign: bool = False) -> None:
            start = time.perf_counter() - t0
            # A static policy still cannot send KV to a different model: it falls back to tokens there.
            use = "tokens" if foreign and medium is not None else medium
            if len(to) == 1:
                report = await agent.send(to[0], kv, medium=use)
            else:
                report = await agent.broadcast(to, kv, medium=use)
            result.transfers.append(TransferRecord(
                round_, agent.name, tuple(to), report.medium, report.nbytes, kv.nbytes, kv.n_tokens, start,
                time.perf_counter() - t0, max(report.decode_s.values(), default=0.0)))
            result.recompute_s += sum(report.decode_s.values()) if report.medium in ("tokens", "summary") else 0.0

        try:
            tag = f"{policy.replace('(', '').replace(')', '').replace('+', '-').replace('.', '')}"
            live = {}
            for spec in [self.coordinator, *self.executors, self.verifier, *([self.archivist] if self.archivist else [])]:
                live[spec.name] = await bus.agent(f"{spec.name}-{tag}", group=spec.group, role=spec.role,
                                                  priority=spec.priority, runner=spec.runner, link=spec.link)
            coord = live[self.coordinator.name]
            verifier = live[self.verifier.name]
            executors = [live[e.name] for e in self.executors]
            history = self.encode("You coordinate a small team. Keep every step short and concrete.\n")
            ctx: KVCache | None = None
            for r, task in enumerate(self.tasks):
                say(f"round {r + 1}/{len(self.tasks)}: coordinator plans")
                prompt = torch.cat([history, self.encode(f"\nTask: {task}\nPlan in {len(executors)} parts:")], dim=-1)
                ctx = await asyncio.to_thread(_extend, self.coordinator.runner, ctx, prompt, self.new_tokens)
                out(coord.name, ctx.tokens[:, -self.new_tokens:])
                hold(coord.name, ctx)
                say(f"round {r + 1}: broadcast the plan to {len(executors)} executors")
                await send(r, coord, [e.name for e in executors], ctx)
                results: list[KVCache] = []
                for i, ex in enumerate(executors):
                    d = await ex.receive(timeout=300)
                    ask = torch.cat([d.kv.tokens, self.encode(f"\nExecutor {i + 1}, do part {i + 1}:")], dim=-1)
                    say(f"round {r + 1}: executor {i + 1} works")
                    mine = await asyncio.to_thread(_extend, self.executors[i].runner, d.kv, ask, self.new_tokens)
                    out(ex.name, mine.tokens[:, -self.new_tokens:])
                    hold(ex.name, mine)
                    results.append(mine)
                say(f"round {r + 1}: executors -> verifier (gather)")
                await asyncio.gather(*(send(r, ex, [verifier.name], kv) for ex, kv in zip(executors, results)))
                got = await verifier.gather([e.name for e in executors], timeout=300)
                # The verifier reads the last executor's full context and checks it.
                last = got[executors[-1].name].kv
                hold(verifier.name, last)
                check = torch.cat([last.tokens, self.encode("\nVerifier: is the work correct? Answer:")], dim=-1)
                say(f"round {r + 1}: verifier checks")
                verdict = await asyncio.to_thread(_extend, self.verifier.runner, last, check, self.new_tokens)
                out(verifier.name, verdict.tokens[:, -self.new_tokens:])
                say(f"round {r + 1}: verdict -> coordinator")
                await send(r, verifier, [coord.name], verdict)
                back = await coord.receive(timeout=300)
                ctx = back.kv
                hold(coord.name, ctx)
                history = ctx.tokens
                if self.archivist is not None:
                    arch = live[self.archivist.name]
                    say(f"round {r + 1}: coordinator -> archivist (a different model)")
                    await send(r, coord, [arch.name], ctx, foreign=True)
                    d = await arch.receive(timeout=300)
                    note = torch.cat([d.kv.tokens, self.encode("\nArchive note:")], dim=-1)
                    kept = await asyncio.to_thread(_extend, self.archivist.runner, d.kv, note, 8)
                    out(arch.name, kept.tokens[:, -8:])
                    hold(arch.name, kept)
            result.e2e_s = time.perf_counter() - t0
            return result
        finally:
            await bus.close()


def _extend(runner: Any, kv: KVCache | None, tokens: torch.Tensor, n: int) -> KVCache:
    """The context ``tokens`` (reusing ``kv``'s KV for its prefix) continued by ``n`` greedy tokens."""
    base = kv if kv is not None and kv.has_kv and _is_prefix(kv.tokens, tokens) else None
    ctx = KVCache(tokens, runner.signature, base.keys if base else [], base.values if base else [],
                  fidelity=base.fidelity if base else 1.0) if base is not None else KVCache(tokens, runner.signature)
    return runner.continue_context(ctx, n)


def _is_prefix(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape[-1] <= b.shape[-1] and bool(torch.equal(a[..., :], b[..., : a.shape[-1]]))
