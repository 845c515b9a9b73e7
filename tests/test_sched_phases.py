"""`kvbus bench sched`'s phase breakdown of critical transfers (``results.critical_phases``):
the sender's records joined with the receiver's arrivals on one monotonic clock."""

from __future__ import annotations

from kvbus.app.bench.sched import PHASES, phase_summary, phases


def _send(
    tid: str, t0: float, *, queued: float, encode: float, total: float, reason: str = "urgent", nbytes: int = 64_000
) -> dict:
    return {
        "transfer_id": tid,
        "t0": t0,
        "queued_s": queued,
        "encode_s": encode,
        "transfer_s": total - queued - encode,
        "total_s": total,
        "rate_bps": 32e6,
        "nbytes": nbytes,
        "reason": reason,
    }


def test_phases_add_up_to_the_total_and_skip_undelivered() -> None:
    sends = [
        _send("a", 10.0, queued=0.001, encode=0.0005, total=0.010),
        _send("b", 20.0, queued=0.0, encode=0.0005, total=0.004, reason="rate budget"),
        _send("lost", 30.0, queued=0.001, encode=0.001, total=0.005),
        _send("c", 40.0, queued=0.001, encode=0.001, total=0.5, nbytes=3_200_000),
    ]
    # Delivered at 10.008 (after 1 ms of decode), 20.003, 40.499.
    arrivals = {"a": (10.008, 0.0, 0.001), "b": (20.003, 0.0, 0.0005), "c": (40.499, 0.0, 0.001)}
    out = phases(sends, arrivals)
    assert [round(x["total"], 6) for x in out] == [10.0, 4.0, 500.0]  # "lost" never arrived: left out
    for x in out:
        assert abs(sum(x[k] for k in PHASES) - x["total"]) < 1e-6
    a, b, c = out
    assert round(a["grant_to_receiver"], 6) == 5.5  # 10.0015 -> 10.007
    assert round(a["verdict"], 6) == 2.0
    assert a["pacing"] == 0.0 and a["budget"] == 0.0  # asked for, but inline: paid after it went
    assert b["pacing"] == 0.0 and b["budget"] == 1.0  # under a rate budget: no request, no fresh bucket
    assert c["pacing"] == 100.0  # streamed (past the inline limit): 3.2 MB at 32 MB/s


def test_phase_summary_tail_is_the_slowest_transfers() -> None:
    fast = {k: 1.0 for k in ("total", *PHASES, "pacing", "budget")}
    slow = {**fast, "total": 50.0, "grant_to_receiver": 46.0}
    summary = phase_summary([[fast] * 19 + [slow]])
    assert summary["n"] == 20
    assert summary["p50"]["grant_to_receiver"] == 1.0
    assert summary["tail"]["grant_to_receiver"] == 46.0  # the slowest 5 %: one of 20
    assert summary["budget_share"] == 1.0
