"""The demo workflow: completes under each policy on real servers, `full` equals the in-process
reference exactly, and the report (Markdown, JSON, PNG plots) is written."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image as mpimg
import pytest
import torch

from kvbus.app.demo import STATIC_POLICIES, summarise, write_report
from kvbus.app.models import random_model
from kvbus.app.workflow import AgentSpec, Workflow
from kvbus.bus import EmulatedLink
from kvbus.codecs import available_codecs
from kvbus.group_scheduler import GroupScheduler


def encode(text: str) -> torch.Tensor:
    return torch.tensor([[b % 256 for b in text.encode()]], dtype=torch.int64)


@pytest.fixture(scope="module")
def flow() -> Workflow:
    runner = random_model(n_layers=2, n_kv_heads=2, head_dim=16, vocab_size=256, seed=1)
    other = random_model(n_layers=1, n_kv_heads=1, head_dim=8, vocab_size=256, seed=2)
    agents = [
        AgentSpec("coordinator", "coordinator", "wf-plan", 3.0, runner, EmulatedLink.mbit(1000)),
        AgentSpec("verifier", "verifier", "wf-plan", 2.0, runner),
        AgentSpec("executor1", "executor", "wf-exec", 1.0, runner, EmulatedLink.mbit(200)),
        AgentSpec("executor2", "executor", "wf-plan", 1.0, runner, EmulatedLink.mbit(200)),
        AgentSpec("archivist", "archivist", "wf-exec", 0.5, other, EmulatedLink.mbit(50)),
    ]
    return Workflow(agents, ["Plan a library reminder service."], encode, new_tokens=4)


async def test_workflow_under_each_policy_and_the_report(flow: Workflow, nats_url: str, tmp_path: Path) -> None:
    scheds = [await GroupScheduler.connect(nats_url, g) for g in ("wf-plan", "wf-exec")]
    try:
        reference = await flow.reference()
        policies = ["full", "adaptive", *[p for p in STATIC_POLICIES if p != "full" and p in available_codecs()]]
        runs = {p: await flow.run(nats_url, p) for p in policies}
    finally:
        for s in scheds:
            await s.close()
    for policy, run in runs.items():
        assert set(run.outputs) == set(reference.outputs), policy
        kinds = {len(t.dst) for t in run.transfers}
        assert kinds == {1, 2}, "both point-to-point and broadcast transfers happen"
        arch = [t for t in run.transfers if t.dst == ("archivist",)]
        assert arch and all(t.medium == "tokens" for t in arch), "the other model only gets tokens"
    # Lossless transfers reproduce the in-process reference token for token.
    for agent, outs in reference.outputs.items():
        for ref, got in zip(outs, runs["full"].outputs[agent]):
            assert torch.equal(ref, got), agent
        for ref, got in zip(outs, runs["tokens"].outputs[agent]):
            assert torch.equal(ref, got), agent
    rows = summarise(runs)
    assert {r["policy"] for r in rows} == set(policies)
    assert next(r for r in rows if r["policy"] == "full")["agreement"] == 1.0
    write_report(tmp_path, rows, runs, {"test": True})
    assert "| adaptive |" in (tmp_path / "report.md").read_text()
    data = json.loads((tmp_path / "results.json").read_text())
    assert {r["policy"] for r in data["rows"]} == set(policies)
    for name in ("latency_by_policy.png", "bytes_by_medium.png", "timeline_adaptive.png", "media_over_time.png"):
        img = mpimg.imread(tmp_path / name)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, name


async def test_workflow_on_a_server_that_wants_a_token(flow: Workflow) -> None:
    """`kvbus demo --nats-url` on a server of your own: the KVBUS_NATS_* identity reaches the
    workflow's connection, its schedulers' and its coordinator's (`run_policies` passes it)."""
    from kvbus.app.local import NatsServer
    from kvbus.coordinator import Coordinator
    from kvbus.net.auth import NatsAuth

    server = NatsServer(extra_config='authorization {\n  token: "wf-secret-token"\n}\n').start()
    options = NatsAuth.from_env(environ={"KVBUS_NATS_TOKEN": "wf-secret-token"}).connect_options()
    token_flow = Workflow(list(flow.specs.values()), flow.tasks, flow.encode, new_tokens=2, nats_options=options)
    try:
        coord = await Coordinator.connect(server.url, nats_options=options)
        scheds = [await GroupScheduler.connect(server.url, g, nats_options=options) for g in ("wf-plan", "wf-exec")]
        try:
            run = await token_flow.run(server.url, "full")
        finally:
            for s in scheds:
                await s.close()
            await coord.close()
        assert run.transfers and run.outputs
    finally:
        server.stop()
