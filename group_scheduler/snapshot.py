"""A group's state as a plain map: what `kvbus top` and operators see.

The scheduler answers requests on ``kvbus.sched.<group>.state`` with this map (msgpack).
"""

from __future__ import annotations

import time
from typing import Any


def snapshot(scheduler: Any) -> dict[str, Any]:
    """Agents, queue, active transfers and link estimates of one group scheduler."""
    state = scheduler.state
    now = time.monotonic()
    agents = {
        name: {
            "role": a.role,
            "priority": a.role_priority,
            "queue": a.queue_size,
            "cache_bytes": a.cache_bytes,
            "load": round(a.compute_load, 3),
            "age_s": round(now - a.last_seen, 2) if a.last_seen else None,
            "down": bool(getattr(a, "down", False)),
        }
        for name, a in state.agents.items()
    }
    active = [
        {
            "id": p.transfer_id[:12],
            "src": p.request.src,
            "dst": list(p.request.dst),
            "medium": p.medium,
            "rate_bps": p.rate_bps,
            "bytes": p.request.nbytes,
            "tokens": p.request.n_tokens,
            "age_s": round(now - p.granted_at, 2) if p.granted_at else 0.0,
            "predicted_s": round(p.predicted_s, 4) if p.predicted_s < float("inf") else None,
            "explored": bool(p.decision.get("explored")),
        }
        for p in state.active.values()
    ]
    queue = [
        {
            "id": p.transfer_id[:12],
            "src": p.request.src,
            "dst": list(p.request.dst),
            "tokens": p.request.n_tokens,
            "wait_s": round(now - p.arrived, 3),
            "critical": p.request.critical,
        }
        for p in state.queue
    ]
    links = {
        f"{src}->{dst}": {"bandwidth_bps": est.bandwidth_bps, "samples": len(est.samples)}
        for (src, dst), est in state.links.items()
        if est.samples
    }
    links.update(
        {
            f"{src}->{dst} ({path})": {"bandwidth_bps": est.bandwidth_bps, "samples": len(est.samples), "path": path}
            for (src, dst, path), est in state.path_links.items()
            if est.samples
        }
    )
    selection: dict[str, Any] = {}
    selector = getattr(getattr(scheduler, "policy", None), "selector", None)
    model = getattr(selector, "model", None)
    learned = getattr(model, "learned", None)
    if learned is not None:
        selection = {
            "decided": getattr(selector, "decided", 0),
            "explored": getattr(selector, "explored", 0),
            "prediction_error": learned.prediction_error(),
            "recent": [
                {"medium": m, "predicted_s": round(p, 4), "measured_s": round(ms, 4)}
                for m, p, ms in list(learned.recent)[-8:]
            ],
            "learned": {
                "codec": len(learned.codec),
                "fixed": len(learned.fixed_s),
                "prefill": len(learned.prefill_tps),
            },
        }
    return {
        "group": state.group,
        "selection": selection,
        "scheduler": scheduler.name,
        "ts": time.time(),
        "agents": agents,
        "active": active,
        "queue": queue,
        "links": links,
        "counters": {"granted": state.granted, "completed": state.completed, "failed": state.failed},
        "bandwidth_bps": state.bandwidth_bps,
    }
