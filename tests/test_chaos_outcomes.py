"""The chaos benches' bookkeeping: which fault a failed transfer is counted against
(`chaos_cluster.attribute`, a pure function of fault windows and outcomes) and how a sender's
error is reported (a plain `TransferError` against a `TransferInDoubt` and its cause)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kvbus.app.bench.chaos_agents import error_fields
from kvbus.app.bench.chaos_cluster import (
    SETTLE_S,
    Cause,
    Fault,
    Outcome,
    attribute,
    causes_figures,
    cluster_figures,
    delivery_figures,
    failed_by_cause,
)
from kvbus.bus import ReceiverGone, TransferError, TransferInDoubt, TransferTimeout

RX = ["rx0", "rx1", "rx2"]


def failed(rx: str, start: float, end: float, error: str = "ReceiverGone") -> Outcome:
    return Outcome(rx, start, end, error)


def test_a_restart_of_the_transfers_own_receiver_explains_it() -> None:
    faults = [Fault(Cause.RECEIVER_RESTART, 1.0, 1.5, "rx0"), Fault(Cause.SERVER_KILL, 1.2, 3.0)]
    assert attribute(failed("rx0", 0.9, 1.1), faults) is Cause.RECEIVER_RESTART
    # Another receiver's restart explains nothing: the kill it overlaps does.
    assert attribute(failed("rx1", 0.9, 1.3), faults) is Cause.SERVER_KILL


def test_a_kill_comes_before_a_scheduler_restart_and_nothing_is_unknown_only_outside_every_window() -> None:
    faults = [Fault(Cause.SCHEDULER_RESTART, 5.0, 5.5), Fault(Cause.SERVER_KILL, 5.2, 7.0)]
    assert attribute(failed("rx0", 5.3, 5.4, "TransferTimeout"), faults) is Cause.SERVER_KILL
    assert attribute(failed("rx0", 5.0, 5.1, "TransferTimeout"), faults) is Cause.SCHEDULER_RESTART
    assert attribute(failed("rx0", 0.0, 4.9, "TransferTimeout"), faults) is Cause.UNKNOWN


def test_the_window_is_widened_by_the_settle_time_after_the_fault_only() -> None:
    kill = Fault(Cause.SERVER_KILL, 10.0, 12.0)
    assert attribute(failed("rx0", 12.0 + SETTLE_S * 0.9, 20.0), [kill]) is Cause.SERVER_KILL
    assert attribute(failed("rx0", 12.0 + SETTLE_S * 1.1, 20.0), [kill]) is Cause.UNKNOWN
    assert attribute(failed("rx0", 9.0, 9.99), [kill]) is Cause.UNKNOWN  # ended before the kill


windows = st.tuples(st.floats(0, 100), st.floats(0, 10)).map(lambda t: (t[0], t[0] + t[1]))
faults_st = st.lists(
    st.builds(
        lambda cause, w, who: Fault(cause, w[0], w[1], who if cause is Cause.RECEIVER_RESTART else ""),
        st.sampled_from([Cause.RECEIVER_RESTART, Cause.SERVER_KILL, Cause.SCHEDULER_RESTART]),
        windows,
        st.sampled_from(RX),
    ),
    max_size=12,
)
outcomes_st = st.lists(
    st.builds(
        lambda rx, w, error: Outcome(rx, w[0], w[1], error),
        st.sampled_from(RX),
        windows,
        st.sampled_from(["", "ReceiverGone", "TransferTimeout", "TransferInDoubt"]),
    ),
    max_size=30,
)


@given(outcomes_st, faults_st)
def test_every_failure_is_counted_once_against_a_fault_it_overlaps(
    outcomes: list[Outcome], faults: list[Fault]
) -> None:
    figures = causes_figures(outcomes, faults)
    assert set(figures["failed_by_cause"]) == {c.value for c in Cause}
    assert sum(figures["failed_by_cause"].values()) == sum(1 for o in outcomes if o.failed)
    for o in outcomes:
        cause = attribute(o, faults)
        mine = [f for f in faults if (not f.who or f.who == o.receiver) and f.touches(o.start, o.end)]
        if cause is Cause.UNKNOWN:
            assert not mine  # unknown only when no fault that may affect it overlaps it
        else:
            assert any(f.cause is cause for f in mine)
            # No fault earlier in the order explains it.
            earlier = {Cause.RECEIVER_RESTART: set(), Cause.SERVER_KILL: {Cause.RECEIVER_RESTART}}
            assert not any(f.cause in earlier.get(cause, {Cause.RECEIVER_RESTART, Cause.SERVER_KILL}) for f in mine)


@given(outcomes_st)
def test_without_faults_every_failure_is_unknown(outcomes: list[Outcome]) -> None:
    table = failed_by_cause(outcomes, [])
    assert sum(table[Cause.UNKNOWN].values()) == sum(1 for o in outcomes if o.failed)


def test_cluster_figures_split_the_transfers_at_the_failovers() -> None:
    kill = Fault(Cause.SERVER_KILL, 10.0, 11.0)
    restart = Fault(Cause.RECEIVER_RESTART, 10.2, 10.4, "rx1")
    outcomes = [
        Outcome("rx0", 9.5, 10.5),  # during the failover, delivered
        Outcome("rx1", 10.1, 10.3, "ReceiverGone"),  # during, its receiver restarted
        Outcome("rx0", 10.5, 14.0, "TransferTimeout"),  # during, the kill's
        Outcome("rx0", 20.0, 20.1),  # without
        Outcome("rx2", 1.0, 1.2, "TransferRejected"),  # without: unknown
    ]
    failovers: list[dict[str, Any]] = [{"server": "n1"}]
    r = cluster_figures(3, outcomes, [kill, restart], [(0.1, 0.2)], failovers)
    assert r["server_kills"] == 1 and r["transfers_during_failover"] == 3
    assert r["transfer_p99_without_failover_ms"] == 200.0
    assert failovers[0]["transfers"] == 3 and failovers[0]["failed"] == 2 and failovers[0]["failed_server_kill"] == 1
    assert causes_figures(outcomes, [kill, restart])["failed_by_cause"] == {
        "receiver_restart": 1,
        "server_kill": 1,
        "scheduler_restart": 0,
        "unknown": 1,
    }


def test_a_sender_reports_in_doubt_with_its_cause_and_a_plain_error_without() -> None:
    plain = ReceiverGone("t1", "rx0")
    assert error_fields(plain) == {"error": "ReceiverGone", "cause": ""}
    doubt = TransferInDoubt(TransferTimeout("t2", "streaming", 3.0, "rx0"))
    assert error_fields(doubt) == {"error": "TransferInDoubt", "cause": "TransferTimeout"}
    assert error_fields(TransferError("t3", "no path")) == {"error": "TransferError", "cause": ""}


def test_a_delivered_in_doubt_transfer_is_not_a_wrong_answer_and_a_delivered_plain_error_is() -> None:
    outcomes = [
        Outcome("rx0", 0, 1, tid="ok"),
        Outcome("rx0", 0, 1, "TransferInDoubt", "TransferTimeout", tid="doubt-had"),
        Outcome("rx0", 0, 1, "TransferInDoubt", "ReceiverGone", tid="doubt-not"),
        Outcome("rx0", 0, 1, "TransferTimeout", tid="plain-had"),
        Outcome("rx0", 0, 1, "ReceiverGone", tid="plain-not"),
    ]
    sent = {o.tid: ("rx0", "d") for o in outcomes}
    deliveries = [("rx0", tid, "d") for tid in ("ok", "doubt-had", "plain-had")]
    r = delivery_figures(outcomes, deliveries, sent, {"ok"})
    assert r["delivered"] == 1 and r["failed_with_error"] == 4 and r["lost"] == 0 and r["corrupted"] == 0
    assert r["delivered_after_sender_error"] == 1  # plain-had: the sender was told nothing arrived
    assert r["in_doubt"] == 2 and r["in_doubt_delivered"] == 1
    assert r["in_doubt_causes"] == {"TransferTimeout": 1, "ReceiverGone": 1}
