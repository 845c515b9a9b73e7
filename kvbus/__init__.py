"""kvbus: move context (tokens and KV-caches) between cooperating LLM agents over NATS.

The names most programs need, in one place::

    from kvbus import Bus, KVCache

    async with await Bus.connect("nats://127.0.0.1:4222") as bus:
        planner = await bus.agent("planner", group="default", runner=runner)
        report = await planner.send("writer", kv)

Each part keeps its full API in its own package: `kvbus.bus` (the client), `kvbus.codecs` (media),
`kvbus.group_scheduler`, `kvbus.coordinator`, `kvbus.cachetier`, `kvbus.net` (NATS plumbing) and
`kvbus.protocol` (the wire protocol).
"""

from kvbus.bus import (
    Agent,
    Bus,
    BusClosed,
    BusConfig,
    BusError,
    Delivery,
    EmulatedLink,
    PayloadTooLarge,
    ReceiverGone,
    ReceiveTimeout,
    SchedulerUnavailable,
    TransferError,
    TransferRejected,
    TransferReport,
    TransferTimeout,
)
from kvbus.cachetier import CacheTier, CacheTierConfig
from kvbus.codecs import Codec, Encoded, HFRunner, ModelRunner, available_codecs, get_codec
from kvbus.coordinator import Coordinator, CoordinatorConfig
from kvbus.errors import (
    ConfigError,
    CoordinatorUnavailable,
    KVBusError,
    ReservationRefused,
    SignatureMismatch,
    WireFormatError,
)
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig
from kvbus.kvcache import KVCache
from kvbus.net.auth import NatsAuth
from kvbus.protocol import Reason
from kvbus.signature import ModelSignature

__version__ = "0.2.0"

__all__ = [
    # the client
    "Bus",
    "Agent",
    "BusConfig",
    "Delivery",
    "TransferReport",
    "EmulatedLink",
    "NatsAuth",
    # what travels
    "KVCache",
    "ModelSignature",
    "Codec",
    "Encoded",
    "ModelRunner",
    "HFRunner",
    "get_codec",
    "available_codecs",
    # the services
    "GroupScheduler",
    "SchedulerConfig",
    "Coordinator",
    "CoordinatorConfig",
    "CacheTier",
    "CacheTierConfig",
    # errors
    "KVBusError",
    "BusError",
    "BusClosed",
    "TransferError",
    "TransferRejected",
    "TransferTimeout",
    "ReceiverGone",
    "ReceiveTimeout",
    "SchedulerUnavailable",
    "PayloadTooLarge",
    "ReservationRefused",
    "CoordinatorUnavailable",
    "ConfigError",
    "SignatureMismatch",
    "WireFormatError",
    "Reason",
    "__version__",
]
