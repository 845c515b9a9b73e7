"""`kvbus bench agents`: a team of vLLM engines on one task, against what vLLM users do today.

Four SmolLM2 engines (vLLM CPU, float32, one OpenMP thread each), each its own process and its
own kvbus agent: a planner, two executors and a verifier (see `kvbus.app.bench.agents_team` for
the workflow). Arms, interleaved in every round:

- (a) ``prefix_cached_text``: vLLM's prefix caching on, contexts handed over as text (what a vLLM
  user runs today; kvbus off for these requests);
- (b) ``no_prefix_cache_text``: the same with vLLM's prefix cache defeated;
- (c) ``kvbus_adaptive``: hand-offs through `KVBusConnector`, the medium the cost model's;
- (d) ``kvbus_full``, ``kvbus_int8``, ``kvbus_int4``: the same with the medium fixed.

A kvbus arm's engines keep what they loaded in their kvbus store, so two kvbus arms on the same
documents would serve each other. Each kvbus arm therefore gets documents of its own in every
round, and arm (a) runs on each of them too: every kvbus figure is a ratio to arm (a) on the
same documents in the same round (arm (b) shares the adaptive arm's documents).

Figures (medians over rounds of per-round ratios, with [min-max]): ``results.e2e_vs_prefix_cached_text``
(per arm; the headline is ``kvbus_adaptive``, goal <= 0.6), ``ttft_vs_prefix_cached_text`` (the
hand-offs' median TTFT over arm (a)'s, keyed by document tokens, goal <= 0.25 at 2048),
``agreement_vs_prefix_cached_text`` (greedy tokens, token by token, with arm (a)'s, per medium:
goal >= 0.98 lossless, >= 0.95 int8), ``adaptive_vs_best_fixed`` (adaptive's E2E ratio over the
best fixed medium's, goal <= 1.0); per arm ``arms[name]``: E2E, TTFT per hand-off p50/p99,
bytes moved, agreement, task score (executors' continuations of passages of the documents,
exact match of the next tokens).
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvbus.app.bench.agents_team import (
    ADAPTIVE,
    FIXED,
    GROUP,
    LOSSLESS,
    NO_PREFIX_CACHE_TEXT,
    PREFIX_CACHED_TEXT,
    Arm,
    Lengths,
    Team,
    Workflow,
    docset,
    run_workflow,
)
from kvbus.app.bench.rounds import FULL_ROUNDS, pct, ratio, spread

KVBUS_ARMS: tuple[Arm, ...] = (ADAPTIVE, *FIXED)

NOTES = {
    "prefix_cache": (
        "All arms share one set of four engines (two sets would be eight processes on two cores), "
        "started with vLLM's prefix caching on for arm (a). vLLM keys its prefix cache by the "
        "request's cache_salt: arm (a) gives every request of a workflow the same salt (a new one "
        "per workflow, so that nothing of another round or arm is reused), arm (b) a new salt per "
        "request, which defeats the cache as prefix caching off would. The kvbus arms also take a "
        "new salt per request (and the workflow's tenant, kv_transfer_params kvbus_tenant, which "
        "keys kvbus in place of the salt), so that whatever an engine does not prefill comes through kvbus "
        "(its own earlier turns from its kvbus store, the others' context by push or pull), not "
        "from vLLM's cache: the kvbus figures are kvbus alone, a conservative choice (kvbus with "
        "vLLM's cache on would reload an engine's own history faster)."
    ),
    "documents": (
        "Each kvbus arm has documents of its own in each round (its engines' kvbus stores would "
        "otherwise hold what the kvbus arm before it loaded), and arm (a) runs on each of them: a "
        "kvbus arm's ratios are to arm (a) on the same documents in the same round."
    ),
    "handoff": (
        "In the kvbus arms the planner's request pushes its context to both executors while it "
        "writes the plan; the executors start once both stored it (the wait counts in E2E). The "
        "verifier and the next turn's planner pull what they lack (the connector's pull gate may "
        "decline a pull predicted slower than the prefill). Engines' lookup_timeout_s is 10 s."
    ),
    "memory": (
        "Each engine's kvbus block store is 512 MiB and its codec arena pool 256 MiB "
        "(agents_team.STORE_BYTES, ARENA_POOL_MB; the defaults are 1 GiB each): with the defaults "
        "the four engine workers of a full run grew to 4.7-5.9 GB each and the 24 GiB machine ran "
        "out of memory in the second round. A store that fills drops its least recently used "
        "blocks (no Redis here), which the workflow does not reuse: each kvbus arm has documents "
        "of its own."
    ),
    "text_arms": "Arms (a) and (b) send kvbus_off: the connector neither loads, saves nor pushes for them.",
    "task": (
        "Each executor is asked to continue a passage that occurs once in the documents; the score "
        "is the fraction of answers whose first tokens are the documents' next tokens."
    ),
}


def _agreement(ref: Workflow, wf: Workflow) -> tuple[float, float | None, int]:
    """Token-by-token agreement of ``wf``'s calls with ``ref``'s (all calls; calls whose prompt was the same)."""
    total = same = 0
    agree = agree_same = 0
    for a, b in zip(ref.calls, wf.calls):
        n = len(a.tokens)
        k = sum(1 for x, y in zip(a.tokens, b.tokens) if x == y)
        total, agree = total + n, agree + k
        if a.prompt_hash == b.prompt_hash:
            same, agree_same = same + n, agree_same + k
    return (agree / total if total else 1.0), (agree_same / same if same else None), same


def _call_agreement(ref: Workflow | None, wf: Workflow, i: int) -> float | None:
    """Agreement of call ``i`` of ``wf`` with arm (a)'s call ``i`` on the same documents (None: no such call)."""
    if ref is None or i >= len(ref.calls) or not ref.calls[i].tokens:
        return None
    a, b = ref.calls[i].tokens, wf.calls[i].tokens
    return round(sum(1 for x, y in zip(a, b) if x == y) / len(a), 4)


def _handoff_ttfts(wf: Workflow) -> list[float]:
    return [c.ttft_s for c in wf.calls if c.handoff and c.ttft_s is not None]


def _round_order(r: int) -> list[tuple[Arm, int]]:
    """The workflows of round ``r``: (arm, index of its documents), interleaved and rotated by round."""
    arms = KVBUS_ARMS[r % len(KVBUS_ARMS) :] + KVBUS_ARMS[: r % len(KVBUS_ARMS)]
    order: list[tuple[Arm, int]] = []
    for j, arm in enumerate(arms):
        k = KVBUS_ARMS.index(arm)
        pair = [(PREFIX_CACHED_TEXT, k), (arm, k)]
        if (r + j) % 2:
            pair.reverse()
        order += pair
        if arm is ADAPTIVE:
            order.insert(len(order) - 1 if r % 2 else len(order), (NO_PREFIX_CACHE_TEXT, k))
    return order


def run(
    *,
    quick: bool = False,
    smoke: bool = False,
    nats_url: str | None = None,
    rounds: int | None = None,
    doc_tokens: int | None = None,
    turns: int | None = None,
    **_: Any,
) -> dict[str, Any]:
    """Run the suite (see the module docstring); starts its own nats-server unless ``nats_url``."""
    import tempfile

    from kvbus.app.local import NatsServer
    from kvbus.group_scheduler import GroupScheduler
    from kvbus.integrations.vllm import KVBusControl
    from kvbus.integrations.vllm.loop import LoopThread

    quick = quick or smoke
    rounds = rounds or (1 if quick else FULL_ROUNDS)
    doc_tokens = doc_tokens or (256 if smoke else 512 if quick else 2048)
    turns = turns or 2
    lengths = Lengths(4, 4, 4) if smoke else Lengths(plan=8, answer=6, verdict=6) if quick else Lengths()
    server = None if nats_url else NatsServer().start()
    url = nats_url or server.url  # type: ignore[union-attr]
    logs = Path(tempfile.mkdtemp(prefix="kvbus-bench-agents-"))
    loop = LoopThread(name="kvbus-bench-agents-scheduler")
    sched = loop.run(GroupScheduler.connect(url, GROUP), timeout=30)
    team = Team(url, logs)
    ctl = None
    flows: list[dict[str, Any]] = []  # {"round", "docs", "wf"}
    started_s = 0.0
    ok = False
    try:
        t0 = time.perf_counter()
        team.start()
        started_s = time.perf_counter() - t0
        print(f"4 engines up in {started_s:.0f} s (logs in {logs})", file=sys.stderr, flush=True)
        ctl = KVBusControl(url)
        ctl.watch()
        # Warm-up on short documents of their own: every engine's first requests, pushes, pulls
        # and each medium's first encode are slower; none of it is recorded.
        for n, arm in enumerate((PREFIX_CACHED_TEXT, *KVBUS_ARMS[: 0 if smoke else 1 if quick else None])):
            run_workflow(team, ctl, arm, docset(256, 50_000 + 997 * n, 1), Lengths(4, 4, 4), f"warm{n}")
        for r in range(rounds):
            sets = [docset(doc_tokens, 1009 * (len(KVBUS_ARMS) * r + k) + 37, turns) for k in range(len(KVBUS_ARMS))]
            for arm, k in _round_order(r):
                wf = run_workflow(team, ctl, arm, sets[k], lengths, f"r{r}-{arm.name}")
                flows.append({"round": r, "docs": k, "wf": wf})
                print(
                    f"round {r} {arm.name:22s} docs {k}: e2e {wf.e2e_s:6.2f} s, handoff ttft p50 "
                    f"{_p(_handoff_ttfts(wf), 0.5)}, bytes {wf.nbytes}, score {wf.score()}, "
                    f"media {sorted(set(wf.media))}",
                    file=sys.stderr,
                    flush=True,
                )
        ok = True
    finally:
        if ctl is not None:
            ctl.close()
        team.close()
        loop.run(sched.close(), timeout=10)
        loop.stop()
        if server is not None:
            server.stop()
        # The engines' logs are what explains a failed run; a run that succeeded leaves nothing behind.
        if ok:
            shutil.rmtree(logs, ignore_errors=True)
        else:
            print(f"the run failed: the engines' logs are kept in {logs}", file=sys.stderr, flush=True)
    results = summarise(flows, rounds, doc_tokens)
    return {
        "suite": "agents",
        "config": {
            "rounds": rounds,
            "doc_tokens": doc_tokens,
            "turns": turns,
            "generated_tokens": {"plan": lengths.plan, "answer": lengths.answer, "verdict": lengths.verdict},
            "block_size": 32,
            "model": "SmolLM2-135M-Instruct (float32)",
            "engines": "4 vLLM 0.32.0 CPU engines (planner, executor-1, executor-2, verifier), enforce_eager, "
            "one OpenMP thread each (planner+executor-1 on core 0, executor-2+verifier on core 1)",
            "arms": [PREFIX_CACHED_TEXT.name, NO_PREFIX_CACHE_TEXT.name, *(a.name for a in KVBUS_ARMS)],
            "engines_start_s": round(started_s, 1),
            "network": "loopback",
            "notes": NOTES,
        },
        "results": results,
    }


def _p(vals: list[float], q: float) -> float | None:
    return round(pct(vals, q), 4) if vals else None


def summarise(flows: list[dict[str, Any]], rounds: int, doc_tokens: int) -> dict[str, Any]:
    """The figures of a run from its workflows (see the module docstring)."""
    ref: dict[tuple[int, int], Workflow] = {
        (f["round"], f["docs"]): f["wf"] for f in flows if f["wf"].arm == PREFIX_CACHED_TEXT.name
    }
    names = [PREFIX_CACHED_TEXT.name, NO_PREFIX_CACHE_TEXT.name, *(a.name for a in KVBUS_ARMS)]
    arms: dict[str, Any] = {}
    e2e_ratio: dict[str, list[float | None]] = {}
    ttft_ratio: dict[str, list[float | None]] = {}
    for name in names:
        mine = [f for f in flows if f["wf"].arm == name]
        wfs: list[Workflow] = [f["wf"] for f in mine]
        ttfts = [t for wf in wfs for t in _handoff_ttfts(wf)]
        agreements, same_prompt, same_tokens = [], [], 0
        for f in mine:
            a = ref.get((f["round"], f["docs"]))
            if a is None:
                continue
            e2e_ratio.setdefault(name, []).append(ratio(f["wf"].e2e_s, a.e2e_s))
            ttft_ratio.setdefault(name, []).append(ratio(_median(_handoff_ttfts(f["wf"])), _median(_handoff_ttfts(a))))
            agree, same, n = _agreement(a, f["wf"])
            agreements.append(agree)
            if same is not None:
                same_prompt.append(same)
                same_tokens += n
        scores = [wf.score() for wf in wfs]
        arms[name] = {
            "workflows": len(wfs),
            "e2e_s": spread(wf.e2e_s for wf in wfs),
            "handoff_ttft_s": {"p50": _p(ttfts, 0.5), "p99": _p(ttfts, 0.99), "n": len(ttfts)},
            "bytes_moved": spread((wf.nbytes for wf in wfs), digits=0),
            "deliveries": sum(wf.deliveries for wf in wfs),
            "saves": sum(wf.saves for wf in wfs),
            "media": sorted(set(m for wf in wfs for m in wf.media)),
            # Why each transfer went in its medium (path, the scheduler's reason, the link it
            # priced, its cheapest predictions): the adaptive arm's choices between engines of
            # one host are the question (issue 35).
            "decisions": [d for wf in wfs for d in wf.decisions],
            "agreement_vs_prefix_cached_text": spread(agreements),
            "agreement_same_prompt": spread(same_prompt),
            "same_prompt_tokens": same_tokens,
            "task_score": spread(scores),
            "loaded_tokens": sum(c.loaded_tokens for wf in wfs for c in wf.calls),
            "declined_tokens": sum(c.declined_tokens for wf in wfs for c in wf.calls),
            "calls": [
                [
                    {
                        "agreement": _call_agreement(ref.get((f["round"], f["docs"])), f["wf"], i),
                        "role": c.role,
                        "turn": c.turn,
                        "from": c.handoff,
                        "prompt": c.prompt_len,
                        "ttft_s": None if c.ttft_s is None else round(c.ttft_s, 4),
                        "cached": c.cached_tokens,
                        "loaded": c.loaded_tokens,
                        "source": c.source,
                        "declined": c.declined_tokens,
                    }
                    for i, c in enumerate(f["wf"].calls)
                ]
                for f in mine
            ],
        }
    key = str(doc_tokens)
    e2e = {n: spread(v) for n, v in e2e_ratio.items() if n != PREFIX_CACHED_TEXT.name}
    ttft = {n: spread(v) for n, v in ttft_ratio.items() if n != PREFIX_CACHED_TEXT.name}
    # Adaptive over the best fixed medium, each as its ratio to arm (a) on its own documents
    # (the fixed media ran on other documents than adaptive), per round.
    per_round = []
    for r in range(rounds):
        c = _at(e2e_ratio, ADAPTIVE.name, r)
        fixed = [v for v in (_at(e2e_ratio, a.name, r) for a in FIXED) if v is not None]
        per_round.append(ratio(c, min(fixed)) if c is not None and fixed else None)
    medians = {a.name: e2e[a.name]["median"] for a in FIXED if a.name in e2e and e2e[a.name]["median"] is not None}
    best_fixed = min(medians, key=lambda n: medians[n]) if medians else None
    agreement = {
        (a.medium or "adaptive"): arms[a.name]["agreement_vs_prefix_cached_text"]["median"] for a in KVBUS_ARMS
    }
    agreement["no_prefix_cache_text"] = arms[NO_PREFIX_CACHE_TEXT.name]["agreement_vs_prefix_cached_text"]["median"]
    results: dict[str, Any] = {
        "e2e_vs_prefix_cached_text": e2e.get(ADAPTIVE.name, spread([]))["median"],
        "e2e_vs_prefix_cached_text_spread": e2e.get(ADAPTIVE.name, spread([])),
        "e2e_vs_prefix_cached_text_per_arm": e2e,
        "ttft_vs_prefix_cached_text": {key: ttft.get(ADAPTIVE.name, spread([]))["median"]},
        "ttft_vs_prefix_cached_text_spread": {key: ttft.get(ADAPTIVE.name, spread([]))},
        "ttft_vs_prefix_cached_text_per_arm": {n: {key: s} for n, s in ttft.items()},
        "agreement_vs_prefix_cached_text": agreement,
        "adaptive_vs_best_fixed": spread(per_round)["median"],
        "adaptive_vs_best_fixed_spread": spread(per_round),
        "best_fixed": best_fixed,
        "arms": arms,
    }
    results["goals"] = _goals(results, key)
    return results


def _at(d: dict[str, list[float | None]], name: str, i: int) -> float | None:
    vals = d.get(name) or []
    return vals[i] if i < len(vals) else None


def _median(vals: list[float]) -> float | None:
    return statistics.median(vals) if vals else None


def _goals(results: dict[str, Any], key: str) -> dict[str, Any]:
    """Each issue-35 goal with the figure and whether it is met (None: no figure)."""

    def check(value: float | None, bound: float, below: bool = True) -> dict[str, Any]:
        met = None if value is None else (value <= bound if below else value >= bound)
        return {"value": value, "goal": f"{'<=' if below else '>='} {bound}", "met": met}

    agreement = results["agreement_vs_prefix_cached_text"]
    return {
        "e2e_vs_prefix_cached_text": check(results["e2e_vs_prefix_cached_text"], 0.6),
        f"ttft_vs_prefix_cached_text.{key}": check(results["ttft_vs_prefix_cached_text"][key], 0.25),
        **{f"agreement.{m}": check(agreement.get(m), 0.98, below=False) for m in LOSSLESS},
        "agreement.int8": check(agreement.get("int8"), 0.95, below=False),
        "adaptive_vs_best_fixed": check(results["adaptive_vs_best_fixed"], 1.0),
    }
