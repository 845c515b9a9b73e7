"""kvbus: move context (tokens and KV-caches) between cooperating LLM agents over NATS.

The names most programs need, in one place::

    from kvbus import Bus, KVCache

    async with await Bus.connect("nats://127.0.0.1:4222") as bus:
        planner = await bus.agent("planner", group="default", runner=runner)
        report = await planner.send("writer", kv)

Each part keeps its full API in its own package: `kvbus.bus` (the client), `kvbus.codecs` (media),
`kvbus.group_scheduler`, `kvbus.coordinator`, `kvbus.cachetier`, `kvbus.net` (NATS plumbing) and
`kvbus.protocol` (the wire protocol).

The names are imported on first use (PEP 562), so that ``import kvbus.codecs`` or
``import kvbus.protocol`` loads neither the bus nor NATS nor Redis.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
        TransferInDoubt,
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
    "TransferInDoubt",
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

#: Each part and the public names imported from it (the same as the ``TYPE_CHECKING`` block).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "kvbus.bus": (
        "Agent",
        "Bus",
        "BusClosed",
        "BusConfig",
        "BusError",
        "Delivery",
        "EmulatedLink",
        "PayloadTooLarge",
        "ReceiverGone",
        "ReceiveTimeout",
        "SchedulerUnavailable",
        "TransferError",
        "TransferInDoubt",
        "TransferRejected",
        "TransferReport",
        "TransferTimeout",
    ),
    "kvbus.cachetier": ("CacheTier", "CacheTierConfig"),
    "kvbus.codecs": ("Codec", "Encoded", "HFRunner", "ModelRunner", "available_codecs", "get_codec"),
    "kvbus.coordinator": ("Coordinator", "CoordinatorConfig"),
    "kvbus.errors": (
        "ConfigError",
        "CoordinatorUnavailable",
        "KVBusError",
        "ReservationRefused",
        "SignatureMismatch",
        "WireFormatError",
    ),
    "kvbus.group_scheduler": ("GroupScheduler", "SchedulerConfig"),
    "kvbus.kvcache": ("KVCache",),
    "kvbus.net.auth": ("NatsAuth",),
    "kvbus.protocol": ("Reason",),
    "kvbus.signature": ("ModelSignature",),
}
_MODULES = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    # PEP 562: a public name is imported from its module on first use, then kept here.
    module = _MODULES.get(name)
    if module is None:
        # AttributeError also lets ``from kvbus import telemetry`` fall back to the submodule.
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
