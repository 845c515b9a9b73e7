"""`kvbus top`: a live view of a running kvbus from its schedulers' state."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from kvbus.net.servers import server_urls
from kvbus.protocol import COORD_GROUPS, sched_subject, unpackb


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _fmt_rate(bps: float) -> str:
    return "unpaced" if not bps else f"{bps * 8 / 1e6:.0f} Mbit/s"


async def collect(nc: Any, groups: list[str] | None, timeout: float = 1.0) -> tuple[dict[str, Any], list[str]]:
    """Each group's snapshot; groups come from the coordinator unless given."""
    notes: list[str] = []
    if not groups:
        try:
            msg = await nc.request(COORD_GROUPS, b"", timeout=timeout)
            groups = sorted(unpackb(msg.data, "groups reply"))
        except Exception:  # noqa: BLE001 - no coordinator: say so, show what we can
            notes.append("no coordinator answers on kvbus.coord.groups (pass --group to name groups)")
            groups = []
    out: dict[str, Any] = {}
    for g in groups:
        try:
            msg = await nc.request(sched_subject(g, "state"), b"", timeout=timeout)
            out[g] = unpackb(msg.data, "scheduler state")
        except Exception as exc:  # noqa: BLE001
            notes.append(f"group {g}: no state ({type(exc).__name__})")
    return out, notes


def render(snapshots: dict[str, Any], notes: list[str], *, live: bool = False) -> Group:
    """One frame: a panel per group with agents, transfers and links, and the time; a ``live``
    frame (one of a refreshing view, not a ``--once`` print) also says how to quit."""
    parts: list[Any] = []
    for g, snap in sorted(snapshots.items()):
        agents = Table("agent", "role", "prio", "queue", "cache", "load", "seen", box=None, pad_edge=False)
        for name, a in sorted(snap.get("agents", {}).items()):
            seen = "down" if a.get("down") else (f"{a['age_s']:.1f}s ago" if a.get("age_s") is not None else "-")
            agents.add_row(
                name,
                a["role"],
                f"{a['priority']:g}",
                str(a["queue"]),
                _fmt_bytes(a["cache_bytes"]),
                f"{a['load']:.0%}",
                seen,
            )
        active = Table(
            "transfer", "src -> dst", "medium", "predicted", "rate", "bytes", "age", box=None, pad_edge=False
        )
        for t in snap.get("active", []):
            predicted = t.get("predicted_s")
            active.add_row(
                t["id"],
                f"{t['src']} -> {','.join(t['dst'])}",
                t["medium"] + (" (explore)" if t.get("explored") else ""),
                f"{predicted * 1000:.0f} ms" if predicted else "-",
                _fmt_rate(t["rate_bps"]),
                _fmt_bytes(t["bytes"]),
                f"{t['age_s']:.1f}s",
            )
        for q in snap.get("queue", []):
            active.add_row(
                q["id"],
                f"{q['src']} -> {','.join(q['dst'])}",
                "[dim]queued[/]",
                "",
                "critical" if q["critical"] else "",
                "",
                f"{q['wait_s']:.2f}s",
            )
        sel = snap.get("selection") or {}
        recent = Table("recent transfer", "predicted", "measured", box=None, pad_edge=False)
        for r in sel.get("recent", []):
            recent.add_row(r["medium"], f"{r['predicted_s'] * 1000:.0f} ms", f"{r['measured_s'] * 1000:.0f} ms")
        err = sel.get("prediction_error") or {}
        links = Table("link", "estimate", "samples", box=None, pad_edge=False)
        for name, est in sorted(snap.get("links", {}).items()):
            links.add_row(name, _fmt_rate(est["bandwidth_bps"]), str(est["samples"]))
        c = snap.get("counters", {})
        title = (
            f"group {g}  ({snap.get('scheduler', '?')})  granted {c.get('granted', 0)}  "
            f"completed {c.get('completed', 0)}  failed {c.get('failed', 0)}"
        )
        body: list[Any] = [agents, active, links]
        if sel:
            body.append(
                f"selection: {sel.get('decided', 0)} decided, {sel.get('explored', 0)} explored; prediction error "
                f"median {err.get('median')} p90 {err.get('p90')} over {err.get('n', 0)}"
            )
            body.append(recent)
        parts.append(Panel(Group(*body), title=title, title_align="left"))
    if not snapshots:
        parts.append(Panel("no groups found", title="kvbus top"))
    for n in notes:
        parts.append(f"[yellow]{n}[/]")
    parts.append(f"[dim]{time.strftime('%H:%M:%S')}{'  Ctrl-C quits' if live else ''}[/]")
    return Group(*parts)


async def top(
    nats_url: str,
    *,
    groups: list[str] | None = None,
    interval: float = 1.0,
    once: bool = False,
    console: Console | None = None,
    nats_options: dict[str, Any] | None = None,
) -> None:
    """Show the deployment on ``nats_url`` (``nats_options`` go to `nats.connect`: credentials, TLS)."""
    console = console or Console()
    nc = await nats.connect(server_urls(nats_url), **{"name": "kvbus-top", **(nats_options or {})})
    try:
        if once:
            snaps, notes = await collect(nc, groups)
            console.print(render(snaps, notes))
            return
        with Live(console=console, refresh_per_second=4, screen=False) as live:
            while True:
                snaps, notes = await collect(nc, groups)
                live.update(render(snaps, notes, live=True))
                await asyncio.sleep(interval)
    finally:
        await nc.close()
