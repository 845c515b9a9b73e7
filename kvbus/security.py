"""Per-agent NATS permissions: who may publish and subscribe to what.

`permissions_config` writes the ``authorization`` block of a nats-server configuration with
one user per agent, per group scheduler and for the coordinator. Identity comes from where a
message may come from, never from what it says:

- an agent may publish only on its own subjects of its group scheduler
  (``kvbus.sched.<group>.{request,done,probe,reserve,register,leave}.<self>``: it cannot speak
  for another agent), on other agents' inboxes under its own name (``kvbus.agent.*.inbox.<self>``,
  to open a transfer: it cannot pose as another sender), on acks ending in its own name
  (``kvbus.agent.*.ack.<self>``: it can acknowledge only what it received itself) and on data
  subjects carrying its own name under a receiver's prefix (``kvbus.agent.*.data.<self>.*``: it
  cannot inject chunks into another sender's stream); it may subscribe only under its own
  prefix (``kvbus.agent.<self>.>``) and to its own reply inbox (``_INBOX.<self>.>``), so only
  the addressees of a transfer, broadcasts included, can read its data;
- only group schedulers may publish on ``kvbus.agent.*.ctl`` (grants, pause/resume), and
  replies (grants given as replies, `OpenReply`) are allowed only to requests the replier received;
- only a group's scheduler may publish its heartbeats and its leave
  (``kvbus.coord.{register,leave}.<group>``): no agent, and no other group's scheduler, can
  announce a group to the coordinator or take it away;
- schedulers and the coordinator may use JetStream (the directory and the coordinator's state);
- an agent that is a vLLM engine (`kvbus.integrations.vllm`; every agent gets these rights) may
  subscribe to its connector's subjects (``kvbus.vllm.<self>.>``), ask its own worker
  (``kvbus.vllm.<self>.lookup``, ``.push``), ask any agent what it holds (``kvbus.vllm.*.have``),
  pull and fail a pull only under its own name (``kvbus.vllm.*.pull.<self>``,
  ``kvbus.vllm.*.pulled.<self>``), publish its own events (``kvbus.vllm.events.<self>``), and read
  and write the prefix index, the JetStream KV bucket `VLLM_INDEX_BUCKET` and no other.

Passwords are random and returned to the caller; nothing here logs them.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbus.protocol import (
    AGENT_TO_SCHED,
    COORD_GROUPS,
    COORD_LEASE,
    COORD_LEAVE,
    COORD_REGISTER,
    COORD_RESERVE,
    COORD_UNRESERVE,
    ack_subject,
    check_name,
    data_subject,
    group_subject,
    inbox_subject,
    sched_subject,
)

#: Root of the vLLM connector's subjects (`kvbus.integrations.vllm.protocol.SUBJECT_ROOT`).
VLLM_ROOT = "kvbus.vllm"
#: The vLLM connector's prefix index bucket its agents may use in secure mode (its default
#: ``index_bucket``; an engine configured with another finds no index there and only loads
#: pushed contexts and the cache tier's blocks).
VLLM_INDEX_BUCKET = "kvbus_vllm_prefix"


def vllm_agent_subjects(agent: str) -> tuple[list[str], list[str]]:
    """(publish, subscribe) subjects the vLLM connector of ``agent`` needs (see the module doc)."""
    a, r, stream = agent, VLLM_ROOT, f"KV_{VLLM_INDEX_BUCKET}"
    publish = [
        f"{r}.{a}.lookup",
        f"{r}.{a}.push",
        f"{r}.*.have",
        f"{r}.*.pull.{a}",
        f"{r}.*.pulled.{a}",
        f"{r}.events.{a}",
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.STREAM.CREATE.{stream}",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$KV.{VLLM_INDEX_BUCKET}.>",
    ]
    return publish, [f"{r}.{a}.>"]


@dataclass(frozen=True)
class AgentGrant:
    """One agent's place in the permission scheme."""

    name: str
    group: str
    broadcasts_from: tuple[str, ...] = ()
    """Kept for compatibility and ignored: in secure mode every receiver of a broadcast gets the
    data on its own subjects, so no agent needs rights to another sender's broadcast subjects."""


@dataclass
class Credentials:
    """User names and passwords, by role."""

    agents: dict[str, tuple[str, str]] = field(default_factory=dict)
    schedulers: dict[str, tuple[str, str]] = field(default_factory=dict)
    coordinator: tuple[str, str] = ("", "")

    def url_for(self, base_url: str, user: str, password: str) -> str:
        """``base_url`` with ``user:password@`` inserted after the scheme."""
        scheme, rest = base_url.split("://", 1)
        return f"{scheme}://{user}:{password}@{rest}"

    def agent_options(self, agent: str) -> dict[str, Any]:
        """`nats.connect` options for ``agent``: its user, password and private reply inbox.

        Raises:
            KeyError: the permission set has no user for ``agent``.
        """
        user, password = self.agents[agent]
        return {"user": user, "password": password, "inbox_prefix": f"_INBOX.{agent}", "name": f"kvbus-{agent}"}

    def scheduler_options(self, group: str) -> dict[str, Any]:
        """`nats.connect` options for the scheduler of ``group``."""
        user, password = self.schedulers[group]
        return {"user": user, "password": password, "inbox_prefix": f"_INBOX.sched-{group}"}

    def coordinator_options(self) -> dict[str, Any]:
        """`nats.connect` options for the coordinator."""
        user, password = self.coordinator
        return {"user": user, "password": password, "inbox_prefix": "_INBOX.coord"}

    def to_dict(self) -> dict[str, Any]:
        """The credentials as JSON-ready data (what `save_credentials` writes)."""
        return {
            "agents": {k: list(v) for k, v in self.agents.items()},
            "schedulers": {k: list(v) for k, v in self.schedulers.items()},
            "coordinator": list(self.coordinator),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Credentials:
        """The credentials `to_dict` wrote."""
        coordinator = data.get("coordinator", ("", ""))
        return cls(
            agents={k: (v[0], v[1]) for k, v in data.get("agents", {}).items()},
            schedulers={k: (v[0], v[1]) for k, v in data.get("schedulers", {}).items()},
            coordinator=(str(coordinator[0]), str(coordinator[1])),
        )

    def __repr__(self) -> str:
        # Never show passwords (in logs, tracebacks, debuggers).
        return (
            f"Credentials(agents={sorted(self.agents)}, schedulers={sorted(self.schedulers)}, "
            f"coordinator={self.coordinator[0]!r})"
        )


def save_credentials(creds: Credentials, path: Path) -> None:
    """Write ``creds`` as JSON readable by the owner only (mode 0600, set before any byte is written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        json.dump(creds.to_dict(), f)
    os.replace(tmp, path)


def load_credentials(path: Path) -> Credentials:
    """Credentials written by `save_credentials` (e.g. by ``kvbus up --secure``)."""
    return Credentials.from_dict(json.loads(Path(path).read_text()))


def agent_permissions(grant: AgentGrant) -> dict[str, object]:
    """The nats-server permissions of one agent: its own scheduler subjects, inboxes, data and broadcasts."""
    a, g = check_name("agent", grant.name), check_name("group", grant.group)
    for sender in grant.broadcasts_from:
        check_name("agent", sender)
    vllm_publish, vllm_subscribe = vllm_agent_subjects(a)
    return {
        "publish": {
            "allow": [
                *(sched_subject(g, kind, a) for kind in AGENT_TO_SCHED),
                inbox_subject("*", a),
                ack_subject("*", a),
                data_subject("*", a, "*"),
                "kvbus.coord.place",
                *vllm_publish,
            ]
        },
        "subscribe": {"allow": [f"kvbus.agent.{a}.>", f"_INBOX.{a}.>", *vllm_subscribe]},
        "allow_responses": True,
    }


def scheduler_permissions(group: str) -> dict[str, object]:
    """A group scheduler's user: grants and controls to any agent, the coordinator's requests, and
    heartbeats and leaves only on its own group's subjects (it cannot announce another group)."""
    g = check_name("group", group)
    return {
        "publish": {
            "allow": [
                "kvbus.agent.*.ctl",
                group_subject(COORD_REGISTER, g),
                group_subject(COORD_LEAVE, g),
                COORD_LEASE,
                COORD_RESERVE,
                COORD_UNRESERVE,
                COORD_GROUPS,
                "$JS.API.>",
                "$KV.kvbus_agents.>",
                "$KV.kvbus_coord.>",
                f"$KV.kvbus_sched_reservations.{g}.>",
                f"$KV.kvbus_sched_learned.{g}.>",
                f"_INBOX.sched-{g}.>",
            ]
        },
        "subscribe": {
            "allow": [
                f"kvbus.sched.{g}.>",
                f"_INBOX.sched-{g}.>",
                "$KV.kvbus_agents.>",
                f"$KV.kvbus_sched_reservations.{g}.>",
                f"$KV.kvbus_sched_learned.{g}.>",
            ]
        },
        "allow_responses": True,
    }


def coordinator_permissions() -> dict[str, object]:
    """The nats-server permissions of the coordinator: its request subjects and its KV bucket."""
    return {
        "publish": {"allow": ["$JS.API.>", "$KV.kvbus_coord.>", "_INBOX.coord.>"]},
        "subscribe": {"allow": ["kvbus.coord.>", "_INBOX.coord.>", "$KV.kvbus_coord.>"]},
        "allow_responses": True,
    }


def permissions_config(agents: list[AgentGrant], groups: list[str]) -> tuple[str, Credentials]:
    """The nats-server ``authorization`` block for these agents and groups, and their credentials."""
    creds = Credentials()
    users = []
    for a in agents:
        pw = secrets.token_urlsafe(18)
        creds.agents[a.name] = (f"agent-{a.name}", pw)
        users.append({"user": f"agent-{a.name}", "password": pw, "permissions": agent_permissions(a)})
    for g in groups:
        pw = secrets.token_urlsafe(18)
        creds.schedulers[g] = (f"sched-{g}", pw)
        users.append({"user": f"sched-{g}", "password": pw, "permissions": scheduler_permissions(g)})
    pw = secrets.token_urlsafe(18)
    creds.coordinator = ("coordinator", pw)
    users.append({"user": "coordinator", "password": pw, "permissions": coordinator_permissions()})
    # nats-server's configuration format accepts JSON values.
    return "authorization {\n  users: " + json.dumps(users, indent=2) + "\n}\n", creds
