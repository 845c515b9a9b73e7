"""A small multi-agent workflow on kvbus, the engine behind `kvbus demo` (and an example).

A coordinator agent decomposes a task, executor agents work on its parts, a verifier checks
them, and the coordinator aggregates; every round the shared context grows. All the
communication patterns occur: point-to-point (the plan to each executor, verifier ->
coordinator, coordinator -> archivist), gather (executors -> verifier) and broadcast (the
coordinator shares each round's outcome with its own group). The archivist runs a different
model, so for it only token media are possible.

Each agent really generates with its model; the same workflow runs once per policy (adaptive,
or a static medium forced on every transfer) with the same prompts, so the runs can be compared
token by token. Where the agents live is a `Team`: all in this process on one bus connection
(`BusTeam`, with emulated links), handed over as objects (`LocalTeam`, the reference), or each
in its own process on its own testbed host (`kvbus.app.workflow_remote.RemoteTeam`).
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbus.bus import Bus, BusConfig, EmulatedLink
from kvbus.codecs.spec import medium_spec
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
    decision: dict[str, Any] = field(default_factory=dict)
    """The scheduler's decision record (candidates with predicted cost terms), when it made one."""

    @property
    def latency_s(self) -> float:
        """From the send to the last receiver having the context."""
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
    round: int = 0
    """Which interleaved round of the comparison this run was."""


@dataclass(frozen=True, slots=True)
class Moved:
    """What a `Team.transfer` did: the record (None for a hand-over) and the KV bytes each receiver holds."""

    record: TransferRecord | None
    held: dict[str, int]
    recompute_s: float = 0.0


class Team(ABC):
    """Where the workflow's agents are and how contexts move between them. Contexts stay with the
    agent that holds them, named by a handle (``plan``, ``work``, ...)."""

    t0: float = 0.0

    async def begin(self, policy: str, round_: int) -> None:  # noqa: B027 - optional hook
        """Before a run: fresh agents for ``policy``."""

    async def end(self) -> None:  # noqa: B027 - optional hook
        """After a run."""

    @abstractmethod
    async def seed(self, agent: str, handle: str, tokens: torch.Tensor) -> None:
        """Give ``agent`` a token-only context ``handle``."""

    @abstractmethod
    async def extend(self, agent: str, src: str, tokens: torch.Tensor, n: int, dst: str) -> tuple[torch.Tensor, int]:
        """``agent`` continues its context ``src`` + ``tokens`` by ``n`` greedy tokens into ``dst``;
        returns the generated tokens and the KV bytes ``dst`` holds."""

    @abstractmethod
    async def transfer(
        self, round_: int, src: str, handle: str, dst: list[str], dst_handle: str, *, foreign: bool = False
    ) -> Moved:
        """Move ``src``'s context ``handle`` to every agent of ``dst`` (stored there as ``dst_handle``)."""


class LocalTeam(Team):
    """Every agent in this process; contexts are handed over as objects (the reference run)."""

    def __init__(self, specs: dict[str, AgentSpec]) -> None:
        self.specs = specs
        self.ctx: dict[tuple[str, str], KVCache] = {}

    async def begin(self, policy: str, round_: int) -> None:
        """Before a run: fresh agents for ``policy``."""
        self.ctx.clear()

    async def seed(self, agent: str, handle: str, tokens: torch.Tensor) -> None:
        """Give ``agent`` a token-only context ``handle``."""
        self.ctx[(agent, handle)] = KVCache(tokens, self.specs[agent].runner.signature)

    async def extend(self, agent: str, src: str, tokens: torch.Tensor, n: int, dst: str) -> tuple[torch.Tensor, int]:
        """``agent`` continues context ``src`` + ``tokens`` by ``n`` tokens into ``dst``."""
        base = self.ctx[(agent, src)]
        out = await asyncio.to_thread(
            extend_context, self.specs[agent].runner, base, torch.cat([base.tokens, tokens], dim=-1), n
        )
        self.ctx[(agent, dst)] = out
        return out.tokens[:, -n:], out.nbytes if out.has_kv else 0

    async def transfer(
        self, round_: int, src: str, handle: str, dst: list[str], dst_handle: str, *, foreign: bool = False
    ) -> Moved:
        """Move ``src``'s context ``handle`` to ``dst`` (stored as ``dst_handle``)."""
        kv = self.ctx[(src, handle)]
        for d in dst:
            self.ctx[(d, dst_handle)] = kv.token_only() if foreign else kv
        return Moved(None, {d: (0 if foreign or not kv.has_kv else kv.nbytes) for d in dst})


class BusTeam(LocalTeam):
    """Every agent in this process on one bus connection; real transfers, one `send`/`broadcast` each."""

    def __init__(self, specs: dict[str, AgentSpec], bus: Bus) -> None:
        super().__init__(specs)
        self.bus = bus
        self.agents: dict[str, Any] = {}
        self.medium: str | None = None
        self.logs: dict[str, SentLog] = {}
        self.mail: dict[str, Mailbox] = {}

    async def begin(self, policy: str, round_: int) -> None:
        """Before a run: fresh agents for ``policy``."""
        await super().begin(policy, round_)
        tag = policy_tag(policy) + (f"-r{round_}" if round_ else "")
        self.agents = {}
        for spec in self.specs.values():
            self.agents[spec.name] = await self.bus.agent(
                f"{spec.name}-{tag}",
                group=spec.group,
                role=spec.role,
                priority=spec.priority,
                runner=spec.runner,
                link=spec.link,
            )
        self.medium = None if policy == "adaptive" else policy
        self.logs = {name: SentLog() for name in self.specs}
        self.mail = {name: Mailbox(a) for name, a in self.agents.items()}

    async def end(self) -> None:
        """After a run: close its agents."""
        for m in self.mail.values():
            await m.close()
        for a in self.agents.values():
            await a.close()
        self.agents, self.mail = {}, {}

    async def transfer(
        self, round_: int, src: str, handle: str, dst: list[str], dst_handle: str, *, foreign: bool = False
    ) -> Moved:
        """Move ``src``'s context ``handle`` to ``dst`` (stored as ``dst_handle``)."""
        kv = self.ctx[(src, handle)]
        sender = self.agents[src]
        receivers = [self.agents[d] for d in dst]
        start = time.perf_counter() - self.t0
        # A static policy still cannot send KV to a different model: it falls back to tokens there.
        medium = "tokens" if foreign and self.medium is not None else self.logs[src].medium(self.medium, dst, kv)
        if len(receivers) == 1:
            report = await sender.send(receivers[0].name, kv, medium=medium)
        else:
            report = await sender.broadcast([r.name for r in receivers], kv, medium=medium)
        self.logs[src].delivered(dst, kv)
        held = {}
        for d in dst:
            got = (await self.mail[d].get(sender.name, timeout=300)).kv
            self.ctx[(d, dst_handle)] = got
            held[d] = got.nbytes if got.has_kv else 0
        record = TransferRecord(
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
            dict(report.decision or {}),
        )
        return Moved(record, held, recompute_of(report.medium, report.decode_s))


class Mailbox:
    """The one reader of an agent's inbox: hands each delivery to whoever waits for its sender.

    Two `Agent.gather` calls running at once can each take the delivery the other waits for
    (each keeps what it did not ask for until it is done), so the workflow's concurrent
    transfers to one agent (the executors' results to the verifier) wait here instead.
    """

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self.task = asyncio.create_task(self._pump(), name=f"kvbus-mailbox-{agent.name}")

    def _queue(self, sender: str) -> asyncio.Queue[Any]:
        return self.queues.setdefault(sender, asyncio.Queue())

    async def _pump(self) -> None:
        while True:
            d = await self.agent.receive()
            self._queue(d.sender).put_nowait(d)

    async def get(self, sender: str, timeout: float = 300.0) -> Any:
        """The next delivery from ``sender``."""
        if self.task.done() and not self.task.cancelled() and self.task.exception() is not None:
            raise self.task.exception()  # type: ignore[misc]
        return await asyncio.wait_for(self._queue(sender).get(), timeout)

    async def close(self) -> None:
        """Stop reading."""
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


class SentLog:
    """What a sender last delivered to each receiver, so a static ``delta+X`` policy sends ``X`` when
    the receiver holds nothing to build on (the scheduler refuses delta without a base)."""

    def __init__(self) -> None:
        self.sent: dict[str, torch.Tensor] = {}

    def medium(self, medium: str | None, receivers: list[str], kv: KVCache) -> str | None:
        """``medium``, or its inner medium for a delta medium some receiver has no base for."""
        if medium is None or not (spec := medium_spec(medium)).delta:
            return medium
        for rx in receivers:
            prev = self.sent.get(rx)
            if (
                prev is None
                or prev.shape[0] != kv.tokens.shape[0]
                or min(prev.shape[-1], kv.tokens.shape[-1]) == 0
                or not bool(torch.equal(prev[..., :1], kv.tokens[..., :1]))
            ):
                return spec.inner
        return medium

    def delivered(self, receivers: list[str], kv: KVCache) -> None:
        """``kv`` reached ``receivers``."""
        for rx in receivers:
            self.sent[rx] = kv.tokens


def policy_tag(policy: str) -> str:
    """A policy name usable inside an agent name (``delta+int8`` -> ``delta-int8``)."""
    return policy.replace("(", "").replace(")", "").replace("+", "-").replace(".", "")


def recompute_of(medium: str, decode_s: dict[str, float]) -> float:
    """Seconds the receivers spent rebuilding KV (media that carry tokens or a summary)."""
    return sum(decode_s.values()) if medium_spec(medium).outer in ("tokens", "summary") else 0.0


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
        self.by_name = {a.name: a for a in agents}
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

    async def run(
        self, nats_url: str, policy: str, *, progress: Callable[[str], None] | None = None, round_: int = 0
    ) -> RunResult:
        """Run every round over the bus with ``policy`` (``adaptive`` or a medium forced on every transfer),
        all agents in this process."""
        bus = await Bus.connect(nats_url, config=self.bus_config, **self.nats_options)
        try:
            return await self.run_on(BusTeam(self.by_name, bus), policy, progress=progress, round_=round_)
        finally:
            await bus.close()

    async def reference(self) -> RunResult:
        """The same rounds in one process with contexts handed over as objects: the ground truth."""
        return await self.run_on(LocalTeam(self.by_name), "reference")

    async def run_on(
        self, team: Team, policy: str, *, progress: Callable[[str], None] | None = None, round_: int = 0
    ) -> RunResult:
        """Run every round with ``team`` holding the agents."""
        await team.begin(policy, round_)
        try:
            return await self._rounds(team, policy, progress, round_)
        finally:
            await team.end()

    async def _rounds(self, team: Team, policy: str, progress: Callable[[str], None] | None, round_: int) -> RunResult:
        result = RunResult(policy, round=round_)
        say = progress or (lambda _msg: None)
        n = self.new_tokens
        t0 = time.perf_counter()
        team.t0 = t0
        held: dict[str, int] = {}

        def hold(agent: str, nbytes: int) -> None:
            held[agent] = nbytes
            result.peak_kv_bytes = max(result.peak_kv_bytes, sum(held.values()))

        def out(agent: str, tokens: torch.Tensor) -> None:
            result.outputs.setdefault(agent, []).append(tokens)

        def moved(m: Moved) -> None:
            if m.record is not None:
                result.transfers.append(m.record)
            result.recompute_s += m.recompute_s
            for name, nbytes in m.held.items():
                hold(name, nbytes)

        coord, verifier = self.coordinator.name, self.verifier.name
        await team.seed(coord, "history", self.encode(self.preamble))
        src = "history"
        for r, task in enumerate(self.tasks):
            say(f"round {r + 1}/{len(self.tasks)}: coordinator plans")
            tokens, nbytes = await team.extend(
                coord, src, self.encode(f"\nTask: {task}\nPlan in {len(self.executors)} parts:"), n, "plan"
            )
            out(coord, tokens)
            hold(coord, nbytes)
            say(f"round {r + 1}: the plan goes to {len(self.executors)} executors")
            for m in await asyncio.gather(*(team.transfer(r, coord, "plan", [e.name], "plan") for e in self.executors)):
                moved(m)
            for i, ex in enumerate(self.executors):
                say(f"round {r + 1}: executor {i + 1} works")
                ask = self.encode(f"\nExecutor {i + 1}, do part {i + 1}:")
                tokens, nbytes = await team.extend(ex.name, "plan", ask, n, "work")
                out(ex.name, tokens)
                hold(ex.name, nbytes)
            say(f"round {r + 1}: executors -> verifier (gather)")
            for m in await asyncio.gather(
                *(team.transfer(r, ex.name, "work", [verifier], f"work-{ex.name}") for ex in self.executors)
            ):
                moved(m)
            # The verifier reads the last executor's context and checks it.
            say(f"round {r + 1}: verifier checks")
            tokens, nbytes = await team.extend(
                verifier,
                f"work-{self.executors[-1].name}",
                self.encode("\nVerifier: is the work correct? Answer:"),
                n,
                "verdict",
            )
            out(verifier, tokens)
            hold(verifier, nbytes)
            say(f"round {r + 1}: verdict -> coordinator")
            moved(await team.transfer(r, verifier, "verdict", [coord], "verdict"))
            src = "verdict"
            group = [a.name for a in [self.verifier, *self.executors] if a.group == self.coordinator.group]
            if len(group) > 1:
                say(f"round {r + 1}: coordinator broadcasts the outcome to its group")
                moved(await team.transfer(r, coord, "verdict", group, "shared"))
            if self.archivist is not None:
                arch = self.archivist.name
                say(f"round {r + 1}: coordinator -> archivist (a different model)")
                moved(await team.transfer(r, coord, "verdict", [arch], "got", foreign=True))
                tokens, nbytes = await team.extend(arch, "got", self.encode("\nArchive note:"), 4, "note")
                out(arch, tokens)
                hold(arch, nbytes)
        result.e2e_s = time.perf_counter() - t0
        return result


def extend_context(runner: Any, kv: KVCache | None, tokens: torch.Tensor, n: int) -> KVCache:
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
    out: KVCache = runner.continue_context(ctx, n)
    return out


def _is_prefix(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape[-1] <= b.shape[-1] and bool(torch.equal(a[..., :], b[..., : a.shape[-1]]))
