"""What a link that changes teaches the selector (issue 32): a link that slowed down is not read as
a fixed cost, a ``tokens`` transfer is predicted on the path it takes, and a pair whose link dropped
probes it again, with back-off, until it sees it recover. Cost model and group state only (the
loop that feeds them is exercised by tests/test_learning.py against a real scheduler)."""

from __future__ import annotations

import itertools
import time

import pytest

from kvbus.group_scheduler.learning import SMALL_PAYLOAD_BYTES, LearnedCosts
from kvbus.group_scheduler.selection import PROBE_PAD_BYTES, AdaptiveSelector, Exploration
from kvbus.group_scheduler.state import RISK_PRIOR_SAMPLES, GroupState, LinkEstimate, Pending
from kvbus.protocol import TransferDone, TransferRequest
from tests.test_learning import FIGS, KV_BYTES, SMOL, N, choose, cost_model

FAST, SLOW = 1e9, 1e6
"""Bytes/s of the link before and after it drops."""


def _request(path: str = "", inline_limit: int = 0) -> Pending:
    req = TransferRequest(
        transfer_id=f"t{time.monotonic_ns()}",
        src="a",
        dst=["b"],
        group="g",
        n_tokens=N,
        nbytes=KV_BYTES,
        signature=SMOL.to_dict(),
        path=path,
        inline_limit=inline_limit,
    )
    return Pending(req, {"b": SMOL}, arrived=time.monotonic())


def test_a_link_that_slowed_down_is_not_learned_as_a_fixed_cost() -> None:
    """An int8 transfer predicted at 25 ms of bytes on a link thought fast took 1 s: the link fell.
    It once taught a fixed cost of 0.98 s per transfer, which every tokens transfer then paid."""
    learned = LearnedCosts()
    record = choose(cost_model(), "int8").record()  # type: ignore[attr-defined]
    slowed = TransferDone("t", "a", True, "int8", 3 << 20, 1.0, dst=["b"], wire_s=1.0, path="tcp")
    learned.observe_transfer(slowed, record, kv_bytes=KV_BYTES, new_tokens=N, bandwidth_bps=1.25e8)
    assert learned.fixed("tcp") is None
    # A payload too small to tell the link is what teaches the fixed cost, with its bytes' time off.
    small = TransferDone("t", "a", True, "tokens", 8 * N, 0.01, dst=["b"], wire_s=0.004, path="tcp")
    learned.observe_transfer(small, record, kv_bytes=KV_BYTES, new_tokens=N, bandwidth_bps=1.25e8)
    assert learned.fixed("tcp") == pytest.approx(0.004 - 8 * N / 1.25e8)
    assert 8 * N < SMALL_PAYLOAD_BYTES <= 3 << 20


@pytest.mark.parametrize("inline_limit", [2 << 20, 0], ids=["inline-limit-known", "unknown"])
def test_tokens_of_a_context_that_goes_direct_are_predicted_on_nats(inline_limit: int) -> None:
    """A context big enough for the direct path (``path`` tcp) sent as tokens rides in the Open over
    NATS: its fixed cost and link are NATS's, not tcp's (when the sender says its inline limit)."""
    m = cost_model()
    m.learned.observe_fixed("tcp", 0.5)
    m.learned.observe_fixed("nats", 0.002)
    selector = AdaptiveSelector(m, candidates=("tokens",), exploration=Exploration(fraction=0.0))
    p = _request("tcp", inline_limit)
    selector.choose(GroupState("g"), p)
    tokens = next(c for c in p.decision["candidates"] if c["medium"] == "tokens")
    fixed = tokens["terms"]["fixed_s"]
    if inline_limit:
        assert fixed < 0.01
    else:
        assert fixed >= 0.5


def _dropped(state: GroupState) -> LinkEstimate:
    link = state.link("a", "b")
    now = time.monotonic()
    for i in range(3):
        link.observe(int(FAST), 1.0, now + i)
    link.observe(int(SLOW), 1.0, now + 3)  # one transfer 1000x slower: the window restarts
    assert link.bandwidth_bps == pytest.approx(SLOW) and link.peak_bps == pytest.approx(FAST)
    return link


def _decide(selector: AdaptiveSelector, state: GroupState) -> dict:
    p = _request()
    selector.choose(state, p)
    return p.decision


def test_a_pair_whose_link_dropped_probes_it_and_switches_back_when_it_recovered() -> None:
    m = cost_model()
    selector = AdaptiveSelector(m, candidates=tuple(FIGS), exploration=Exploration(fraction=1.0, link_every=2))
    state = GroupState("g")
    link = _dropped(state)
    first, second = _decide(selector, state), _decide(selector, state)
    assert first["medium"] == "tokens" and not first["explored"]  # the link is slow: tokens
    assert second["explored_link"] and second["explored"], second["reason"]
    probe = next(c for c in second["candidates"] if c["medium"] == second["medium"])
    assert probe["bytes"] >= SMALL_PAYLOAD_BYTES and second["reason"].startswith("probe the link: ")
    # The probe is the ids padded (a KV medium's bytes at the slow rate would cost seconds).
    assert second["medium"] == f"tokens({PROBE_PAD_BYTES})"
    tokens = next(c for c in second["candidates"] if c["medium"] == "tokens")
    assert probe["comm_s"] - tokens["comm_s"] == pytest.approx(PROBE_PAD_BYTES / SLOW)
    kv = min(
        (c for c in second["candidates"] if c["bytes"] >= SMALL_PAYLOAD_BYTES and c is not probe),
        key=lambda c: c["total_s"],
    )
    assert probe["total_s"] < kv["total_s"] / 10
    # The probe saw the link back at its old rate: one probe sample is enough to move the estimate.
    link.observe(int(FAST), 1.0, time.monotonic() + 4, probe=True)
    assert link.bandwidth_bps == pytest.approx(FAST)
    # Priced at the estimate alone, the recovered link gets KV again at once (the drop risk is
    # what `test_a_link_that_dropped_is_priced_with_its_risk_until_steady_samples_outweigh_it` covers).
    plain = AdaptiveSelector(m, candidates=tuple(FIGS), exploration=Exploration(fraction=0.0), drop_risk=False)
    assert _decide(plain, state)["medium"] not in ("tokens", "summary")


def test_a_link_that_dropped_is_priced_with_its_risk_until_steady_samples_outweigh_it() -> None:
    """One transfer in four found the link 1000x slower: the next is expected to with a risk of
    1/(5 + RISK_PRIOR_SAMPLES) after a recovery, and its bytes are priced so; the selector probes the
    steady link (back-off) and goes back to KV once steady samples outweigh the drop."""
    m = cost_model()
    selector = AdaptiveSelector(m, candidates=tuple(FIGS), exploration=Exploration(fraction=1.0, link_every=2))
    state = GroupState("g")
    link = _dropped(state)
    now = time.monotonic()
    link.observe(int(FAST), 1.0, now + 4, probe=True)
    p, slow = link.drop_risk(now + 4)
    assert p == pytest.approx(1 / (5 + RISK_PRIOR_SAMPLES), rel=1e-2) and slow == pytest.approx(SLOW)
    first = _decide(selector, state)
    assert first["medium"] == "tokens"
    full = next(c for c in first["candidates"] if c["medium"] == "full")
    bytes_s = full["terms"]["bytes_s"]
    assert bytes_s == pytest.approx(full["bytes"] * ((1 - p) / FAST + p / SLOW), rel=0.02)
    media, reasons = [], []
    for i in range(200):
        d = _decide(selector, state)
        media.append(d["medium"])
        reasons.append(d["reason"])
        if d["medium"] != "tokens":  # the transfer measures the link: steady
            link.observe(int(FAST), 1.0, now + 5 + i)
        if d["medium"] == "full":
            break
    assert any(r.startswith("explore the link: ") and "risk of drops" in r for r in reasons), reasons
    assert media[-1] == "full", media
    assert link.drop_risk(now + 5 + i)[0] < p


def test_a_link_that_stays_slow_is_probed_ever_less_often() -> None:
    m = cost_model()
    selector = AdaptiveSelector(m, candidates=tuple(FIGS), exploration=Exploration(fraction=1.0, link_every=2))
    state = GroupState("g")
    link = _dropped(state)
    probes = []
    for i in range(40):
        d = _decide(selector, state)
        if d["explored_link"]:
            probes.append(i)
            link.observe(int(SLOW), 1.0, time.monotonic() + 5 + i, probe=True)  # still slow
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert len(probes) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0], probes
    # Never for a pair whose link never dropped (nothing suggests it could be faster).
    fresh = GroupState("g")
    fresh.link("a", "b").observe(int(SLOW), 1.0)
    assert not any(_decide(selector, fresh)["explored_link"] for _ in range(10))


def test_an_unconfirmed_rise_without_a_probe_still_needs_a_second_sample() -> None:
    link = LinkEstimate()
    now = time.monotonic()
    link.observe(int(SLOW), 1.0, now)
    link.observe(int(FAST), 1.0, now + 1)
    assert link.rising and link.bandwidth_bps < 0.9 * FAST
    link.observe(int(FAST), 1.0, now + 2)
    assert not link.rising and link.bandwidth_bps == pytest.approx(FAST) and link.changes == 1


def test_a_padded_probe_that_costs_little_keeps_its_pace() -> None:
    """On a link slow enough for tokens but not so slow that 64 KiB of padding weighs on a
    transfer (at most PROBE_SHARE of it), the probe does not back off: a link that comes back is
    seen within `link_every` transfers, however long it was down."""
    m = cost_model()
    selector = AdaptiveSelector(m, candidates=tuple(FIGS), exploration=Exploration(fraction=1.0, link_every=2))
    state = GroupState("g")
    link = state.link("a", "b")
    now = time.monotonic()
    for i in range(3):
        link.observe(int(FAST), 1.0, now + i)
    slow = 2e7  # 160 Mbit/s: 3 ms of padding
    link.observe(int(slow), 1.0, now + 3)
    probes = []
    for i in range(40):
        d = _decide(selector, state)
        if d["explored_link"]:
            probes.append(i)
            assert d["medium"] == f"tokens({PROBE_PAD_BYTES})", d["reason"]
            link.observe(int(slow), 1.0, time.monotonic() + 5 + i, probe=True)  # still slow
        else:
            assert d["medium"] == "tokens", d["reason"]
    gaps = {b - a for a, b in itertools.pairwise(probes)}
    assert len(probes) >= 10 and gaps == {2}, probes
