"""`kvbus bench e2e`: the demo workflow under adaptive and every static policy, same run.

Writes ``results.adaptive_vs_best_static`` (E2E latency of adaptive / the fastest static policy),
``results.adaptive_vs_best_static_same_quality`` (against the fastest static policy whose
generated tokens agree with the lossless run at least as well as adaptive's do) and
``results.adaptive_quality`` (token agreement of adaptive with the ``full`` run).
"""

from __future__ import annotations

import asyncio
from typing import Any

from rich.console import Console

from kvbus.app.demo import render_table, run_policies
from kvbus.app.local import NatsServer


async def _run(quick: bool, nats_url: str | None, new_tokens: int) -> dict[str, Any]:
    server = None if nats_url else NatsServer().start()
    url = nats_url or server.url  # type: ignore[union-attr]
    console = Console(width=140)
    try:
        runs, rows, meta = await run_policies(url, quick, new_tokens, console)
    finally:
        if server is not None:
            server.stop()
    render_table(rows, console)
    by = {r["policy"]: r for r in rows}
    statics = [r for r in rows if r["policy"] != "adaptive"]
    best = min(statics, key=lambda r: r["e2e_s"])
    adaptive = by["adaptive"]
    same_quality = [r for r in statics if (r["agreement"] or 0) >= (adaptive["agreement"] or 0) - 1e-9]
    best_same = min(same_quality, key=lambda r: r["e2e_s"]) if same_quality else best
    return {
        "suite": "e2e",
        "config": {**meta, "quick": quick, "policies": list(by)},
        "results": {
            "adaptive_vs_best_static": round(adaptive["e2e_s"] / best["e2e_s"], 3),
            "best_static": best["policy"],
            "adaptive_vs_best_static_same_quality": round(adaptive["e2e_s"] / best_same["e2e_s"], 3),
            "best_static_same_quality": best_same["policy"],
            "adaptive_quality": adaptive["agreement"],
            "rows": rows,
        },
    }


def run(*, quick: bool = False, nats_url: str | None = None, new_tokens: int | None = None, **_: Any) -> dict[str, Any]:
    return asyncio.run(_run(quick, nats_url, new_tokens or (8 if quick else 16)))
