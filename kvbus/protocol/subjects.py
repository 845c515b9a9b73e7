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
``kvbus.agent.<sender>.ack.<rx>``      receiver -> sender: `Ack` (ending in the receiver's name: in secure
                                       mode only it may publish there, and the sender takes the
                                       receiver from the subject, never from the message)
``kvbus.agent.<rx>.data.<sender>.<t>`` sender -> receiver: chunk messages of a unicast transfer, and of a
                                       broadcast in secure mode (one stream per receiver: only the
                                       addressee may read it, only the sender publish it)
``kvbus.bcast.<sender>.<transfer>``    sender -> receivers: chunk messages of a broadcast (not secure mode:
                                       published once, NATS fans it out)
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
    """A subject under ``agent``'s own prefix (``kvbus.agent.<agent>.<kind>``: only it may subscribe)."""
    return f"kvbus.agent.{agent}.{kind}"


def inbox_subject(agent: str, sender: str) -> str:
    """Where ``sender`` opens transfers to ``agent``: the receiver's inbox, ending in the sender's
    name (in secure mode an agent may publish only on inboxes ending in its own name, and the
    receiver refuses an `Open` whose ``src`` is not the subject's: no agent can pose as another)."""
    return f"kvbus.agent.{agent}.inbox.{sender}"


def ack_subject(sender: str, rx: str) -> str:
    """Where ``rx`` acknowledges ``sender``'s transfers: under the sender's prefix, ending in the
    receiver's name (in secure mode an agent may publish acks only on subjects ending in its own
    name, so an ack's receiver is the subject's, whatever the message says)."""
    return f"kvbus.agent.{sender}.ack.{rx}"


def data_subject(agent: str, sender: str, transfer_id: str) -> str:
    """Chunks from ``sender`` to ``agent``, under the receiver's own prefix (only it may subscribe;
    in secure mode only ``sender`` may publish there: the subject carries its name)."""
    return f"kvbus.agent.{agent}.data.{sender}.{transfer_id}"


def bcast_subject(sender: str, transfer_id: str) -> str:
    """Chunks of a broadcast outside secure mode, under the sender's broadcast prefix (published once)."""
    return f"kvbus.bcast.{sender}.{transfer_id}"


def check_data_subject(subject: str, src: str, rx: str, transfer_id: str, *, broadcast: bool = True) -> None:
    """Reject an `Open` whose data subject is not one a receiver may subscribe to for it.

    Args:
        broadcast: whether the shared broadcast subject is acceptable (not in secure mode, where
            every receiver of a broadcast gets its own stream).

    Raises:
        WireFormatError: ``subject`` is not ``data_subject(rx, src, tid)`` (nor, with ``broadcast``,
            ``bcast_subject(src, tid)``).
    """
    allowed = [data_subject(rx, src, transfer_id)]
    if broadcast:
        allowed.append(bcast_subject(src, transfer_id))
    if subject not in allowed:
        raise WireFormatError(
            "open message", f"data subject {subject[:200]!r} is not {' or '.join(repr(a) for a in allowed)}"
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
