"""The first transfers of a pair (issue 32): a link never measured is not assumed fast, and
exploration tries only a medium that could win. Cost model and group state, no timing.

Found on the testbed (`bench select`, 10 Mbit/s): a fresh pair's first decision assumed
``default_bandwidth_bps`` and sent 128 tokens of SmolLM2 KV in full, predicted 8 ms, in 4.9 s
(tokens: 0.3 s); and exploration sent int4 and int8 of a 1024-token context (8.1 s and 10.4 s)
where tokens took 3.3 s, because their predictions were within 2x of it."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from kvbus.bus import Bus
from kvbus.errors import ConfigError
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig
from kvbus.group_scheduler.cost_model import CostConfig, CostModel, MediumFigures
from kvbus.group_scheduler.selection import AdaptiveSelector, Exploration, default_selector
from kvbus.group_scheduler.state import GroupState
from tests.kvutil import kv_of_bytes
from tests.peer import SIG
from tests.test_bus_paths import MB
from tests.test_learning import COSTS, FIGS, cost_model
from tests.test_link_probe import _decide, _request

FAST_CODECS = {
    **FIGS,
    "int8": MediumFigures(1.95, 5.0, 5.0, 0.995, True, False),  # encode and decode at 5 GB/s
}


def _measured(state: GroupState, bps: float) -> None:
    link = state.link("a", "b")
    now = time.monotonic()
    for i in range(3):
        link.observe(int(bps), 1.0, now + i)
    assert link.known


def test_a_pair_whose_link_was_never_measured_is_not_sent_what_only_a_fast_link_allows() -> None:
    """At the default 1 GB/s a 47 MB context in full is predicted fastest (47 ms); at 10 Mbit/s it
    takes 38 s where tokens take 0.5 s. The hedge sends the medium least far from the best over the
    whole range; once the link is measured, the estimate decides alone."""
    state = GroupState("g")
    blind = AdaptiveSelector(cost_model(), candidates=tuple(FIGS), unmeasured_floor_bps=0)
    assert _decide(blind, state)["medium"] == "full"  # the old first decision
    selector = AdaptiveSelector(cost_model(), candidates=tuple(FIGS), exploration=Exploration(fraction=1.0))
    first = _decide(selector, state)
    assert first["medium"] == "tokens" and first["hedged"] and not first["explored"]
    assert first["reason"].startswith("link not measured yet: tokens is at most ")
    _measured(state, 1e9)
    later = _decide(selector, state)
    assert later["medium"] == "full" and not later["hedged"]


@pytest.mark.parametrize(
    ("hosts", "hedged"),
    [({"a": "h1", "b": "h1"}, False), ({"a": "h1", "b": "h2"}, True), ({"a": "h1"}, True), ({}, True)],
    ids=["same-host", "other-host", "receiver-unknown", "unknown"],
)
def test_a_pair_on_shared_memory_is_hedged_only_when_it_may_not_be_on_one_host(
    hosts: dict[str, str], hedged: bool
) -> None:
    """shm runs at memory speed: the default rate is the right guess there. But a sender says shm
    to a receiver it never sent to whenever its data plane allows shm (on the testbed, from host
    tx to host rx, the first transfer was predicted on shm, sent in full, and took 4.9 s)."""
    selector = AdaptiveSelector(cost_model(), candidates=tuple(FIGS))
    p = _request("shm")
    p.hosts = hosts
    selector.choose(GroupState("g"), p)
    assert p.decision["hedged"] is hedged
    assert (p.decision["medium"] == "full") is not hedged


def test_the_hedge_keeps_the_precision_refresh() -> None:
    """A context whose lineage leaves no room for another lossy hop is hedged among lossless media only."""
    m = CostModel(FIGS, config=CostConfig(refresh_threshold=0.999))
    m.default_model_costs = COSTS
    selector = AdaptiveSelector(m, candidates=("full", "int8", "int4"))
    decision = _decide(selector, GroupState("g"))
    assert decision["medium"] == "full"


def test_a_medium_whose_bytes_alone_lose_is_not_explored() -> None:
    """On a measured 30 MB/s link, tokens (0.51 s of prefill) win; int8's 24 MB take 0.8 s there,
    whatever its codec does. Its prediction (0.81 s) is within 2x of tokens', and it used to be
    explored; a compute-bound medium within the margin still is."""
    m = cost_model()
    m.figures.update(FAST_CODECS)
    selector = AdaptiveSelector(
        m, candidates=("full", "int8", "tokens"), exploration=Exploration(fraction=1.0, margin=1.0)
    )
    state = GroupState("g")
    _measured(state, 3e7)
    decisions = [_decide(selector, state) for _ in range(6)]
    assert {d["medium"] for d in decisions} == {"tokens"} and not any(d["explored"] for d in decisions)
    tokens = next(c for c in decisions[0]["candidates"] if c["medium"] == "tokens")
    int8 = next(c for c in decisions[0]["candidates"] if c["medium"] == "int8")
    assert int8["total_s"] < 2 * tokens["total_s"] < 2 * int8["terms"]["bytes_s"]
    # Where int8's cost is its codec (a slower codec on a fast link), it is measured.
    slow = cost_model()
    slow.figures["int8"] = MediumFigures(1.95, 0.5, 0.5, 0.995, True, False)
    selector = AdaptiveSelector(slow, candidates=("full", "int8"), exploration=Exploration(fraction=1.0, margin=1.0))
    state = GroupState("g")
    _measured(state, 2e8)
    explored = [d for d in (_decide(selector, state) for _ in range(4)) if d["explored"]]
    assert explored and explored[0]["medium"] == "int8"


def test_a_pair_whose_link_was_never_measured_does_not_explore() -> None:
    selector = AdaptiveSelector(cost_model(), candidates=tuple(FIGS), exploration=Exploration(fraction=1.0))
    state = GroupState("g")
    for _ in range(4):
        assert not _decide(selector, state)["explored"]


def test_the_floor_is_a_scheduler_config_key() -> None:
    assert default_selector(SchedulerConfig(unmeasured_floor_bps=0)).unmeasured_floor_bps == 0  # type: ignore[attr-defined]
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="unmeasured_floor_bps"):
            SchedulerConfig(unmeasured_floor_bps=bad)


async def test_agents_on_one_host_say_so_and_their_first_transfer_is_not_hedged(
    nats_url: str, sender_bus: Bus, scheduler: GroupScheduler
) -> None:
    """The directory record carries the data plane's host: the scheduler sees that two agents of
    one process can use shm, so their first transfer is decided at memory speed, in full."""
    tx = await sender_bus.agent(f"host-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
    rx = await sender_bus.agent(f"host-rx-{uuid.uuid4().hex[:6]}", signature=SIG)
    plane = sender_bus.plane
    assert plane is not None and plane.host
    record = await scheduler.lookup(rx.name)
    assert record is not None and record.host == plane.host
    kv = kv_of_bytes(SIG, 12 * MB, seed=3)
    receiving = asyncio.ensure_future(rx.receive(timeout=10))
    report = await tx.send(rx.name, kv)
    await receiving
    assert report.decision["path"] == "shm" and report.decision["hedged"] is False, report.decision["reason"]


def test_a_path_never_measured_takes_the_estimate_of_the_pairs_other_network_path() -> None:
    """A hedged first transfer that rode inline on NATS measured that path; the pair's first tcp
    transfer is then predicted at that rate, not hedged over rates up to 8 Gbit/s again (it went
    in full at 10 Mbit/s: 4.9 s where tokens took 0.3 s). shm is never taken from another path."""
    selector = AdaptiveSelector(cost_model(), candidates=tuple(FIGS))
    state = GroupState("g")
    _measured(state, 1.25e6)  # the NATS path
    tcp = selector.link(state, "a", "b", "tcp")
    assert tcp.bandwidth_bps == pytest.approx(1.25e6) and tcp.source == "estimate of nats"
    assert selector.link(state, "a", "b", "shm").source == "default"
    p = _request("tcp")
    selector.choose(state, p)
    assert p.decision["medium"] == "tokens" and not p.decision["hedged"]
    # The decision record says which link the prediction used, and where its rate came from.
    assert p.decision["links"] == {"b": {"path": "tcp", "source": "estimate of nats", "mbit": 10.0}}


def test_a_receiver_on_another_host_is_predicted_on_tcp_whatever_the_sender_guessed() -> None:
    """Four inline sends measured the pair's NATS link at 10 Mbit/s; the next context, too big to
    ride inline, came with the sender's guess of shm. On another host it takes tcp, which has the
    NATS link's estimate: tokens, not full at memory speed (4.9 s on the testbed)."""
    selector = AdaptiveSelector(cost_model(), candidates=tuple(FIGS))
    state = GroupState("g")
    _measured(state, 1.25e6)  # the NATS path
    p = _request("shm")
    p.hosts = {"a": "h1", "b": "h2"}
    selector.choose(state, p)
    assert p.decision["medium"] == "tokens", p.decision["reason"]
    full = next(c for c in p.decision["candidates"] if c["medium"] == "full")
    assert full["terms"]["bytes_s"] > 10  # 47 MB at 10 Mbit/s
