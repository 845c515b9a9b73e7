"""A fluid simulation of one group under a policy, on a simulated clock.

Senders are ideal: a granted transfer streams at exactly its allocated rate (or
``unpaced_bps`` when unpaced), a control takes effect ``control_delay_s`` after the policy
issues it, and a conditional pause is declined when the sender has already sent its
``max_fraction`` (as the real sender does). The policy object is the real one, driven the
way `GroupScheduler` drives it: a pass on every arrival and completion, and whenever the
policy's `next_wakeup` asks for one; every change to the queue and the running set goes to the
policy's hooks (`queued`, `started`, `released`). For deterministic tests (shares, starvation bounds,
preemption, reservation deadlines) and what-if runs of policy settings.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvbus.group_scheduler.policy import Adjustment, Decision, MediumSelector, SchedulingPolicy
from kvbus.group_scheduler.state import AgentState, GroupState, Pending
from kvbus.protocol import ControlAction, TransferRequest
from kvbus.signature import ModelSignature

SIM_SIGNATURE = ModelSignature("sim-model", n_layers=2, n_kv_heads=2, head_dim=64, dtype="float16", vocab_size=1000)


class FixedSelector(MediumSelector):
    """Always ``full``: keeps medium selection (the cost model's business) out of a policy measurement."""

    def choose(self, state: GroupState, pending: Pending) -> tuple[str, str]:
        """``full``, with ``fixed`` as the reason."""
        return "full", "fixed"


@dataclass
class SimTransfer:
    """One transfer of the simulation and what happened to it (times in simulated seconds)."""

    src: str
    dst: tuple[str, ...]
    nbytes: int
    arrive_at: float
    critical: bool = False
    deadline_s: float | None = None
    tag: str = ""
    transfer_id: str = ""
    granted_at: float | None = None
    done_at: float | None = None
    sent: float = 0.0
    rate_bps: float = 0.0
    """The rate the sender currently uses."""
    paused: bool = False
    pauses: int = 0
    declined: int = 0

    @property
    def latency_s(self) -> float | None:
        """Arrival to completion, in simulated seconds (None until done)."""
        return None if self.done_at is None else self.done_at - self.arrive_at

    @property
    def queue_s(self) -> float | None:
        """Arrival to grant, in simulated seconds (None until granted)."""
        return None if self.granted_at is None else self.granted_at - self.arrive_at


@dataclass
class PassTiming:
    """CPU time of one policy pass and how many grants it made."""

    decide_s: float
    """`decide` (admission, media, rates of the new grants)."""
    adjust_s: float
    """`adjust` (the per-slice max-min reallocation of running transfers)."""
    grants: int
    flows: int

    @property
    def seconds(self) -> float:
        """CPU seconds of the pass (decide + adjust)."""
        return self.decide_s + self.adjust_s


@dataclass
class Simulation:
    """A group of agents, a policy and a workload, advanced in steps of ``step_s``."""

    policy: SchedulingPolicy
    step_s: float = 0.001
    bandwidth_bps: float = 0.0
    control_delay_s: float = 0.001
    unpaced_bps: float = 1e10
    now: float = 0.0
    state: GroupState = field(default_factory=lambda: GroupState("sim"))
    transfers: list[SimTransfer] = field(default_factory=list)
    timings: list[PassTiming] = field(default_factory=list)
    pair_bytes: dict[tuple[str, tuple[str, ...]], float] = field(default_factory=dict)
    """Bytes sent per (src, dst) pair since the last `reset_counters`."""
    _events: list[tuple[float, int, Callable[[], object]]] = field(default_factory=list)
    _seq: itertools.count = field(default_factory=itertools.count)
    _by_id: dict[str, SimTransfer] = field(default_factory=dict)
    _due: float | None = None
    _backlogs: list[tuple[str, tuple[str, ...], int, int, dict]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state.bandwidth_bps = self.bandwidth_bps

    # -- setup ---------------------------------------------------------------------------------

    def agent(self, name: str, *, priority: float = 1.0, link_bps: float = 0.0) -> None:
        """Add agent ``name`` with a role priority and a declared link (0: unknown); it never expires."""
        self.state.agents[name] = AgentState(name, role_priority=priority, last_seen=1e18)
        self.state.declare(name, link_bps, 0.0)

    def _at(self, t: float, fn: Callable[[], object]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def submit(
        self,
        src: str,
        dst: str | tuple[str, ...],
        nbytes: int,
        *,
        at: float | None = None,
        critical: bool = False,
        deadline_s: float | None = None,
        tag: str = "",
    ) -> SimTransfer:
        """A transfer that arrives at ``at`` (default: now)."""
        dst = (dst,) if isinstance(dst, str) else tuple(dst)
        t = SimTransfer(src, dst, int(nbytes), self.now if at is None else at, critical, deadline_s, tag)
        t.transfer_id = f"t{len(self.transfers)}"
        self.transfers.append(t)
        self._by_id[t.transfer_id] = t
        self._at(t.arrive_at, lambda: self._arrive(t))
        return t

    def backlog(self, src: str, dst: str | tuple[str, ...], nbytes: int, *, depth: int = 1, tag: str = "") -> None:
        """Keep ``depth`` transfers of ``nbytes`` outstanding from ``src`` to ``dst`` (a saturating pair)."""
        dst = (dst,) if isinstance(dst, str) else tuple(dst)
        self._backlogs.append((src, dst, nbytes, depth, {"tag": tag}))
        for _ in range(depth):
            self.submit(src, dst, nbytes, tag=tag)

    def periodic(
        self,
        src: str,
        dst: str | tuple[str, ...],
        nbytes: int,
        *,
        period_s: float,
        start: float,
        until: float,
        critical: bool = True,
        deadline_s: float | None = None,
        tag: str = "",
    ) -> None:
        """Submit one transfer every ``period_s`` from ``start`` until ``until`` (critical by default)."""
        t = start
        while t < until:
            self.submit(src, dst, nbytes, at=t, critical=critical, deadline_s=deadline_s, tag=tag)
            t += period_s

    def reset_counters(self) -> None:
        """Forget the per-pair byte counts (start a new measurement window)."""
        self.pair_bytes.clear()

    # -- mechanics -----------------------------------------------------------------------------

    def _arrive(self, t: SimTransfer) -> None:
        req = TransferRequest(
            transfer_id=t.transfer_id,
            src=t.src,
            dst=list(t.dst),
            group="sim",
            n_tokens=1,
            nbytes=t.nbytes,
            signature=SIM_SIGNATURE.to_dict(),
            critical=t.critical,
        )
        deadline_at = self.now + t.deadline_s if t.deadline_s is not None else None
        pending = Pending(req, dict.fromkeys(t.dst, SIM_SIGNATURE), arrived=self.now, deadline_at=deadline_at)
        self.state.queue.append(pending)
        self.policy.queued(self.state, pending)
        self._pass()

    def _pass(self) -> None:
        t0 = time.perf_counter()
        decisions = self.policy.decide(self.state, self.now)
        t1 = time.perf_counter()
        grants = 0
        for d in decisions:
            grants += self._apply_decision(d)
        t2 = time.perf_counter()
        adjustments = self.policy.adjust(self.state, self.now)
        t3 = time.perf_counter()
        for a in adjustments:
            self._apply_adjustment(a)
        self.timings.append(PassTiming(t1 - t0, t3 - t2, grants, len(self.state.active)))
        self._due = self._wakeup()

    def _apply_decision(self, d: Decision) -> int:
        p = d.pending
        self.state.queue.remove(p)
        t = self._by_id[p.transfer_id]
        if d.refused:
            t.done_at = None
            return 0
        p.granted_at = self.now
        p.medium = d.medium
        p.rate_bps = d.rate_bps
        self.state.active[p.transfer_id] = p
        self.policy.started(self.state, p)
        t.granted_at = self.now
        t.rate_bps = d.rate_bps
        return 1

    def _apply_adjustment(self, a: Adjustment) -> None:
        p = a.pending
        t = self._by_id[p.transfer_id]

        def effect() -> None:
            if t.done_at is not None:
                return
            if a.action == ControlAction.RATE:
                t.rate_bps = a.rate_bps
            elif a.action == ControlAction.RESUME:
                t.paused = False
            elif a.action == ControlAction.PAUSE:
                self.state.preemptions += 1
                if t.sent / max(1, t.nbytes) < a.max_fraction:
                    t.paused = True
                    t.pauses += 1
                else:
                    t.declined += 1
                    p.paused = False
                    p.paused_by.clear()
                    p.unpreemptible = True
                    self.state.declined_pauses += 1
                    self.policy.changed()

        self._at(self.now + self.control_delay_s, effect)

    def _progress(self, dt: float) -> None:
        done = []
        for p in list(self.state.active.values()):
            t = self._by_id[p.transfer_id]
            if t.paused or t.granted_at is None:
                continue
            rate = t.rate_bps if t.rate_bps > 0 else self.unpaced_bps
            step = min(rate * dt, t.nbytes - t.sent)
            t.sent += step
            key = (t.src, t.dst)
            self.pair_bytes[key] = self.pair_bytes.get(key, 0.0) + step
            if t.sent >= t.nbytes - 1e-6:
                done.append((p, t))
        for p, t in done:
            t.done_at = self.now + dt
            del self.state.active[p.transfer_id]
            self.state.completed += 1
            self.policy.released(p)
            for src, dst, nbytes, _depth, extra in self._backlogs:
                if (src, dst) == (t.src, t.dst) and t.tag == extra["tag"]:
                    self._at(self.now + dt, functools.partial(self.submit, src, dst, nbytes, tag=extra["tag"]))
        if done:
            self._at(self.now + dt, self._pass)

    def _wakeup(self) -> float | None:
        return self.policy.next_wakeup(self.state, self.now)

    def run(self, until: float) -> None:
        """Advance the clock to ``until``."""
        while self.now < until - 1e-12:
            fired = False
            while self._events and self._events[0][0] <= self.now + 1e-12:
                _, _, fn = heapq.heappop(self._events)
                fn()
                fired = True
            if fired:
                self._due = self._wakeup()
            if self._due is not None and self._due <= self.now + 1e-12:
                self._pass()
            self._progress(self.step_s)
            self.now += self.step_s
