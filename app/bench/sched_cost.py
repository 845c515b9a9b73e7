"""The group scheduler's own cost per grant (`kvbus bench sched`'s ``decision_us_*``): the policy's
thread CPU time of ``decide`` per grant in a group of 16 / 64 / 256 / 1024 agents with half of them
sending and half waiting (each step one transfer finishes, one arrives, ``decide`` grants one),
and of ``adjust`` (the per-slice max-min reallocation of every running transfer); and how many
transfers the incremental max-min recomputed per slice (``recomputed_per_slice``)."""

from __future__ import annotations

import gc
import random
import time
from typing import Any

from kvbus.app.bench.rounds import pct
from kvbus.group_scheduler import WeightedPolicy
from kvbus.group_scheduler.policy import Decision
from kvbus.group_scheduler.simulate import SIM_SIGNATURE
from kvbus.group_scheduler.state import AgentState, GroupState, Pending
from kvbus.protocol import TransferRequest

MB = 1_000_000


def decision_cost(n: int, steps: int, selector: Any, seed: int = 1) -> dict[str, float]:
    """Per-grant thread CPU time of ``decide`` and per-call time of ``adjust`` in a group of ``n`` agents."""
    rnd = random.Random(seed)
    state = GroupState("bench", bandwidth_bps=n * 5 * MB)
    sig = SIM_SIGNATURE.to_dict()
    for i in range(n):
        state.agents[f"a{i}"] = AgentState(f"a{i}", role_priority=rnd.choice([0.5, 1.0, 2.0]), last_seen=1e18)
        state.declare(f"a{i}", rnd.choice([10 * MB, 25 * MB, 100 * MB]), 0.0)
    policy = WeightedPolicy(selector, max_active=n // 2)
    now, k = 0.0, 0

    def arrival(src: str, dst: str) -> None:
        nonlocal k
        req = TransferRequest(
            transfer_id=f"t{k}",
            src=src,
            dst=[dst],
            group="bench",
            n_tokens=512,
            nbytes=rnd.choice([1, 4, 16]) * MB,
            signature=sig,
        )
        k += 1
        pending = Pending(req, {dst: SIM_SIGNATURE}, arrived=now)
        state.queue.append(pending)
        policy.queued(state, pending)

    def apply(decisions: list[Decision]) -> int:
        granted = 0
        for d in decisions:
            state.queue.remove(d.pending)
            if not d.refused:
                d.pending.granted_at, d.pending.rate_bps = now, d.rate_bps
                state.active[d.pending.transfer_id] = d.pending
                policy.started(state, d.pending)
                granted += 1
        return granted

    for i in range(n):
        arrival(f"a{i}", f"a{(i * 7 + 3) % n}")
        apply(policy.decide(state, now))
        policy.adjust(state, now)
    gc.collect()
    gc.freeze()
    per_grant, adjust = [], []
    clock = time.thread_time_ns
    try:
        for _ in range(steps):
            now += 0.002
            p = state.active.pop(rnd.choice(list(state.active)))
            policy.released(p)
            arrival(p.src, p.dst[0])
            t0 = clock()
            decisions = policy.decide(state, now)
            t1 = clock()
            granted = apply(decisions)
            if granted:
                per_grant.append((t1 - t0) / 1e3 / granted)
            before = policy.reallocations
            t2 = clock()
            policy.adjust(state, now)
            t3 = clock()
            if policy.reallocations != before:
                adjust.append((t3 - t2) / 1e3)
    finally:
        gc.unfreeze()
    return {
        "p50": pct(per_grant, 0.5),
        "p99": pct(per_grant, 0.99),
        "adjust_p50": pct(adjust, 0.5),
        "adjust_p99": pct(adjust, 0.99),
        "grants": len(per_grant),
        "recomputed_per_slice": policy._alloc.recomputed / max(1, policy.reallocations),
    }
