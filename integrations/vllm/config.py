"""The connector's settings: ``kv_connector_extra_config`` of vLLM's ``KVTransferConfig``, checked."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from kvbus.errors import ConfigError

#: NATS URL when neither the extra config nor ``KVBUS_NATS_URL`` names one.
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_GROUP = "default"
DEFAULT_STORE_BYTES = 1 << 30
DEFAULT_LOOKUP_TIMEOUT_S = 1.0
DEFAULT_LOAD_TIMEOUT_S = 30.0
DEFAULT_CONNECT_TIMEOUT_S = 15.0
DEFAULT_INDEX_TTL_S = 3600.0
#: JetStream KV bucket of the prefix index (block key -> an agent that holds the prefix).
DEFAULT_INDEX_BUCKET = "kvbus_vllm_prefix"


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """What ``kv_connector_extra_config`` may hold (every key optional except ``agent``).

    ``KVBUS_NATS_URL`` is used when ``nats_url`` is not given; authentication and TLS come from
    the ``KVBUS_NATS_*`` variables as for every kvbus process.
    """

    agent: str
    """This engine's agent name on the bus (letters, digits, ``-``, ``_``)."""
    nats_url: str = DEFAULT_NATS_URL
    """NATS server(s) of the kvbus deployment."""
    group: str = DEFAULT_GROUP
    """The group whose scheduler grants this agent's transfers."""
    role: str = "agent"
    """Free-form role (``coordinator``, ``executor`` ...), shown in `kvbus top`."""
    priority: float = 1.0
    """Role priority in the scheduler's weights."""
    model_name: str | None = None
    """Model name in the KV signature (default: the served model name, else the model folder's
    name). Engines share KV only when their names (and shapes) agree."""
    medium: str | None = None
    """Insist on a medium for what this engine sends or pulls (``full``, ``int8`` ...); None lets
    the group scheduler's cost model choose per transfer."""
    pull: bool = True
    """Look up prefixes that other agents hold and pull them (else only pushed contexts load)."""
    push_to: tuple[str, ...] = ()
    """Agents every finished prompt's context is pushed to (per request: ``kv_transfer_params``
    ``{"kvbus_push_to": [...]}``)."""
    redis_url: str | None = None
    """Redis-protocol server of the cache tier: blocks shed above ``store_bytes`` go there and
    blocks stored there by any agent can be loaded. None keeps the store in memory only."""
    store_bytes: int = DEFAULT_STORE_BYTES
    """Memory budget of the engine's block store (KV saved for sharing), in bytes."""
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S
    """How long the scheduler waits for a prefix lookup before it prefills instead."""
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S
    """How long a pull may take before its blocks are given back to vLLM for recompute."""
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    """How long the connector waits for NATS when the engine starts."""
    index_bucket: str = DEFAULT_INDEX_BUCKET
    """JetStream KV bucket of the prefix index."""
    index_ttl_s: float = DEFAULT_INDEX_TTL_S
    """Seconds an index entry lives (created with the bucket; a holder refreshes it on every save)."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Unrecognised keys that start with ``x_`` (kept for other tools, ignored here)."""

    def __post_init__(self) -> None:
        from kvbus.protocol import check_name

        for name in ("agent", "group"):
            try:
                check_name(name, getattr(self, name))
            except ValueError as exc:
                raise ConfigError(f"kv_connector_extra_config[{name!r}]: {exc}") from None
        for target in self.push_to:
            try:
                check_name("agent", target)
            except ValueError as exc:
                raise ConfigError(f"kv_connector_extra_config['push_to']: {exc}") from None
        if self.medium is not None:
            from kvbus.codecs import get_codec

            try:
                get_codec(self.medium)
            except ValueError as exc:
                raise ConfigError(f"kv_connector_extra_config['medium']: {exc}") from None
        if self.store_bytes <= 0:
            raise ConfigError(f"kv_connector_extra_config['store_bytes'] must be positive, got {self.store_bytes}")
        for name in ("lookup_timeout_s", "load_timeout_s", "connect_timeout_s", "index_ttl_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"kv_connector_extra_config[{name!r}] must be positive, got {getattr(self, name)}")

    @classmethod
    def from_extra(cls, extra: object, *, environ: dict[str, str] | None = None) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``.

        Raises:
            ConfigError: a key is unknown, missing or of the wrong type; the message names it
                and what was expected.
        """
        env = os.environ if environ is None else environ
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ConfigError(f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        unknown = sorted(k for k in extra if k not in fields and not str(k).startswith("x_"))
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {', '.join(map(repr, unknown))}; "
                f"known keys: {', '.join(sorted(fields))}"
            )
        if "agent" not in extra:
            raise ConfigError("kv_connector_extra_config needs 'agent': this engine's agent name on the bus")
        values: dict[str, Any] = {"extra": {k: v for k, v in extra.items() if k not in fields}}
        for name, value in extra.items():
            if name in fields:
                values[name] = _coerce(name, value, _KINDS[name])
        if "nats_url" not in values:
            values["nats_url"] = env.get("KVBUS_NATS_URL") or DEFAULT_NATS_URL
        return cls(**values)


#: The type each key takes: a builtin, ``"str?"`` (a string or null), or ``"names"`` (a list of names).
_KINDS: dict[str, Any] = {
    "agent": str,
    "nats_url": str,
    "group": str,
    "role": str,
    "priority": float,
    "model_name": "str?",
    "medium": "str?",
    "pull": bool,
    "push_to": "names",
    "redis_url": "str?",
    "store_bytes": int,
    "lookup_timeout_s": float,
    "load_timeout_s": float,
    "connect_timeout_s": float,
    "index_bucket": str,
    "index_ttl_s": float,
}


def _coerce(name: str, value: object, kind: Any) -> Any:
    where = f"kv_connector_extra_config[{name!r}]"
    if kind == "str?":
        if value is None or isinstance(value, str):
            return value or None
        raise ConfigError(f"{where} must be a string or null, got {type(value).__name__}")
    if kind == "names":
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where} must be a list of agent names")
        return tuple(value)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a non-empty string, got {value!r}")
    return value
