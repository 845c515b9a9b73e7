"""Topologies of the network testbed: hosts in racks, their links, kvbus groups, a link schedule.

A topology is a TOML file (the shipped ones are in ``kvbus/app/testbed/topologies``)::

    name = "two-racks"
    description = "..."

    [[racks]]
    name = "plan"                       # hosts of a rack share its switch (a bridge)
    [[racks]]
    name = "remote"
    uplink = { rate_mbit = 20, delay_ms = 10 }   # the rack's link to the core switch

    [[hosts]]
    name = "core"
    rack = "plan"
    link = { rate_mbit = 10000 }        # the host's own link to its rack switch

    [services]
    nats = "core"                       # the host that runs nats-server
    redis = "core"                      # optional: Valkey
    coordinator = "core"                # optional: the kvbus coordinator

    [[groups]]
    name = "plan"
    scheduler = "core"                  # the host that runs the group's scheduler
    hosts = ["coordinator", "verifier"] # hosts whose agents belong to the group
    bandwidth_mbit = 0                  # the scheduler's budget (0 = none)

    [[schedule]]                        # link changes over time (seconds from the start)
    at_s = 10
    link = "uplink:remote"              # or "host:<name>"
    rate_mbit = 5

A link has ``rate_mbit`` (0 = not shaped), ``delay_ms`` (one way), ``jitter_ms``, ``loss_pct``
and ``queue_packets`` (the drop-tail queue of the shaper). Every host's link applies in both
directions (upload and download), as does a rack's uplink.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

from kvbus.app.testbed.errors import TopologyError

NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,23}$")
#: Default drop-tail queue of a shaped link, in packets (Linux's default txqueuelen).
DEFAULT_QUEUE_PACKETS = 1000


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One link's properties (each direction gets all of them)."""

    rate_mbit: float = 0.0
    """Bandwidth in Mbit/s (0 = not shaped: as fast as the machine moves bytes)."""
    delay_ms: float = 0.0
    """One-way delay in milliseconds."""
    jitter_ms: float = 0.0
    """Random variation of the delay (uniform +-jitter), packets stay in order."""
    loss_pct: float = 0.0
    """Share of packets dropped at random, in percent."""
    queue_packets: int = DEFAULT_QUEUE_PACKETS
    """Length of the shaper's drop-tail queue in packets."""

    @property
    def shaped(self) -> bool:
        """True when the link limits bandwidth."""
        return self.rate_mbit > 0

    @property
    def impaired(self) -> bool:
        """True when the link delays, jitters or drops packets."""
        return self.delay_ms > 0 or self.jitter_ms > 0 or self.loss_pct > 0

    @property
    def rate_bytes_per_s(self) -> float:
        """The rate in bytes per second (0 when not shaped)."""
        return self.rate_mbit * 1e6 / 8


@dataclass(frozen=True, slots=True)
class RackSpec:
    """A rack: a switch its hosts hang off, and an optional uplink to the core switch."""

    name: str
    uplink: LinkSpec | None = None


@dataclass(frozen=True, slots=True)
class HostSpec:
    """A host: one network namespace with one interface (``eth0``) into its rack's switch."""

    name: str
    rack: str
    link: LinkSpec = field(default_factory=LinkSpec)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """A kvbus group: its scheduler's host and the hosts of its agents."""

    name: str
    scheduler: str
    hosts: tuple[str, ...] = ()
    bandwidth_mbit: float = 0.0
    """The scheduler's bandwidth budget in Mbit/s (0 = none)."""


@dataclass(frozen=True, slots=True)
class Services:
    """Where the shared servers run."""

    nats: str
    redis: str | None = None
    coordinator: str | None = None


@dataclass(frozen=True, slots=True)
class ScheduleStep:
    """At ``at_s`` seconds after the start, set these fields of one link."""

    at_s: float
    link: str
    """``host:<name>`` or ``uplink:<rack>``."""
    changes: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class Topology:
    """Hosts, racks, groups, services and the link schedule of one testbed."""

    name: str
    racks: tuple[RackSpec, ...]
    hosts: tuple[HostSpec, ...]
    services: Services
    groups: tuple[GroupSpec, ...] = ()
    schedule: tuple[ScheduleStep, ...] = ()
    schedule_repeat_s: float = 0.0
    """Replay the schedule every this many seconds (0 = once)."""
    description: str = ""
    mtu: int = 1500

    def host(self, name: str) -> HostSpec:
        """The host called ``name``.

        Raises:
            KeyError: no such host.
        """
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r} in topology {self.name!r}; hosts: {', '.join(h.name for h in self.hosts)}")

    def rack(self, name: str) -> RackSpec:
        """The rack called ``name`` (KeyError if none)."""
        for r in self.racks:
            if r.name == name:
                return r
        raise KeyError(f"no rack {name!r} in topology {self.name!r}")

    def group(self, name: str) -> GroupSpec:
        """The group called ``name`` (KeyError if none)."""
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no group {name!r} in topology {self.name!r}")

    def link(self, target: str) -> LinkSpec:
        """The link ``host:<name>`` or ``uplink:<rack>`` (an unshaped link for a rack without one)."""
        kind, _, name = target.partition(":")
        if kind == "host":
            return self.host(name).link
        if kind == "uplink":
            return self.rack(name).uplink or LinkSpec()
        raise KeyError(f"link {target!r} is neither host:<name> nor uplink:<rack>")

    def with_link(self, target: str, **changes: float) -> Topology:
        """A copy with some fields of one link changed (benches adapt a shipped topology)."""
        kind, _, name = target.partition(":")
        new = replace(self.link(target), **changes)  # type: ignore[arg-type]
        if kind == "host":
            hosts = tuple(replace(h, link=new) if h.name == name else h for h in self.hosts)
            return replace(self, hosts=hosts)
        racks = tuple(replace(r, uplink=new) if r.name == name else r for r in self.racks)
        return replace(self, racks=racks)

    @property
    def multi_rack(self) -> bool:
        """True when racks meet at a core switch."""
        return len(self.racks) > 1

    def targets(self) -> list[str]:
        """Every link: ``host:<name>`` for each host, ``uplink:<rack>`` for each rack of a multi-rack topology."""
        return [f"host:{h.name}" for h in self.hosts] + (
            [f"uplink:{r.name}" for r in self.racks] if self.multi_rack else []
        )

    def may_impair(self, target: str) -> bool:
        """True when ``target`` delays, jitters or drops packets now or at some step of the schedule."""
        return self.link(target).impaired or any(
            s.link == target and any(s.changes.get(k, 0) > 0 for k in ("delay_ms", "jitter_ms", "loss_pct"))
            for s in self.schedule
        )

    @property
    def needs_delay(self) -> bool:
        """True when some link may be impaired, so the testbed needs netem or the NFQUEUE delay line."""
        return any(self.may_impair(t) for t in self.targets())

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what the benches record in their JSON's ``config``)."""
        out = asdict(self)
        out["schedule"] = [{"at_s": s.at_s, "link": s.link, **dict(s.changes)} for s in self.schedule]
        return out


def _link(source: str, where: str, data: Any) -> LinkSpec:
    if not isinstance(data, Mapping):
        raise TopologyError(source, f"{where} must be a table like {{ rate_mbit = 100 }}, got {data!r}")
    known = {f.name for f in fields(LinkSpec)}
    unknown = set(data) - known
    if unknown:
        raise TopologyError(source, f"{where} has unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    values: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise TopologyError(source, f"{where}.{key} must be a number >= 0, got {value!r}")
        values[key] = int(value) if key == "queue_packets" else float(value)
    if values.get("loss_pct", 0.0) > 100:
        raise TopologyError(source, f"{where}.loss_pct must be at most 100")
    if "queue_packets" in values and values["queue_packets"] < 2:
        raise TopologyError(source, f"{where}.queue_packets must be at least 2")
    return LinkSpec(**values)


def _name(source: str, where: str, value: Any) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise TopologyError(
            source,
            f"{where} must be a name of lower-case letters, digits and '-' (at most 24, "
            f"starting with a letter), got {value!r}",
        )
    return value


def _table_list(source: str, data: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    items = data.get(key, [])
    if not isinstance(items, list) or not all(isinstance(i, Mapping) for i in items):
        raise TopologyError(source, f"{key} must be an array of tables ([[{key}]])")
    return items


def _only(source: str, where: str, item: Mapping[str, Any], known: set[str]) -> None:
    unknown = set(item) - known
    if unknown:
        raise TopologyError(source, f"{where} has unknown key(s) {sorted(unknown)}; known: {sorted(known)}")


def one_rack(name: str, hosts: Mapping[str, float], **services: str) -> Topology:
    """A topology of one rack: each host of ``hosts`` on a link of that many Mbit/s, the services
    (``nats=``, ``redis=``) on the hosts named (what a bench builds for itself)."""
    return from_dict(
        {
            "name": name,
            "racks": [{"name": "rack"}],
            "hosts": [{"name": host, "link": {"rate_mbit": mbit}} for host, mbit in hosts.items()],
            "services": services,
        },
        f"<bench {name}>",
    )


def from_dict(data: Mapping[str, Any], source: str = "<dict>") -> Topology:
    """Build and check a topology from parsed TOML.

    Raises:
        TopologyError: a field is missing, unknown, of the wrong type, or names something that
            does not exist.
    """
    _only(
        source,
        "the top level",
        data,
        {"name", "description", "mtu", "racks", "hosts", "services", "groups", "schedule", "schedule_repeat_s"},
    )
    name = _name(source, "name", data.get("name"))
    racks = []
    for i, item in enumerate(_table_list(source, data, "racks")):
        _only(source, f"racks[{i}]", item, {"name", "uplink"})
        uplink = _link(source, f"racks[{i}].uplink", item["uplink"]) if "uplink" in item else None
        racks.append(RackSpec(_name(source, f"racks[{i}].name", item.get("name")), uplink))
    if not racks:
        raise TopologyError(source, "at least one [[racks]] entry is needed")
    rack_names = [r.name for r in racks]
    hosts = []
    for i, item in enumerate(_table_list(source, data, "hosts")):
        _only(source, f"hosts[{i}]", item, {"name", "rack", "link"})
        host = _name(source, f"hosts[{i}].name", item.get("name"))
        rack = item.get("rack", rack_names[0] if len(racks) == 1 else None)
        if rack not in rack_names:
            raise TopologyError(source, f"hosts[{i}] ({host}) names rack {rack!r}; racks: {', '.join(rack_names)}")
        link = _link(source, f"hosts[{i}].link", item["link"]) if "link" in item else LinkSpec()
        hosts.append(HostSpec(host, rack, link))
    host_names = [h.name for h in hosts]
    for what, names in (("rack", rack_names), ("host", host_names)):
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise TopologyError(source, f"{what} name(s) used twice: {', '.join(dup)}")
    if not hosts:
        raise TopologyError(source, "at least one [[hosts]] entry is needed")

    def host_ref(where: str, value: Any) -> str:
        if value not in host_names:
            raise TopologyError(source, f"{where} names host {value!r}; hosts: {', '.join(host_names)}")
        return str(value)

    svc = data.get("services")
    if not isinstance(svc, Mapping) or "nats" not in svc:
        raise TopologyError(source, 'a [services] table with at least nats = "<host>" is needed')
    _only(source, "services", svc, {"nats", "redis", "coordinator"})
    services = Services(
        host_ref("services.nats", svc["nats"]),
        host_ref("services.redis", svc["redis"]) if "redis" in svc else None,
        host_ref("services.coordinator", svc["coordinator"]) if "coordinator" in svc else None,
    )
    groups = []
    for i, item in enumerate(_table_list(source, data, "groups")):
        _only(source, f"groups[{i}]", item, {"name", "scheduler", "hosts", "bandwidth_mbit"})
        gname = _name(source, f"groups[{i}].name", item.get("name"))
        members = item.get("hosts", [])
        if not isinstance(members, list):
            raise TopologyError(source, f"groups[{i}].hosts must be a list of host names")
        budget = item.get("bandwidth_mbit", 0.0)
        if isinstance(budget, bool) or not isinstance(budget, int | float) or budget < 0:
            raise TopologyError(source, f"groups[{i}].bandwidth_mbit must be a number >= 0")
        groups.append(
            GroupSpec(
                gname,
                host_ref(f"groups[{i}].scheduler", item.get("scheduler")),
                tuple(host_ref(f"groups[{i}].hosts", h) for h in members),
                float(budget),
            )
        )
    schedule = []
    link_fields = {f.name for f in fields(LinkSpec)}
    for i, item in enumerate(_table_list(source, data, "schedule")):
        at, target = item.get("at_s"), item.get("link")
        if isinstance(at, bool) or not isinstance(at, int | float) or at < 0:
            raise TopologyError(source, f"schedule[{i}].at_s must be a number of seconds >= 0")
        kind, _, ref = str(target).partition(":")
        if not ((kind == "host" and ref in host_names) or (kind == "uplink" and ref in rack_names)):
            raise TopologyError(source, f"schedule[{i}].link {target!r} must be host:<host> or uplink:<rack>")
        changes = {k: v for k, v in item.items() if k not in ("at_s", "link")}
        if not changes:
            raise TopologyError(source, f"schedule[{i}] changes nothing; set one of {sorted(link_fields)}")
        checked = _link(source, f"schedule[{i}]", changes)
        schedule.append(ScheduleStep(float(at), str(target), {k: getattr(checked, k) for k in changes}))
    repeat = data.get("schedule_repeat_s", 0.0)
    mtu = data.get("mtu", 1500)
    if isinstance(mtu, bool) or not isinstance(mtu, int) or not 576 <= mtu <= 65000:
        raise TopologyError(source, "mtu must be an integer within 576..65000")
    if isinstance(repeat, bool) or not isinstance(repeat, int | float) or repeat < 0:
        raise TopologyError(source, "schedule_repeat_s must be a number >= 0")
    if schedule and repeat and repeat <= max(s.at_s for s in schedule):
        raise TopologyError(source, "schedule_repeat_s must be longer than the last step's at_s")
    return Topology(
        name,
        tuple(racks),
        tuple(hosts),
        services,
        tuple(groups),
        tuple(sorted(schedule, key=lambda s: s.at_s)),
        float(repeat),
        str(data.get("description", "")),
        mtu,
    )


def shipped() -> list[str]:
    """Names of the topologies shipped with kvbus."""
    folder = resources.files("kvbus.app.testbed").joinpath("topologies")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def load(name_or_path: str | Path) -> Topology:
    """A shipped topology by name (``two-racks``) or a TOML file by path.

    Raises:
        TopologyError: no such topology, or the file is not valid.
    """
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        try:
            text = path.read_text()
        except OSError as exc:
            raise TopologyError(str(path), f"cannot read it: {exc}") from None
        source = str(path)
    else:
        name = str(name_or_path)
        if name not in shipped():
            raise TopologyError(name, f"no such shipped topology; shipped: {', '.join(shipped())}")
        text = resources.files("kvbus.app.testbed").joinpath("topologies").joinpath(f"{name}.toml").read_text()
        source = f"{name}.toml"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(source, f"not valid TOML: {exc}") from None
    return from_dict(data, source)
