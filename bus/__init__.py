"""The bus client: `Bus.connect`, agents, `send` / `broadcast` / `gather`, the inbox."""

from kvbus.bus.agent import Agent
from kvbus.bus.client import Bus, Status
from kvbus.bus.config import BusConfig
from kvbus.bus.errors import (
    BusClosed,
    BusError,
    PayloadTooLarge,
    ReceiverGone,
    ReceiveTimeout,
    SchedulerUnavailable,
    TransferError,
    TransferInDoubt,
    TransferRejected,
    TransferTimeout,
)
from kvbus.bus.pacing import EmulatedLink
from kvbus.bus.types import Delivery, TransferReport
from kvbus.errors import ReservationRefused
from kvbus.net.transport import NatsTransport, NoResponders, Transport
from kvbus.protocol import Reason

__all__ = [
    "Agent",
    "Bus",
    "BusClosed",
    "BusConfig",
    "BusError",
    "Delivery",
    "EmulatedLink",
    "NatsTransport",
    "NoResponders",
    "PayloadTooLarge",
    "Reason",
    "ReceiveTimeout",
    "ReceiverGone",
    "ReservationRefused",
    "SchedulerUnavailable",
    "Status",
    "TransferError",
    "TransferInDoubt",
    "TransferRejected",
    "TransferReport",
    "TransferTimeout",
    "Transport",
]
