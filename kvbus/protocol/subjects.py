"""Subjects, names and JetStream bucket names of the kvbus wire protocol.

Subjects (``<x>`` are names: letters, digits, ``-`` and ``_``):

=====================================  ========================================================
``kvbus.sched.<group>.request.<a>``    agent -> its group scheduler: `TransferRequest` (reply: `RequestAck`)
``kvbus.sched.<group>.done.<a>``       agent -> scheduler: `TransferDone`
``kvbus.sched.<group>.probe.<a>``      agent -> scheduler: `Probe`
``kvbus.sched.<group>.reserve.<a>``    agent -> scheduler: `FlowReservation` (reply: `ReservationReply`)
``kvbus.sched.<group>.register.<a>``   agent -> scheduler: `AgentRecord` (secure mode: the scheduler
                                       writes the directory, agents have no JetStream access)
``kvbus.sched.<group>.leave.<a>``      agent -> scheduler: `AgentLeave` (the agent closed)
``kvbus.agent.<agent>.ctl``            scheduler -> agent: `Grant`, `Control` (pause/resume/cancel/rate/shed;
                                       a conditional pause is a request, answered with `ControlReply`)
``kvbus.agent.<rx>.inbox.<sender>``    sender -> receiver: `Open` (request; reply: `OpenReply`)
``kvbus.agent.<agent>.ack``            receiver -> sender: `Ack`
``kvbus.agent.<rx>.data.<transfer>``   sender -> receiver: chunk messages of a unicast transfer
``kvbus.bcast.<sender>.<transfer>``    sender -> receivers: chunk messages of a broadcast
``kvbus.coord.register.<group>``       group scheduler -> coordinator: `GroupHeartbeat` (its own group only)
``kvbus.coord.leave.<group>``          group scheduler -> coordinator: `GroupLeave`
``kvbus.coord.*``                      group schedulers <-> coordinator: leases, reservations, placement
=====================================  ========================================================
"""

from __future__ import annotations

import re

from kvbus.errors import WireFormatError

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# Bucket names in JetStream KV.
AGENTS_BUCKET = "kvbus_agents"
GROUPS_BUCKET = "kvbus_groups"


def check_name(kind: str, name: object) -> str:
    """Validate an agent or group name (it becomes a NATS subject token)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"invalid {kind} name {name!r}: use 1-64 letters, digits, '-' or '_'")
    return name


#: What agents send their group scheduler, each on a subject ending in the sender's name
#: (``kvbus.sched.<group>.<kind>.<agent>``): the server's permissions let an agent publish only
#: on its own, and the scheduler refuses a message whose claimed agent is not the subject's.
AGENT_TO_SCHED = ("request", "done", "probe", "reserve", "register", "leave")


def sched_subject(group: str, kind: str, agent: str | None = None) -> str:
    """A scheduler subject; with ``agent``, the one that agent sends ``kind`` on (``"*"``: all)."""
    return f"kvbus.sched.{group}.{kind}" if agent is None else f"kvbus.sched.{group}.{kind}.{agent}"


def subject_sender(subject: str) -> str:
    """The agent a per-sender subject (`sched_subject` with an agent) belongs to: its last token."""
    return subject.rsplit(".", 1)[-1]


def agent_subject(agent: str, kind: str) -> str:
    """One of an agent's own subjects (``ack``, ``ctl``, ...): ``kvbus.agent.<agent>.<kind>``."""
    return f"kvbus.agent.{agent}.{kind}"


def inbox_subject(agent: str, sender: str) -> str:
    """Where ``sender`` opens transfers to ``agent``: the receiver's inbox, ending in the sender's
    name (in secure mode an agent may publish only on inboxes ending in its own name, and the
    receiver refuses an `Open` whose ``src`` is not the subject's: no agent can pose as another)."""
    return f"kvbus.agent.{agent}.inbox.{sender}"


def data_subject(agent: str, transfer_id: str) -> str:
    """Chunks of a unicast transfer, under the receiver's own prefix (only it may subscribe)."""
    return f"kvbus.agent.{agent}.data.{transfer_id}"


def bcast_subject(sender: str, transfer_id: str) -> str:
    """Chunks of a broadcast, under the sender's broadcast prefix (receivers that joined it subscribe)."""
    return f"kvbus.bcast.{sender}.{transfer_id}"


def check_data_subject(subject: str, src: str, rx: str, transfer_id: str) -> None:
    """Reject an `Open` whose data subject is not one a receiver may subscribe to for it.

    Raises:
        WireFormatError: ``subject`` is neither ``data_subject(rx, tid)`` nor ``bcast_subject(src, tid)``.
    """
    if subject not in (data_subject(rx, transfer_id), bcast_subject(src, transfer_id)):
        raise WireFormatError(
            "open message",
            f"data subject {subject[:200]!r} is neither "
            f"{data_subject(rx, transfer_id)!r} nor {bcast_subject(src, transfer_id)!r}",
        )


COORD_REGISTER = "kvbus.coord.register"
"""Group heartbeats go to ``kvbus.coord.register.<group>`` (`group_subject`)."""
COORD_GROUPS = "kvbus.coord.groups"
COORD_LEAVE = "kvbus.coord.leave"
"""A group leaves on ``kvbus.coord.leave.<group>`` (`group_subject`)."""
COORD_LEASE = "kvbus.coord.lease"
COORD_RESERVE = "kvbus.coord.reserve"
COORD_UNRESERVE = "kvbus.coord.unreserve"
COORD_PLACE = "kvbus.coord.place"
#: JetStream KV bucket of the coordinator's durable state (groups, leases, reservations, tickets).
COORD_BUCKET = "kvbus_coord"


def group_subject(base: str, group: str) -> str:
    """The per-group form of a coordinator subject (`COORD_REGISTER`, `COORD_LEAVE`): ``<base>.<group>``.

    In secure mode a group scheduler may publish only on its own group's (so it cannot announce,
    or remove, another group); the coordinator drops a message whose group is not the subject's.
    """
    return f"{base}.{check_name('group', group)}"
