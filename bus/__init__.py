"""The bus client: `Bus.connect`, agents, `send` / `broadcast` / `gather`, the inbox."""

from kvbus.bus.client import Agent, Bus, Status
from kvbus.bus.config import BusConfig
from kvbus.bus.errors import (
    BusClosed,
    BusError,
    PayloadTooLarge,
    ReceiverGone,
    ReceiveTimeout,
    SchedulerUnavailable,
    TransferError,
    TransferRejected,
    TransferTimeout,
)
from kvbus.bus.pacing import EmulatedLink
from kvbus.errors import ReservationRefused
from kvbus.net.transport import NatsTransport, NoResponders, Transport
from kvbus.bus.types import Delivery, TransferReport

__all__ = [
    "Agent", "Bus", "BusClosed", "BusConfig", "BusError", "Delivery", "EmulatedLink", "NatsTransport", "NoResponders",
    "PayloadTooLarge", "ReceiveTimeout", "ReceiverGone", "ReservationRefused", "SchedulerUnavailable", "Status", "TransferError",
    "TransferRejected", "TransferReport", "TransferTimeout", "Transport",
]
