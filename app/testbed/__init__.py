"""A real multi-host network on one Linux machine for kvbus's benchmarks (`kvbus testbed`).

One network namespace per host, veth pairs into bridges (one per rack, racks joined by shaped
uplinks through a core bridge, all in one "switch" namespace made for the run), ``tc`` htb per
link for bandwidth, netem (or, on kernels without it, a delay line on NFQUEUE) for delay,
jitter and loss, and a schedule that changes links over time. Servers, schedulers, the
coordinator and agents run as separate processes in their host's namespace.
"""

from kvbus.app.testbed.errors import CommandFailed, ProcessFailed, TestbedError, TestbedUnavailable, TopologyError
from kvbus.app.testbed.topology import GroupSpec, HostSpec, LinkSpec, RackSpec, ScheduleStep, Services, Topology

__all__ = [
    "CommandFailed",
    "GroupSpec",
    "HostSpec",
    "LinkSpec",
    "ProcessFailed",
    "RackSpec",
    "ScheduleStep",
    "Services",
    "TestbedError",
    "TestbedUnavailable",
    "Topology",
    "TopologyError",
]
