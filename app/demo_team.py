"""The demo's team: its roles, where each agent runs, and the services' worker processes.

On the testbed every agent is a process on its own host of the topology (`placements`), and the
coordinator and the groups' schedulers are worker processes on theirs (`_Services`); in this
process (smoke runs, ``--nats-url``) the agents share one `Bus` on emulated links (`local_agents`).
`kvbus.app.demo` runs the workflow on them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvbus.app.testbed.benchnet import BenchNet
from kvbus.app.testbed.topology import Topology
from kvbus.app.workflow import AgentSpec
from kvbus.app.workflow_remote import Placement

ROLES = (
    ("coordinator", "coordinator", "plan", 3.0),
    ("verifier", "verifier", "plan", 2.0),
    ("executor1", "executor", "plan", 1.0),
    ("executor2", "executor", "remote", 1.0),
    ("archivist", "archivist", "remote", 0.5),
)


def placements(topo: Topology, *, small_models: bool = False) -> list[Placement]:
    """The workflow's agents on ``topo``'s hosts (one host per agent, named like it), each declaring
    the capacity of its path to the server (its own link, and its rack's uplink if the server is in
    another rack)."""
    nats_rack = topo.host(topo.services.nats).rack
    out = []
    for name, role, group, prio in ROLES:
        host = topo.host(name)
        rates = [host.link.rate_mbit] if host.link.shaped else []
        uplink = topo.rack(host.rack).uplink
        if host.rack != nats_rack and uplink is not None and uplink.shaped:
            rates.append(uplink.rate_mbit)
        model = "archivist" if role == "archivist" else ("small" if small_models else "smollm2")
        out.append(Placement(name, role, group, prio, name, model, min(rates) * 1e6 / 8 if rates else 0.0))
    return out


def local_agents(runner: Any, other: Any) -> list[AgentSpec]:
    """The in-process team (smoke runs, ``--nats-url``): group ``plan`` on a fast rack (10 Gbit/s),
    group ``remote`` behind a slow uplink (20 Mbit/s, 10 ms), both emulated by `EmulatedLink`."""
    from kvbus.bus import EmulatedLink

    rack, uplink = EmulatedLink.mbit(10000, 0.1), EmulatedLink.mbit(20, 10.0)
    return [
        AgentSpec(
            name, role, group, prio, other if role == "archivist" else runner, uplink if group == "remote" else rack
        )
        for name, role, group, prio in ROLES
    ]


class _Services:
    """The coordinator and the two groups' schedulers, each a worker process on its topology host."""

    def __init__(self, net: BenchNet, topo: Topology, workers: dict[str, Any]) -> None:
        self.net, self.topo, self.workers = net, topo, workers
        self.running: set[str] = set()

    @classmethod
    async def start(cls, net: BenchNet, topo: Topology) -> _Services:
        names = ["coordinator", *[g.name for g in topo.groups]]
        hosts = [topo.services.coordinator or topo.services.nats, *[g.scheduler for g in topo.groups]]
        workers = await asyncio.gather(*(net.worker(h, f"svc-{n}") for n, h in zip(names, hosts)))
        svc = cls(net, topo, dict(zip(names, workers)))
        await svc.workers["coordinator"].call("kvbus.app.testbed.ops:coordinator_start", url=net.url(hosts[0]))
        return svc

    async def fresh_schedulers(self) -> None:
        """Stop the groups' schedulers and start new ones: empty S(t) and link estimates; the cost
        model starts from what the group's schedulers learned so far (kept in JetStream KV, as a
        deployment's restarted scheduler does), the calibrated prior alone for the first run."""
        for g in self.topo.groups:
            w = self.workers[g.name]
            if g.name in self.running:
                await w.call("kvbus.app.testbed.ops:scheduler_stop", group=g.name)
            cfg = {"bandwidth_bps": g.bandwidth_mbit * 1e6 / 8} if g.bandwidth_mbit else {}
            await w.call(
                "kvbus.app.testbed.ops:scheduler_start", url=self.net.url(g.scheduler), group=g.name, config=cfg
            )
            self.running.add(g.name)

    async def close(self) -> None:
        for w in self.workers.values():
            await w.close()
