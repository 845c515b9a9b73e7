"""The weighted policy's urgency index picks the same victims as a scan of every running transfer.

With a group budget `WeightedPolicy._preempt` pops the transfers an urgent start outranks from
heaps by urgency, holds every paused transfer it outranks by one hold instead of a ``paused_by``
entry in each, and `_outranks_rivals` asks the heaps for the least urgent rival. A brute-force
policy (a scan of every running transfer, one ``paused_by`` entry per preemptor) is driven
through the same events beside it: every decision and every control must be the same, in the
same order, and the same transfers must be paused.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbus.group_scheduler import WeightedPolicy
from kvbus.group_scheduler.preemption import UrgencyHeap
from kvbus.group_scheduler.simulate import SIM_SIGNATURE
from kvbus.group_scheduler.state import AgentState, GroupState, Pending
from kvbus.protocol import ControlAction, TransferRequest

MB = 1_000_000
AGENTS = 6


class ScanPolicy(WeightedPolicy):
    """The same policy deciding by a scan of every running transfer (the reference)."""

    def _preempt(self, state: GroupState, p: Pending, u: float, u_own: float, now: float) -> None:
        self._preempt_scan(state, p, u, u_own, now)

    def _outranks_rivals(self, state: GroupState, p: Pending, u: float, u_own: float, slots: int) -> bool:
        pair = p.pair
        blocked_pair = self._pair_running.get(pair, 0) >= self.per_pair
        for run in self._runs.values():
            f = run.pending
            same = f.pair == pair
            holder = slots <= 0 or (blocked_pair and same)
            if not holder and (f.paused or not self.competes(state, p, f)):
                continue
            if self.preemption.outranks(u_own if same else u, run.urgency):
                return True
        return False


#: One event: (kind, a, b, size); kind 0-1 arrival a -> b, 2 end, 3 budget-only end, 4 the
#: sender of the last pause declines it, 5 time passes (aging, pauses running out, waits long).
EVENTS = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, AGENTS - 1), st.integers(0, AGENTS - 1), st.integers(0, 5)),
    min_size=20,
    max_size=120,
)


class World:
    """A group, its queue and running set, driven by one policy."""

    def __init__(self, policy: WeightedPolicy, budget: float) -> None:
        self.policy = policy
        self.state = GroupState("g", bandwidth_bps=budget)
        for i in range(AGENTS):
            self.state.agents[f"a{i}"] = AgentState(f"a{i}", role_priority=(0.5, 1.0, 2.0)[i % 3], last_seen=1e18)
            self.state.declare(f"a{i}", (10 * MB, 25 * MB, 100 * MB)[i % 3], 0.0)
        self.log: list[Any] = []
        self.last_pause: Pending | None = None

    def arrive(self, k: int, a: int, b: int, size: int, now: float) -> None:
        critical = size >= 3
        req = TransferRequest(
            transfer_id=f"t{k}",
            src=f"a{a}",
            dst=[f"a{b}"],
            group="g",
            n_tokens=16,
            nbytes=(MB, 4 * MB, 16 * MB, 64_000, 2 * MB, 8 * MB)[size],
            signature=SIM_SIGNATURE.to_dict(),
            critical=critical,
        )
        p = Pending(req, {f"a{b}": SIM_SIGNATURE}, arrived=now)
        if size in (2, 5):
            p.deadline_at = now + 0.02 * (1 + a + b)  # urgencies of many levels
        self.state.queue.append(p)
        self.policy.queued(self.state, p)

    def step(self, now: float) -> None:
        state, policy = self.state, self.policy
        for d in policy.decide(state, now):
            state.queue.remove(d.pending)
            self.log.append(("decide", d.pending.transfer_id, d.refused, d.rate_bps, d.reason))
            if not d.refused:
                d.pending.granted_at, d.pending.rate_bps = now, d.rate_bps
                state.active[d.pending.transfer_id] = d.pending
                policy.started(state, d.pending)
        for adj in policy.adjust(state, now):
            self.log.append(("adjust", adj.pending.transfer_id, adj.action, adj.rate_bps, adj.reason))
            if adj.action == ControlAction.PAUSE:
                self.last_pause = adj.pending
        self.log.append(("paused", sorted(t for t, p in state.active.items() if p.paused)))
        self.log.append(("wakeup", policy.next_wakeup(state, now)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=EVENTS,
    budget=st.sampled_from([0, 40 * MB, 400 * MB]),
    per_pair=st.sampled_from([1, 2]),
    max_active=st.sampled_from([2, 3, 5]),
)
def test_indexed_preemption_decides_as_a_scan_of_every_running_transfer(
    events: list[tuple[int, int, int, int]], budget: int, per_pair: int, max_active: int
) -> None:
    worlds = [
        World(cls(None, max_active=max_active, per_pair=per_pair, preempt_min_bytes=0, max_pause_s=5.0), budget)
        for cls in (WeightedPolicy, ScanPolicy)
    ]
    now = 0.0
    for k, (kind, a, b, size) in enumerate(events):
        now += (0.5, 3.0)[size % 2] if kind == 5 else 0.004
        for w in worlds:
            active = w.state.active
            if kind <= 1 and a != b:
                w.arrive(k, a, b, size, now)
            elif kind in (2, 3) and active:
                p = active[sorted(active)[(a * AGENTS + b) % len(active)]]
                if kind == 2:
                    del active[p.transfer_id]
                    p.done = True
                    w.policy.released(p)
                elif not p.done:
                    p.done = True
                    w.policy.budget_only(p)
            elif kind == 4 and w.last_pause is not None and w.last_pause.paused:
                p, w.last_pause = w.last_pause, None
                p.paused = False
                p.paused_by.clear()
                p.unpreemptible = True
                w.policy.changed()
            w.step(now)
        assert worlds[0].log == worlds[1].log
    assert worlds[0].policy.preemptions == worlds[1].policy.preemptions


def test_a_preemptor_holds_no_paused_transfer_of_its_pair_that_it_does_not_outrank() -> None:
    """A critical transfer f is paused by one that waited long (g); a second critical transfer
    of f's pair (p) starts and pauses nothing of its pair: when g is done, f resumes."""
    for cls in (WeightedPolicy, ScanPolicy):
        w = World(cls(None, max_active=2, per_pair=1, preempt_min_bytes=0), 400 * MB)
        w.arrive(0, 0, 1, 4, 0.0)  # f: a0 -> a1, critical
        w.arrive(1, 4, 5, 1, 0.0)  # h: ordinary
        w.step(0.0)
        w.arrive(2, 2, 3, 1, 0.01)  # g: waits for a slot
        w.step(0.01)
        w.step(3.0)  # g has waited long enough to outrank even a critical transfer
        f, h, g = (w.state.active[t] for t in ("t0", "t1", "t2"))
        assert f.paused and h.paused and g.transfer_id in f.paused_by | h.paused_by
        w.arrive(3, 0, 1, 4, 3.01)  # p: critical, f's pair
        w.step(3.01)
        assert "t3" in w.state.active and f.paused and h.paused
        del w.state.active["t2"]
        g.done = True
        w.policy.released(g)
        w.step(3.02)
        assert not f.paused, cls  # only g held it
        assert h.paused, cls  # p holds it too
        assert ("adjust", "t0", ControlAction.RESUME, 0.0, "its preemptors are done") in w.log


def test_transfers_held_by_a_preemptor_that_outranked_them_all_resume_when_it_is_done() -> None:
    """q pauses f and h; p starts while they are paused and outranks them all (one hold, no
    ``paused_by`` entry); q ends, they stay paused for p; p ends, they resume at once."""
    for cls in (WeightedPolicy, ScanPolicy):
        w = World(cls(None, max_active=2, per_pair=1, preempt_min_bytes=0), 400 * MB)
        w.arrive(0, 0, 1, 1, 0.0)  # f
        w.arrive(1, 4, 5, 1, 0.0)  # h
        w.step(0.0)
        w.arrive(2, 2, 3, 4, 0.01)  # q: critical
        w.step(0.01)
        f, h, q = (w.state.active[t] for t in ("t0", "t1", "t2"))
        assert f.paused and h.paused
        w.arrive(3, 3, 2, 4, 0.02)  # p: critical
        w.step(0.02)
        p = w.state.active["t3"]
        for done, now in ((q, 0.03), (p, 0.04)):
            del w.state.active[done.transfer_id]
            done.done = True
            w.policy.released(done)
            w.step(now)
            assert f.paused == h.paused == (done is q), cls
        assert ("adjust", "t0", ControlAction.RESUME, 0.0, "its preemptors are done") in w.log


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "discard", "first", "pop"]), st.integers(0, 9), st.integers(0, 6)),
        max_size=120,
    ),
    most_first=st.booleans(),
)
def test_urgency_heap_agrees_with_a_dict(ops: list[tuple[str, int, int]], most_first: bool) -> None:
    heap = UrgencyHeap(most_first=most_first)
    ref: dict[str, float] = {}
    sign = -1.0 if most_first else 1.0
    for op, key, value in ops:
        tid, u = f"t{key}", float(value)
        if op == "add":
            heap.add(tid, u)
            ref[tid] = u
        elif op == "discard":
            heap.discard(tid)
            ref.pop(tid, None)
        elif op == "first":
            skip = {f"t{i}" for i in range(value)}
            got = heap.first(skip)
            rest = [sign * v for t, v in ref.items() if t not in skip]
            assert (got[0] if got else None) == (sign * min(rest) if rest else None)
            assert got is None or (got[1] not in skip and ref[got[1]] == got[0])
        else:
            bound = float(value)
            taken = heap.pop_while(lambda x, bound=bound: sign * x <= sign * bound)
            want = sorted(sign * v for v in ref.values() if sign * v <= sign * bound)
            assert [sign * x for x, _ in taken] == want
            for _, t in taken:
                del ref[t]
        assert len(heap) == len(ref) and set(heap) == set(ref)
