"""The group's state S(t): agents from probes, links from observed transfers, the work queue.

Everything time-dependent here takes ``now`` from `time.monotonic` (or a simulated clock),
so policies can be driven by a simulation as well as by the live scheduler.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

from kvbus.protocol import PathName, Probe, TransferRequest
from kvbus.signature import ModelSignature

#: Departed agents remembered (beyond that the oldest are forgotten: a transfer to one is then
#: refused as to an unknown agent, once its directory record is gone).
MAX_LEFT = 4096


@dataclass
class AgentState:
    """What the scheduler knows of one agent of its group."""

    name: str
    queue_size: int = 0
    cache_bytes: int = 0
    compute_load: float = 0.0
    role_priority: float = 1.0
    role: str = "agent"
    last_seen: float = 0.0
    """Monotonic time of its last probe."""
    memory_pressure: float = 0.0
    """0..1: how far past its cache watermark (set by the memory-hint logic; 0 without a budget)."""
    down: bool = False
    """No probe for longer than the probe TTL: its queued transfers were refused."""
    last_shed: float = -1e18
    """Monotonic time of the last ``shed`` hint sent to it."""
    prefill_tps: float = 0.0
    """Its measured prefill speed, tokens/s (0: none measured; the calibrated figure applies)."""
    prefill_tokens: float = 0.0
    """The mean length of the recomputes that speed was measured on (0: not said)."""
    prefill_held: float = 0.0
    """The mean of the tokens they found held already."""

    def update(self, probe: Probe, now: float | None = None) -> None:
        """Take the figures of ``probe``; the agent is seen (at ``now``) and up."""
        self.queue_size = probe.queue_size
        self.cache_bytes = probe.cache_bytes
        self.compute_load = probe.compute_load
        self.prefill_tps = probe.prefill_tps
        self.prefill_tokens = probe.prefill_tokens
        self.prefill_held = probe.prefill_held
        self.role_priority = probe.role_priority
        self.role = probe.role
        self.last_seen = time.monotonic() if now is None else now
        self.down = False


#: A transfer this many times slower than the estimate means the link is slower now: the window restarts.
DROP_FACTOR = 4.0
#: Two transfers in a row this many times faster than the estimate: the window restarts from them.
RISE_FACTOR = 2.0
#: Transfers of a link's history the drop risk is judged over (`LinkEstimate.drop_risk`); the
#: history outlives window restarts, so a link that keeps dropping is known to.
RISK_HISTORY = 32
#: Seconds a sample stays in that history.
RISK_MAX_AGE_S = 600.0
#: A sample's weight in the drop risk halves with each this many seconds of age.
RISK_HALF_LIFE_S = 120.0
#: Drop-free samples the risk is judged as if it had seen besides the real ones (a prior): one drop
#: in three transfers is a risk of 1/7, not 1/3, and an old drop fades as the prior outweighs it.
RISK_PRIOR_SAMPLES = 4.0


@dataclass
class LinkEstimate:
    """Bandwidth of one (sender, receiver) link over a sliding window of observed transfers.

    The window follows a link whose rate changed: one transfer ``DROP_FACTOR`` times slower than
    the estimate restarts it (sending the next context as if the link were still fast costs far
    more than sending one too compressed), two in a row ``RISE_FACTOR`` times faster do.
    """

    samples: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=16))
    """(bytes, seconds, when) of recent transfers."""
    max_age_s: float = 60.0
    """Samples older than this are forgotten (links change; an unused estimate goes stale)."""
    rising: bool = False
    """The last sample was ``RISE_FACTOR`` faster than the estimate before it (unconfirmed)."""
    peak_bps: float = 0.0
    """The estimate before the last drop: the rate a probe hopes the link is back to."""
    changes: int = 0
    """Drops and rises so far (a probing selector restarts its back-off on one)."""
    _rise_base: float = 0.0
    """While ``rising``: the estimate before the first fast sample."""
    history: deque[tuple[float, bool, float]] = field(default_factory=lambda: deque(maxlen=RISK_HISTORY))
    """(rate, whether it was a drop, when) of the last `RISK_HISTORY` samples, across restarts."""

    def observe(self, nbytes: int, seconds: float, now: float | None = None, *, probe: bool = False) -> None:
        """Add a sample of ``nbytes`` sent in ``seconds`` (ignored unless both are positive).

        ``probe``: the transfer was sent to measure the link (`AdaptiveSelector._probe`); a rise it
        shows restarts the window at once, without waiting for a second transfer to confirm it.
        """
        if nbytes <= 0 or seconds <= 0:
            return
        rate, est = nbytes / seconds, self.bandwidth_bps
        # A second fast sample is compared with the estimate before the first: the first already
        # pulled the window's average up (half way, for two samples of one size), and judged
        # against that a link that doubled would never be confirmed.
        base = self._rise_base if self.rising else est
        when = time.monotonic() if now is None else now
        self.history.append((rate, bool(est > 0 and rate * DROP_FACTOR < est), when))
        if est > 0 and rate * DROP_FACTOR < est:
            self.samples.clear()
            self.rising = False
            self.peak_bps = max(self.peak_bps, est)
            self.changes += 1
        elif est > 0 and rate > RISE_FACTOR * est and probe:
            self.samples.clear()
            self.rising = False
            self.changes += 1
        elif est > 0 and rate > RISE_FACTOR * base:
            if self.rising:
                last = self.samples[-1]
                self.samples.clear()
                self.samples.append(last)
                self.changes += 1
            else:
                self._rise_base = est
            self.rising = not self.rising
        else:
            self.rising = False
        self.samples.append((float(nbytes), float(seconds), when))

    def _fresh(self) -> list[tuple[float, float, float]]:
        cutoff = time.monotonic() - self.max_age_s
        while self.samples and self.samples[0][2] < cutoff:
            self.samples.popleft()
        return list(self.samples)

    @property
    def bandwidth_bps(self) -> float:
        """Bytes over seconds across the window (weights big transfers by their size), 0 if unknown."""
        fresh = self._fresh()
        b = sum(s[0] for s in fresh)
        t = sum(s[1] for s in fresh)
        return b / t if t > 0 else 0.0

    def drop_risk(self, now: float | None = None) -> tuple[float, float]:
        """``(p, slow_bps)``: how likely the next transfer is to find the link dropped, and the
        slowest rate it dropped to; ``(0, 0)`` for a link that has not dropped lately.

        ``p`` is the drops' share of the recent samples (`RISK_HISTORY`, younger than
        `RISK_MAX_AGE_S`), each weighted by its age (half-life `RISK_HALF_LIFE_S`), beside
        `RISK_PRIOR_SAMPLES` drop-free ones. The cost model expects a transfer to meet the slow rate
        with probability ``p`` (`Link.drop_p`): on a link seen to fall from 1 Gbit/s to 10 Mbit/s, a
        context sent uncompressed at the fast rate is a gamble that costs seconds when it loses."""
        now = time.monotonic() if now is None else now
        weight = drops = 0.0
        slow = math.inf
        for rate, dropped, t in self.history:
            age = now - t
            if age > RISK_MAX_AGE_S:
                continue
            w = 0.5 ** (max(0.0, age) / RISK_HALF_LIFE_S)
            weight += w
            if dropped:
                drops += w
                slow = min(slow, rate)
        if drops <= 0:
            return 0.0, 0.0
        return drops / (weight + RISK_PRIOR_SAMPLES), slow

    @property
    def last_rate_bps(self) -> float:
        """The rate of the newest sample (0 if none)."""
        return self.samples[-1][0] / self.samples[-1][1] if self.samples else 0.0

    @property
    def known(self) -> bool:
        """Whether there is any sample younger than ``max_age_s``."""
        return bool(self._fresh())


@dataclass(eq=False)
class Pending:
    """A transfer request waiting for, or holding, a grant."""

    request: TransferRequest
    receivers: dict[str, ModelSignature | None]
    """Each receiver's model signature from the directory (None: accepts tokens only)."""
    arrived: float = field(default_factory=time.monotonic)
    """Monotonic time the request arrived (a re-sent request keeps its original time)."""
    granted_at: float = 0.0
    medium: str = ""
    rate_bps: float = 0.0
    """The rate the sender was last told (grant or ``rate`` control); 0 = unpaced."""
    decision: dict = field(default_factory=dict)
    predicted_s: float = 0.0
    predicted_comp_s: float = 0.0
    """The chosen estimate's compute terms (what the cost model's online correction learns from)."""
    predicted_split: tuple[float, float, float] | None = None
    """A split's calibrated prefill, the stream that hides it, and its cost besides the exposed
    prefill (`CostModel.observe_split`); None for any other medium."""
    deadline_at: float | None = None
    """The request's deadline on the monotonic clock, or None."""
    grant: bytes = b""
    """The encoded grant, re-sent if the sender asks again (its first copy was lost)."""
    recompute: dict[str, bool] = field(default_factory=dict)
    """Per receiver, whether its directory record says it can rebuild KV from tokens (has a model
    runner); a receiver missing here is assumed able to (simulations, benchmarks)."""
    hosts: dict[str, str] = field(default_factory=dict)
    """The sender's and the receivers' hosts, as their directory records say ("" or missing: unknown)."""
    # -- running-transfer state kept by the weighted policy ----------------------------------
    paused: bool = False
    """Told to pause (and not declined)."""
    paused_at: float = 0.0
    paused_by: set[str] = field(default_factory=set)
    """Transfers that preempted this one; it resumes when they are done."""
    unpreemptible: bool = False
    """The sender declined a pause (past the threshold, inline): never asked again."""
    reservation: str = ""
    """Id of the reservation whose bandwidth it uses, if any."""
    budget_until: float = 0.0
    """Monotonic time its rate budget ends (`Grant.budget_s`; 0: none): the slot stays active
    until then, also after the transfer itself is done."""
    done: bool = False
    """The granted transfer itself reported done (its slot may still be a running budget)."""

    @property
    def transfer_id(self) -> str:
        """The request's transfer id."""
        return self.request.transfer_id

    @property
    def src(self) -> str:
        """The sender's name."""
        return self.request.src

    @cached_property
    def dst(self) -> tuple[str, ...]:
        """The receivers' names, in request order."""
        return tuple(self.request.dst)

    @cached_property
    def pair(self) -> tuple[str, tuple[str, ...]]:
        """The (sender, receivers) pair the round robin serves."""
        return self.request.src, self.dst

    def same_host(self, rx: str) -> bool:
        """Whether the sender and ``rx`` are known to run on one host (so ``shm`` can carry it)."""
        src = self.hosts.get(self.request.src, "")
        return bool(src) and src == self.hosts.get(rx, "")

    def other_host(self, rx: str) -> bool:
        """Whether the sender and ``rx`` are known to run on two hosts (so ``shm`` cannot carry it)."""
        src, dst = self.hosts.get(self.request.src, ""), self.hosts.get(rx, "")
        return bool(src) and bool(dst) and src != dst


@dataclass
class GroupState:
    """S(t) for one group."""

    group: str
    agents: dict[str, AgentState] = field(default_factory=dict)
    links: dict[tuple[str, str], LinkEstimate] = field(default_factory=dict)
    """Per (sender, receiver): the estimate of the ``nats`` path (every byte through the server)."""
    path_links: dict[tuple[str, str, str], LinkEstimate] = field(default_factory=dict)
    """Per (sender, receiver, path): the estimates of the direct paths (``shm``, ``tcp``), kept
    apart from the ``nats`` one so that links of very different speeds are never averaged."""
    queue: list[Pending] = field(default_factory=list)
    active: dict[str, Pending] = field(default_factory=dict)
    bandwidth_bps: float = 0.0
    """The group's bandwidth budget (0 = unlimited)."""
    granted: int = 0
    completed: int = 0
    failed: int = 0
    refused: int = 0
    preemptions: int = 0
    declined_pauses: int = 0
    queue_epoch: int = 0
    """Bumped by `drop`: the queue lost entries other than by the policy's decisions. (The
    policies here learn of that by the `SchedulingPolicy.withdrawn` hook instead.)"""
    declared: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per agent: (link bytes/s, one-way latency s) it declared in the directory (0 = unknown)."""
    declared_version: int = 0
    """Bumped by `declare` when a declaration changed (the policy's rates re-read the capacities)."""
    priorities: dict[str, float] = field(default_factory=dict)
    """Role priorities from the directory, for agents that do not probe this group (other groups)."""
    remote: dict[str, str] = field(default_factory=dict)
    """Agents of other groups (name -> their group) seen as receivers: transfers to them are inter-group."""
    inter_bps: float = 0.0
    """Cap on the summed rate of the inter-group transfers: the coordinator's lease (0 = no cap)."""
    n_down: int = 0
    """How many agents are marked down."""
    left: dict[str, float] = field(default_factory=dict)
    """Agents that said they left (closed), with the wall-clock time their leave message carries:
    transfers to them are refused with `Reason.RECEIVER_GONE` until they come back (a probe, or a
    directory record written after that time). Bounded by `MAX_LEFT` (the oldest are forgotten)."""
    _seen_floor: float = field(default=float("-inf"), repr=False)
    """A lower bound of the live agents' ``last_seen``: probes only move ``last_seen`` forward, so
    until ``now - _seen_floor`` passes the TTL no agent can have expired and the liveness check
    does not scan the group (it did on every scheduling pass: O(group) per request)."""

    def inter_group(self, p: Pending) -> bool:
        """Whether a transfer has a receiver in another group (it draws on the coordinator's lease)."""
        return any(rx in self.remote for rx in p.dst)

    def on_probe(self, probe: Probe, now: float | None = None) -> AgentState:
        """Record a probe: the agent's figures, liveness and declared link; returns its state."""
        self.left.pop(probe.agent, None)
        agent = self.agents.setdefault(probe.agent, AgentState(probe.agent))
        if agent.down:
            self.n_down -= 1
        agent.update(probe, now)
        self._seen_floor = min(self._seen_floor, agent.last_seen)
        self.declare(probe.agent, probe.link_bps, probe.latency_s)
        return agent

    def heard_from(self, name: str, now: float | None = None) -> None:
        """Agent ``name`` sent the scheduler something (a request, a done report): proof that it
        lives, as a probe is, so it is seen and up again. Its figures stay those of its last probe.
        An agent that never probed is not added (its first probe brings its figures)."""
        agent = self.agents.get(name)
        if agent is None or name in self.left:
            return
        if agent.down:
            agent.down = False
            self.n_down -= 1
        agent.last_seen = time.monotonic() if now is None else now
        self._seen_floor = min(self._seen_floor, agent.last_seen)

    def declare(self, agent: str, link_bps: float, latency_s: float) -> None:
        """Record an agent's declared link; a changed declaration resets the estimates of its links
        (the declaration is newer information than the samples)."""
        new = (float(link_bps), float(latency_s))
        old = self.declared.get(agent)
        self.declared[agent] = new
        if old != new:
            self.declared_version += 1
        if old is not None and old != new:
            for key in [k for k in self.links if agent in k]:
                self.links[key].samples.clear()
            for pkey in [k for k in self.path_links if agent in k[:2]]:
                self.path_links[pkey].samples.clear()

    def link(self, src: str, dst: str, path: str = PathName.NATS) -> LinkEstimate:
        """The bandwidth estimate of the ``src`` -> ``dst`` link on data ``path`` (created empty on first use)."""
        if not path or path == PathName.NATS:
            return self.links.setdefault((src, dst), LinkEstimate())
        return self.path_links.setdefault((src, dst, path), LinkEstimate())

    def declared_bandwidth(self, src: str, dst: str) -> float:
        """The lower of the declared capacities of ``src`` and ``dst``, bytes/s (0: neither declared one)."""
        rates = [r for r in (self.declared.get(src, (0.0, 0.0))[0], self.declared.get(dst, (0.0, 0.0))[0]) if r > 0]
        return min(rates) if rates else 0.0

    def declared_latency(self, src: str, dst: str) -> float:
        """The sum of the one-way latencies ``src`` and ``dst`` declared, seconds."""
        return self.declared.get(src, (0.0, 0.0))[1] + self.declared.get(dst, (0.0, 0.0))[1]

    def role_priority(self, name: str) -> float:
        """An agent's role priority: from its probes, else the directory, else 1.0."""
        agent = self.agents.get(name)
        if agent is not None:
            return agent.role_priority
        return self.priorities.get(name, 1.0)

    def capacity(self, agent: str) -> float:
        """An agent's declared link capacity in bytes/s, used for both its egress and its ingress (0 = unknown)."""
        return self.declared.get(agent, (0.0, 0.0))[0]

    # -- liveness -----------------------------------------------------------------------------

    def expire(self, now: float, ttl_s: float) -> list[str]:
        """Mark agents whose last probe is older than ``ttl_s`` as down; returns the newly down ones.

        Scans the group only when the oldest live probe may have passed the TTL.
        """
        if now - self._seen_floor <= ttl_s:
            return []
        gone = []
        floor = float("inf")
        for agent in self.agents.values():
            if agent.down or not agent.last_seen:
                continue
            if now - agent.last_seen > ttl_s:
                agent.down = True
                gone.append(agent.name)
            elif agent.last_seen < floor:
                floor = agent.last_seen
        self.n_down += len(gone)
        self._seen_floor = floor
        return gone

    def depart(self, name: str, when: float) -> bool:
        """``name`` left the group (it closed and said so at wall-clock time ``when``): forget its
        probes at once (it is not "marked down" later) and remember that it left. Returns whether
        the group knew it (from probes)."""
        agent = self.agents.pop(name, None)
        if agent is not None and agent.down:
            self.n_down -= 1
        self.left.pop(name, None)
        self.left[name] = when
        while len(self.left) > MAX_LEFT:
            del self.left[next(iter(self.left))]
        return agent is not None

    def returned(self, name: str) -> None:
        """An agent that had left is back (a new incarnation registered)."""
        self.left.pop(name, None)

    def is_down(self, name: str) -> bool:
        """Whether agent ``name`` is known and marked down."""
        agent = self.agents.get(name)
        return agent is not None and agent.down

    def next_expiry(self, ttl_s: float) -> float | None:
        """Monotonic time at or before which the next live agent's probe expires, or None.

        May be early (a lower bound kept without scanning): the pass it wakes scans and moves it.
        """
        if self._seen_floor == float("-inf"):  # not known yet: learn it (a scan that marks no one down)
            live = [a.last_seen for a in self.agents.values() if not a.down and a.last_seen]
            self._seen_floor = min(live, default=float("inf"))
        return self._seen_floor + ttl_s if self._seen_floor != float("inf") else None

    # -- resource levels ----------------------------------------------------------------------

    @property
    def bandwidth_in_use(self) -> float:
        """Sum of the rates allocated to running (not paused) transfers, bytes/s."""
        return sum(p.rate_bps for p in self.active.values() if not p.paused)

    @property
    def memory_in_use(self) -> int:
        """Cache bytes the group's live agents report."""
        return sum(a.cache_bytes for a in self.agents.values() if not a.down)

    def drop(self, p: Pending) -> None:
        """Remove ``p`` from the queue other than by a policy decision (refused, withdrawn); the
        driver then tells the policy (`SchedulingPolicy.withdrawn`)."""
        self.queue.remove(p)
        self.queue_epoch += 1

    def find(self, transfer_id: str) -> Pending | None:
        """A queued or active transfer by id."""
        p = self.active.get(transfer_id)
        if p is not None:
            return p
        return next((q for q in self.queue if q.transfer_id == transfer_id), None)
