"""Settings of a group scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbus.config import from_env
from kvbus.errors import ConfigError
from kvbus.group_scheduler.preemption import DEFAULT_RATIO, DEFAULT_THRESHOLD
from kvbus.group_scheduler.reservations import DEFAULT_HEADROOM, DEFAULT_RESERVABLE_FRACTION
from kvbus.group_scheduler.weights import (
    DEFAULT_ALPHA,
    DEFAULT_BASE,
    DEFAULT_BETA,
    DEFAULT_CRITICAL_BOOST,
    DEFAULT_DEADLINE_BOOST,
    DEFAULT_DEADLINE_HORIZON_S,
    DEFAULT_MAX_DELAY_S,
)
from kvbus.protocol.messages import MAX_BUDGET_S

DEFAULT_TICK_S = 0.010
MIN_TICK_S = 0.005
MAX_TICK_S = 0.020


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Override any field with ``KVBUS_SCHEDULER_<FIELD>``."""

    policy: str = "wrr"
    """Scheduling policy: ``wrr`` (weighted round robin, max-min rates, preemption, reservations), ``fifo``
    or ``strict`` (critical before bulk, no weights)."""
    bandwidth_bps: float = 0.0
    """The group's bandwidth budget in bytes/s (0 = unlimited)."""
    max_active: int = 8
    """Transfers running at once in the group (urgent and reserved ones may go beyond it)."""
    per_pair: int = 1
    """Ordinary transfers running at once per (sender, receivers) pair (``wrr``)."""
    tick_s: float = DEFAULT_TICK_S
    """Time slice of the scheduling loop (5-20 ms); the loop sleeps when nothing changes."""
    transfer_timeout: float = 300.0
    """A granted transfer that reports nothing for this long is dropped from the active set."""
    budget_s: float = 1.0
    """Seconds a small transfer's grant stays its sender's as a rate budget (`Grant.budget_s`):
    the next small transfers to the same receivers start without a grant round trip, at the
    granted rate, in the pair's slot (0: every transfer asks)."""
    budget_max_bytes: int = 2 << 20
    """Largest context a transfer may carry to get, or run under, a rate budget."""
    probe_ttl_s: float = 15.0
    """An agent with no probe for this long is marked down and its queued transfers are refused
    (generous: a busy agent on a loaded machine may miss a few probe intervals)."""
    heartbeat_s: float = 2.0
    """Seconds between announcements to the coordinator."""
    directory_ttl: float = 2.0
    """Seconds a directory lookup is cached (when the directory watch is not running)."""
    directory_watch_ttl: float = 30.0
    """Seconds an entry kept current by the directory watch is trusted without a lookup (a
    bound on staleness should the watch stall unnoticed)."""
    # -- what one request may cost ------------------------------------------------------------
    max_receivers: int = 256
    """Most receivers one request may name; more is refused at once with `Reason.TOO_LARGE`."""
    lookup_batch: int = 16
    """Most directory lookups one request may cause (its names the cache does not know, looked up
    together in one batch); a request with more unknown names is refused without any lookup."""
    admit_timeout_s: float = 1.0
    """Longest the directory lookups of one request may take; then it is refused with
    `Reason.UNAVAILABLE` (other requests are admitted meanwhile: a request waiting for its
    lookups never holds up the others)."""
    max_admitting: int = 64
    """Requests that may wait for directory lookups at once; more are refused with `Reason.UNAVAILABLE`."""
    selector: str = "adaptive"
    """How media are chosen: ``adaptive`` (the cost model) or ``static`` (requested, else full/tokens)."""
    hysteresis: float = 0.15
    """A pair switches medium only if the new one is predicted at least this much faster."""
    default_bandwidth_bps: float = 1e9
    """Bandwidth assumed for a pair with no observation and no declared capacity."""
    default_shm_bandwidth_bps: float = 3e9
    """The same for the ``shm`` path (two agents of one host), which runs at memory speed:
    `kvbus bench transport` measured 3.6 GB/s at 64 MB and 5.6 GB/s at 512 MB on a 2-core
    machine. Assumed at ``default_bandwidth_bps``, the cost model sends a 2048-token SmolLM2
    context between two agents of one host in int8 (fidelity lost for nothing); at this rate, in
    full."""
    unmeasured_floor_bps: float = 1.25e6
    """The slowest a pair's link with no observation and no declared capacity is assumed to be
    (bytes/s; 1.25e6 = 10 Mbit/s): its first transfer is sent with the medium least far from the
    best at every rate between this and ``default_bandwidth_bps`` (0 = the default rate only)."""
    explore_fraction: float = 0.1
    """Most adaptive decisions that may explore (send a medium to measure it), as a share; 0 = never."""
    explore_margin: float = 1.0
    """A medium is explored only if it would beat the chosen one with its compute (encode, decode,
    recompute) this much faster than predicted (1.0: twice as fast); its bytes over a measured link
    count as predicted."""
    explore_min_samples: int = 3
    """A medium measured fewer times than this at a context size is explored there."""
    explore_stale_s: float = 600.0
    """A medium not measured for this long at a context size is explored again."""
    explore_link_every: int = 2
    """A pair whose link estimate dropped, and whose transfers since carry too few bytes to measure
    it again (``tokens``), is probed with a KV medium after this many such decisions, then after
    twice as many each time the link is still slow (0 = never probed)."""
    link_drop_risk: bool = True
    """Predict a link that has dropped lately as one that may drop again: a transfer's bytes are
    expected at the slow rate with the probability its recent transfers met it
    (`LinkEstimate.drop_risk`); False: at the current estimate only."""
    learned_save_s: float = 5.0
    """Seconds between writes of what the scheduler learned to JetStream KV (0 = never persisted)."""
    # -- weights: W_ij = role_priority_i + role_priority_j + urgency ----------------------------
    urgency_base: float = DEFAULT_BASE
    """Urgency every transfer has."""
    urgency_alpha: float = DEFAULT_ALPHA
    """Scale of the queue-delay term alpha * exp(beta * queue_delay)."""
    urgency_beta: float = DEFAULT_BETA
    """Growth of the queue-delay term per second of waiting."""
    urgency_max_delay_s: float = DEFAULT_MAX_DELAY_S
    """Queue delay beyond which urgency stops growing."""
    deadline_boost: float = DEFAULT_DEADLINE_BOOST
    """Urgency added at a transfer's deadline (less the further away it is)."""
    deadline_horizon_s: float = DEFAULT_DEADLINE_HORIZON_S
    """Scale of how far ahead a deadline starts to raise urgency."""
    critical_boost: float = DEFAULT_CRITICAL_BOOST
    """Urgency added for a critical transfer."""
    # -- preemption -----------------------------------------------------------------------------
    preempt: bool = True
    """Whether urgent transfers pause running ones (``wrr``)."""
    preempt_ratio: float = DEFAULT_RATIO
    """A transfer outranks a running one when its urgency is this many times larger."""
    preempt_threshold: float = DEFAULT_THRESHOLD
    """Only transfers that have sent less than this share of their bytes are paused."""
    preempt_min_bytes: int = 1 << 20
    """Smaller urgent transfers pause nothing: they are over before a pause takes effect."""
    max_pause_s: float = 10.0
    """A paused transfer resumes after this long regardless (keep it below the receivers' partial_timeout)."""
    rate_epsilon: float = 0.05
    """A running transfer is told a new rate only when it changes by more than this fraction."""
    # -- reservations ---------------------------------------------------------------------------
    admission: str = "local"
    """Who admits reservations: ``local`` (the group's own budget) or ``coordinator`` (that, and
    then the deployment's reservation table)."""
    reservable_fraction: float = DEFAULT_RESERVABLE_FRACTION
    """Share of the group budget (and of each agent's link) that reservations may take."""
    reservation_headroom: float = DEFAULT_HEADROOM
    """A reservation gets this times size/deadline (room for round trips and encode)."""
    reservation_lead_s: float = 0.02
    """How long before an expected instance of a reservation its bandwidth is set aside."""
    # -- replicas and the coordinator ------------------------------------------------------------
    leader_ttl_s: float = 3.0
    """Replicas of a group elect a leader by a lease (key ``sched.<group>`` in the coordinator's
    bucket); a standby takes over when the leader has not renewed for this long. 0 = no election
    (every replica serves, sharing the subjects in a NATS queue group)."""
    lease_priority: float = 1.0
    """The group's weight in the coordinator's max-min split of the inter-group capacity."""
    coordinator_timeout_s: float = 0.5
    """How long a lease request waits for the coordinator before the group falls back."""
    # -- memory hints ---------------------------------------------------------------------------
    memory_watermark_bytes: int = 0
    """Cache bytes above which an agent is told to shed (0 = no hints unless set per agent)."""
    memory_watermarks: str = ""
    """Per-agent watermarks, ``name=bytes,name=bytes`` (overrides the default for those agents)."""
    shed_target: float = 0.8
    """A shed hint asks the agent to go down to this share of its watermark."""
    shed_interval_s: float = 5.0
    """At most one shed hint per agent in this many seconds."""

    def __post_init__(self) -> None:
        if not MIN_TICK_S <= self.tick_s <= MAX_TICK_S:
            raise ConfigError(
                f"tick_s {self.tick_s} must be within {MIN_TICK_S * 1000:.0f}..{MAX_TICK_S * 1000:.0f} ms"
            )
        if self.max_active < 1 or self.per_pair < 1:
            raise ConfigError("max_active and per_pair must be at least 1")
        if self.selector not in ("adaptive", "static"):
            raise ConfigError(f"selector {self.selector!r} must be 'adaptive' or 'static'")
        if not 0 <= self.explore_fraction <= 1 or not 0 <= self.explore_margin < float("inf"):
            raise ConfigError(
                f"explore_fraction {self.explore_fraction} must be within 0..1, explore_margin "
                f"{self.explore_margin} a finite number >= 0"
            )
        if not 0 < self.default_shm_bandwidth_bps < float("inf"):
            raise ConfigError(
                f"default_shm_bandwidth_bps {self.default_shm_bandwidth_bps} must be a finite rate > 0 (bytes/s)"
            )
        if not 0 <= self.unmeasured_floor_bps < float("inf"):
            raise ConfigError(f"unmeasured_floor_bps {self.unmeasured_floor_bps} must be a finite rate >= 0 (bytes/s)")
        if self.explore_link_every < 0:
            raise ConfigError(f"explore_link_every {self.explore_link_every} must be >= 0 (0: never probe)")
        if self.explore_min_samples < 0 or not 0 < self.explore_stale_s < float("inf"):
            raise ConfigError("explore_min_samples must be >= 0 and explore_stale_s a positive number of seconds")
        if not 0 <= self.learned_save_s < float("inf"):
            raise ConfigError(f"learned_save_s {self.learned_save_s} must be a finite number of seconds >= 0")
        if not 0 <= self.hysteresis < 1:
            raise ConfigError(f"hysteresis {self.hysteresis} must be in [0, 1)")
        if self.probe_ttl_s <= 0:
            raise ConfigError("probe_ttl_s must be positive")
        if self.max_receivers < 1 or self.lookup_batch < 1 or self.max_admitting < 1:
            raise ConfigError("max_receivers, lookup_batch and max_admitting must be at least 1")
        if not 0 < self.admit_timeout_s < float("inf"):
            raise ConfigError(f"admit_timeout_s {self.admit_timeout_s} must be a positive number of seconds")
        if not 0 <= self.preempt_threshold <= 1:
            raise ConfigError(f"preempt_threshold {self.preempt_threshold} must be within 0..1")
        if self.preempt_ratio <= 1:
            raise ConfigError(f"preempt_ratio {self.preempt_ratio} must be above 1")
        if self.admission not in ("local", "coordinator"):
            raise ConfigError(f"admission {self.admission!r} must be 'local' or 'coordinator'")
        if not 0 < self.reservable_fraction <= 1:
            raise ConfigError("reservable_fraction must be in (0, 1]")
        if self.reservation_headroom < 1:
            raise ConfigError("reservation_headroom must be at least 1")
        if not 0 < self.shed_target <= 1:
            raise ConfigError("shed_target must be in (0, 1]")
        if self.bandwidth_bps < 0 or self.memory_watermark_bytes < 0:
            raise ConfigError("bandwidth_bps and memory_watermark_bytes must not be negative")
        if not 0 <= self.budget_s <= MAX_BUDGET_S or self.budget_max_bytes < 0:
            raise ConfigError(f"budget_s must be within 0..{MAX_BUDGET_S:g}, budget_max_bytes not negative")
        if self.leader_ttl_s < 0 or self.lease_priority <= 0 or self.coordinator_timeout_s <= 0:
            raise ConfigError("leader_ttl_s must be >= 0, lease_priority and coordinator_timeout_s positive")
        self.watermarks()  # validates the per-agent table

    def watermarks(self) -> dict[str, int]:
        """The per-agent watermark table parsed from `memory_watermarks`.

        Raises:
            ConfigError: an entry is not ``name=bytes``.
        """
        out: dict[str, int] = {}
        for item in filter(None, (x.strip() for x in self.memory_watermarks.split(","))):
            name, sep, value = item.partition("=")
            try:
                if not sep or not name.strip():
                    raise ValueError(item)
                out[name.strip()] = int(float(value))
            except ValueError:
                raise ConfigError(f"memory_watermarks entry {item!r} is not name=bytes") from None
        return out

    @classmethod
    def from_env(cls, **overrides: Any) -> SchedulerConfig:
        """The defaults, overridden by ``KVBUS_SCHEDULER_<FIELD>`` variables, then by ``overrides``."""
        return from_env(cls, "scheduler", **overrides)
