"""Errors of the group scheduler."""

from __future__ import annotations

from kvbus.errors import KVBusError


class WrongSender(KVBusError, ValueError):
    """A message names an agent other than the one whose subject it came on (the server lets each
    agent publish only on its own subjects, so a message cannot speak for another agent).

    Attributes:
        claimed: the agent the message names.
        sender: the agent whose subject it came on.
    """

    def __init__(self, claimed: str, sender: str) -> None:
        self.claimed = claimed
        self.sender = sender
        super().__init__(f"a message for agent {claimed!r} came on the subject of {sender!r}")


class TooManyReceivers(KVBusError, ValueError):
    """A request names more receivers than the scheduler takes in one request (``max_receivers``).

    Attributes:
        count: how many it names.
        limit: the most a request may name.
    """

    def __init__(self, count: int, limit: int) -> None:
        self.count = count
        self.limit = limit
        super().__init__(f"a request names {count} receivers; at most {limit} are allowed (max_receivers)")
