"""Configuration helpers: frozen dataclasses whose fields can be overridden by ``KVBUS_*`` variables."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, TypeVar

from kvbus.errors import ConfigError

ENV_PREFIX = "KVBUS_"

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def from_env(cls: type[T], prefix: str, environ: dict[str, str] | None = None, **overrides: Any) -> T:
    """Build a config dataclass from its defaults, then ``KVBUS_<PREFIX>_<FIELD>`` variables, then ``overrides``.

    Raises:
        ConfigError: a variable does not parse as the field's type.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = f"{ENV_PREFIX}{prefix}_{f.name}".upper()
        if key in env:
            values[f.name] = _parse(key, env[key], f.type)
    values.update(overrides)
    return cls(**values)


def _parse(key: str, raw: str, kind: Any) -> Any:
    kind = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        return raw
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a valid {kind}") from None


def redact_url(url: str | None) -> str:
    """``url`` with any password or token replaced by ``***``, for prints and logs.

    ``nats://user:secret@host:4222`` becomes ``nats://user:***@host:4222`` and a bare token
    (``nats://s3cr3t@host``) becomes ``nats://***@host``; comma-separated server lists are
    redacted one by one. URLs without credentials come back unchanged.
    """
    if not url:
        return ""
    if "," in url:
        return ",".join(redact_url(u.strip()) for u in url.split(","))
    scheme, sep, rest = url.rpartition("://")
    userinfo, at, hostpart = rest.rpartition("@")
    if not at:
        return url
    user, colon, _secret = userinfo.partition(":")
    masked = f"{user}:***" if colon else "***"
    return f"{scheme}{sep}{masked}@{hostpart}"
