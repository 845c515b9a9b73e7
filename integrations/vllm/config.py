"""The connector's settings: ``kv_connector_extra_config`` of vLLM's ``KVTransferConfig``, checked."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvbus.errors import ConfigError, WireFormatError
from kvbus.net.servers import server_urls
from kvbus.protocol import check_name
from kvbus.protocol.messages import PRIORITY
from kvbus.protocol.wire import MAX_BYTES, MAX_SECONDS, Num, float_in, int_in
from kvbus.security import VLLM_INDEX_BUCKET

#: NATS URL when neither the extra config nor ``KVBUS_NATS_URL`` names one.
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_GROUP = "default"
DEFAULT_STORE_BYTES = 1 << 30
DEFAULT_LOOKUP_TIMEOUT_S = 1.0
DEFAULT_PULL_OVERHEAD_S = 0.3
DEFAULT_LOAD_TIMEOUT_S = 30.0
DEFAULT_CONNECT_TIMEOUT_S = 15.0
DEFAULT_INDEX_TTL_S = 3600.0
#: JetStream KV bucket of the prefix index (block key -> an agent that holds the prefix).
DEFAULT_INDEX_BUCKET = VLLM_INDEX_BUCKET
#: Longest prefix lookup: vLLM's scheduler step waits for it (a lookup that long is a fault anyway).
MAX_LOOKUP_TIMEOUT_S = 60.0
#: Longest load or connect timeout.
MAX_TIMEOUT_S = 3600.0
#: Shortest index TTL JetStream takes (a stream's max_age is at least 100 ms); the longest is the
#: wire's longest duration (31 years; JetStream keeps it in int64 nanoseconds, 292 years).
MIN_INDEX_TTL_S = 0.1
#: Longest ``role`` and ``model_name``, and most ``push_to`` agents (a scheduler's default
#: ``max_receivers``: a push to more is refused anyway).
MAX_TEXT = 256
MAX_PUSH_TO = 256
#: URL schemes nats.py connects with (a URL without one is ``nats://``).
NATS_SCHEMES = ("nats", "tls", "ws", "wss")
#: URL schemes of the cache tier's Redis-protocol server (redis-py's, and kvbus's ``+cluster``).
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """What ``kv_connector_extra_config`` may hold (every key optional except ``agent``).

    ``KVBUS_NATS_URL`` is used when ``nats_url`` is not given; authentication and TLS come from
    the ``KVBUS_NATS_*`` variables as for every kvbus process, or the agent's user from
    ``credentials``.
    """

    agent: str
    """This engine's agent name on the bus (letters, digits, ``-``, ``_``)."""
    nats_url: str = DEFAULT_NATS_URL
    """NATS server(s) of the kvbus deployment, comma-separated: ``nats://``, ``tls://``, ``ws://``
    or ``wss://`` URLs (or ``host:port``, as nats.py reads it)."""
    group: str = DEFAULT_GROUP
    """The group whose scheduler grants this agent's transfers."""
    role: str = "agent"
    """Free-form role (``coordinator``, ``executor`` ...), shown in `kvbus top` (at most 256 printable characters)."""
    priority: float = 1.0
    """Role priority in the scheduler's weights: 0..1e6, what the scheduler takes in a probe."""
    model_name: str | None = None
    """Model name in the KV signature (default: the served model name, else the model folder's
    name). Engines share KV only when their names (and shapes) agree."""
    medium: str | None = None
    """Insist on a medium for what this engine sends or pulls (``full``, ``int8`` ...); None lets
    the group scheduler's cost model choose per transfer."""
    pull: bool = True
    """Look up prefixes that other agents hold and pull them (else only pushed contexts load)."""
    push_to: tuple[str, ...] = ()
    """Agents every finished prompt's context is pushed to, at most 256 (per request:
    ``kv_transfer_params`` ``{"kvbus_push_to": [...]}``)."""
    redis_url: str | None = None
    """Redis-protocol server of the cache tier: blocks shed above ``store_bytes`` go there and
    blocks stored there by any agent can be loaded (``redis://``, ``rediss://``, ``unix://``, or
    their ``+cluster`` forms). None keeps the store in memory only."""
    store_bytes: int = DEFAULT_STORE_BYTES
    """Memory budget of the engine's block store (KV saved for sharing), in bytes."""
    pull_gate: bool = True
    """Never slower than prefilling: pull (or load from the cache tier) only when the load is
    predicted to cost less than the prefill it saves, both measured on this engine
    (`kvbus.integrations.vllm.worth`); false takes every hit."""
    pull_overhead_s: float = DEFAULT_PULL_OVERHEAD_S
    """What a pull is assumed to cost before this engine measured one (seconds, 0..3600)."""
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S
    """How long the scheduler waits for a prefix lookup before it prefills instead (at most 60 s:
    vLLM's scheduler step waits for it)."""
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S
    """How long a pull may take before its blocks are given back to vLLM for recompute (at most an hour)."""
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    """How long the connector waits for NATS when the engine starts (at most an hour)."""
    index_bucket: str = DEFAULT_INDEX_BUCKET
    """JetStream KV bucket of the prefix index (1-64 letters, digits, ``-``, ``_``)."""
    index_ttl_s: float = DEFAULT_INDEX_TTL_S
    """Seconds an index entry lives, 0.1..1e9 (created with the bucket; a holder refreshes it on
    every save)."""
    credentials: str | None = None
    """Secure mode: the credentials file ``kvbus up --secure`` writes
    (``~/.cache/kvbus/credentials.json``): both halves of the connector connect as this agent's
    user (its identity replaces one from ``KVBUS_NATS_*``, whose TLS settings still apply)."""
    secure: bool = False
    """The NATS server enforces kvbus's per-agent permissions (`kvbus.security`; true whenever
    ``credentials`` is set): set it when the agent's user comes from ``KVBUS_NATS_USER`` /
    ``KVBUS_NATS_PASSWORD`` and ``KVBUS_NATS_INBOX_PREFIX=_INBOX.<agent>``, as in the Helm chart."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Unrecognised keys that start with ``x_`` (kept for other tools, ignored here)."""

    def __post_init__(self) -> None:
        for name in ("agent", "group", "index_bucket"):
            try:
                check_name(name.replace("_", " "), getattr(self, name))
            except ValueError as exc:
                raise ConfigError(f"{_where(name)}: {exc}") from None
        if not isinstance(self.push_to, tuple) or len(self.push_to) > MAX_PUSH_TO:
            raise ConfigError(f"{_where('push_to')} must list at most {MAX_PUSH_TO} agent names")
        for target in self.push_to:
            try:
                check_name("agent", target)
            except ValueError as exc:
                raise ConfigError(f"{_where('push_to')}: {exc}") from None
        _check_text("role", self.role)
        if self.model_name is not None:
            _check_text("model_name", self.model_name)
        if self.medium is not None:
            from kvbus.codecs import get_codec

            try:
                get_codec(self.medium)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{_where('medium')}: {exc}") from None
        for flag in ("pull", "pull_gate", "secure"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{_where(flag)} must be true or false, got {_shown(getattr(self, flag))}")
        for name, kind in _NUMBERS.items():
            _check_number(name, getattr(self, name), kind)
        check_nats_url(self.nats_url, _where("nats_url"))
        if self.redis_url is not None:
            _check_redis_url(self.redis_url)
        if self.credentials is not None and not self.credentials.strip():
            raise ConfigError(f"{_where('credentials')} must name a file or be null")

    @property
    def is_secure(self) -> bool:
        """Whether the server enforces per-agent permissions (``secure``, or ``credentials`` given)."""
        return self.secure or self.credentials is not None

    def connect_options(self) -> dict[str, Any]:
        """`nats.connect` options of this engine's agent: ``KVBUS_NATS_*`` (`NatsAuth`), under the
        agent's user from ``credentials`` when set.

        Raises:
            ConfigError: the credentials file cannot be read or has no user for this agent, or a
                ``KVBUS_NATS_*`` setting is wrong.
        """
        from pathlib import Path

        from kvbus.net.auth import NatsAuth
        from kvbus.security import load_credentials

        role = None
        if self.credentials is not None:
            path = Path(self.credentials).expanduser()
            try:
                role = load_credentials(path).agent_options(self.agent)
            except KeyError:
                raise ConfigError(
                    f"{_where('credentials')}: {path} has no user for agent {self.agent!r} "
                    f"(kvbus up --secure --agents must list it)"
                ) from None
            except (OSError, ValueError, TypeError, IndexError) as exc:
                raise ConfigError(f"{_where('credentials')}: cannot read {path}: {exc}") from None
        return NatsAuth.from_env().connect_options(role)

    @classmethod
    def from_extra(cls, extra: object, *, environ: dict[str, str] | None = None) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``.

        Raises:
            ConfigError: a key is unknown, missing, of the wrong type or out of range (or
                ``KVBUS_NATS_URL`` is not a NATS URL); the message names it and what it allows.
        """
        env = os.environ if environ is None else environ
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ConfigError(f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}")
        odd = [k for k in extra if not isinstance(k, str)]
        if odd:
            raise ConfigError(f"kv_connector_extra_config keys must be strings, got {', '.join(map(_shown, odd[:8]))}")
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        unknown = sorted(k for k in extra if k not in fields and not k.startswith("x_"))
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {', '.join(map(_shown, unknown[:8]))}; "
                f"known keys: {', '.join(sorted(fields))}"
            )
        if "agent" not in extra:
            raise ConfigError("kv_connector_extra_config needs 'agent': this engine's agent name on the bus")
        values: dict[str, Any] = {"extra": {k: v for k, v in extra.items() if k not in fields}}
        for name, value in extra.items():
            if name in fields:
                values[name] = _coerce(name, value, _KINDS[name])
        if "nats_url" not in values:
            values["nats_url"] = check_nats_url(env.get("KVBUS_NATS_URL") or DEFAULT_NATS_URL, "KVBUS_NATS_URL")
        return cls(**values)


#: The numeric keys, as wire number types (`Num`: kind and range, the checks every message of
#: kvbus gets; the scheduler takes a priority in the same range).
_NUMBERS: dict[str, Num] = {
    "priority": PRIORITY,
    "store_bytes": int_in(1, MAX_BYTES),
    "lookup_timeout_s": float_in(0.001, MAX_LOOKUP_TIMEOUT_S),
    "pull_overhead_s": float_in(0.0, MAX_TIMEOUT_S),
    "load_timeout_s": float_in(0.001, MAX_TIMEOUT_S),
    "connect_timeout_s": float_in(0.001, MAX_TIMEOUT_S),
    "index_ttl_s": float_in(MIN_INDEX_TTL_S, MAX_SECONDS),
}
#: The type each key takes: a builtin, ``"str?"`` (a string or null), ``"names"`` (a list of
#: names) or a `Num`.
_KINDS: dict[str, Any] = {
    "agent": str,
    "nats_url": str,
    "group": str,
    "role": str,
    "model_name": "str?",
    "medium": "str?",
    "pull": bool,
    "pull_gate": bool,
    "secure": bool,
    "credentials": "str?",
    "push_to": "names",
    "redis_url": "str?",
    "index_bucket": str,
    **_NUMBERS,
}


def _where(name: str) -> str:
    return f"kv_connector_extra_config[{name!r}]"


def _shown(value: object) -> str:
    """``value`` for an error message: its repr, cut to 64 characters."""
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def _check_number(name: str, value: object, kind: Num) -> Any:
    try:
        return kind.check("kv_connector_extra_config", name, value)
    except WireFormatError:
        raise ConfigError(f"{_where(name)} must be {kind.describe()}, got {_shown(value)}") from None


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str) or not value or len(value) > MAX_TEXT or not value.isprintable():
        raise ConfigError(f"{_where(name)} must be 1-{MAX_TEXT} printable characters, got {_shown(value)}")


def check_nats_url(url: object, where: str) -> str:
    """``url`` if it is a NATS server list nats.py can connect to; raise `ConfigError` naming ``where`` otherwise.

    Each comma-separated server is ``[scheme://][user[:password]@]host[:port]`` with a scheme of
    `NATS_SCHEMES` (none: ``nats://``); websocket and plain servers cannot be mixed (nats.py
    refuses it). Only the shape is checked here, not that a server answers.
    """
    expected = f"a NATS URL such as nats://host:4222 (schemes {', '.join(s + '://' for s in NATS_SCHEMES)})"
    if not isinstance(url, str):
        raise ConfigError(f"{where} must be {expected}, got {_shown(url)}")
    try:
        servers = server_urls(url)
    except ConfigError:
        raise ConfigError(f"{where} must be {expected}, got {_shown(url)}") from None
    websocket = set()
    for server in servers:
        scheme = _nats_scheme(server)
        if scheme is None:
            raise ConfigError(f"{where}: {_shown(server)} is not {expected}")
        websocket.add(scheme in ("ws", "wss"))
    if len(websocket) > 1:
        raise ConfigError(f"{where}: websocket (ws://, wss://) and other servers cannot be mixed, got {_shown(url)}")
    return url


def _nats_scheme(server: str) -> str | None:
    """The scheme of one server URL as nats.py reads it (none: ``nats``), or None if it is not one."""
    if any(c.isspace() or not c.isprintable() for c in server):
        return None
    try:
        parts = urlsplit(server if "://" in server else f"nats://{server}")
        port = parts.port  # raises for a port that is not a number in 0..65535
    except ValueError:
        return None
    if parts.scheme not in NATS_SCHEMES or port == 0 or not _host_ok(parts.hostname):
        return None
    if parts.scheme not in ("ws", "wss") and (parts.path not in ("", "/") or parts.query or parts.fragment):
        return None
    return parts.scheme


def _host_ok(host: str | None) -> bool:
    if not host or len(host) > 253:
        return False
    if ":" in host:  # an IPv6 address (urlsplit took its brackets off)
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            return False
        return True
    return host.isascii() and all(c.isalnum() or c in "-._" for c in host)


def _check_redis_url(url: str) -> None:
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in REDIS_SCHEMES or not rest or any(c.isspace() or not c.isprintable() for c in url):
        raise ConfigError(
            f"{_where('redis_url')} must be a Redis URL such as redis://host:6379/0 "
            f"(schemes {', '.join(s + '://' for s in REDIS_SCHEMES)}) or null, got {_shown(url)}"
        )


def _coerce(name: str, value: object, kind: Any) -> Any:
    where = _where(name)
    if isinstance(kind, Num):
        if kind.kind is int and isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
            value = int(value)
        return _check_number(name, value, kind)
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
        raise ConfigError(f"{where} must be true or false, got {_shown(value)}")
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a non-empty string, got {_shown(value)}")
    return value
