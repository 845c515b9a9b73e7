"""The message base of the wire protocol: msgpack maps with a type tag ``t`` and a protocol
version ``v``, decoded with size limits and a type check of every field.

Each message is a frozen dataclass with ``encode()`` and a validating ``decode()`` that raises
`WireFormatError` for anything malformed.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields, is_dataclass
from typing import Any, ClassVar, TypeVar, overload

import msgpack

from kvbus.errors import WireFormatError

PROTOCOL_VERSION = 1

#: Largest control message we decode; anything longer is rejected before msgpack sees it.
MAX_CONTROL_BYTES = 1 << 20

M = TypeVar("M", bound="Message")
M2 = TypeVar("M2", bound="Message")
M3 = TypeVar("M3", bound="Message")


def _default(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return asdict(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} on the wire")


def packb(obj: Any) -> bytes:
    """Pack ``obj`` as msgpack (bin type for bytes); nested dataclasses become maps."""
    packed: bytes = msgpack.packb(obj, use_bin_type=True, default=_default)
    return packed


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def unpackb(data: bytes | bytearray | memoryview, what: str, limit: int = MAX_CONTROL_BYTES) -> Any:
    """Decode msgpack from the wire with size limits; raise `WireFormatError` on anything wrong."""
    if len(data) > limit:
        raise WireFormatError(what, f"{len(data)} bytes is over the limit of {limit}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=1 << 16,
            max_map_len=1 << 12,
        )
    except Exception as exc:  # noqa: BLE001 - msgpack raises a zoo of types for bad input
        raise WireFormatError(what, f"not valid msgpack ({type(exc).__name__}: {exc})") from None


class AnyValue:
    """Marker: a field of this type accepts any msgpack value (validated by its user)."""


@dataclass(frozen=True, slots=True)
class Message:
    """Base of control messages: ``t`` names the type, the fields are the payload."""

    TYPE: ClassVar[str] = ""

    def encode(self) -> bytes:
        """This message as a msgpack map with its type tag ``t`` and protocol version ``v``."""
        # Shallow: the field values are msgpack-ready (nested dataclasses go through `_default`);
        # `dataclasses.asdict` deep-copies every list and dict and was a sixth of a busy
        # scheduler's time.
        cls: type = type(self)  # plain `type`: mypy thinks a dataclass's class object is not Hashable
        body = {name: getattr(self, name) for name in _field_names(cls)}
        body["t"] = self.TYPE
        body["v"] = PROTOCOL_VERSION
        return packb(body)

    @classmethod
    def decode(cls: type[M], data: bytes | bytearray | memoryview) -> M:
        """Decode and validate; raises `WireFormatError` for anything malformed."""
        what = f"{cls.TYPE} message"
        body = unpackb(data, what)
        return cls.from_map(body)

    @classmethod
    def from_map(cls: type[M], body: object) -> M:
        """Validate a decoded map (tag, version, every field's wire type) and build the message.

        Raises:
            WireFormatError: not a map, another tag or version, a missing field or a field of the wrong type.
        """
        what = f"{cls.TYPE} message"
        if not isinstance(body, dict):
            raise WireFormatError(what, f"expected a map, got {type(body).__name__}")
        if body.get("t") != cls.TYPE:
            raise WireFormatError(what, f"type tag is {body.get('t')!r}")
        if body.get("v") != PROTOCOL_VERSION:
            raise WireFormatError(what, f"protocol version {body.get('v')!r}, this side speaks {PROTOCOL_VERSION}")
        kwargs = {}
        for f in fields(cls):
            if f.name not in body:
                if f.default is not MISSING or f.default_factory is not MISSING:
                    continue
                raise WireFormatError(what, f"missing field {f.name!r}")
            kwargs[f.name] = _check_type(what, f.name, body[f.name], _FIELD_TYPES[cls][f.name])
        return cls(**kwargs)


_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def message_types() -> list[type[Message]]:
    """Every registered message class (for fuzzers and docs)."""
    return sorted(_FIELD_TYPES, key=lambda c: c.TYPE)


def _check_type(what: str, name: str, value: Any, kind: Any) -> Any:
    if kind is AnyValue:
        return value
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        if not isinstance(value, str):
            raise WireFormatError(what, f"field {name!r} must be a string code, got {type(value).__name__}")
        parse = getattr(kind, "parse", None)
        if parse is not None:
            return parse(value)
        try:
            return kind(value)
        except ValueError:
            raise WireFormatError(what, f"field {name!r}: unknown code {value[:64]!r}") from None
    allowed = kind if isinstance(kind, tuple) else (kind,)
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and bool not in allowed:
        raise WireFormatError(what, f"field {name!r} must be {_names(allowed)}, got bool")
    if not isinstance(value, allowed):
        raise WireFormatError(what, f"field {name!r} must be {_names(allowed)}, got {type(value).__name__}")
    return value


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def message(tag: str, types: dict[str, Any]) -> Callable[[type[M]], type[M]]:
    """Register a message class under its tag with the wire types of its fields."""

    def wrap(cls: type[M]) -> type[M]:
        cls.TYPE = tag
        _FIELD_TYPES[cls] = types
        return cls

    return wrap


OptFloat = (float, type(None))
OptStr = (str, type(None))


# One overload per arity, so that a caller of ``decode_message(data, Grant, Control)`` gets
# ``Grant | Control`` (and narrows it with isinstance), not their common base.
@overload
def decode_message(data: bytes | bytearray | memoryview, t1: type[M], /) -> M: ...
@overload
def decode_message(data: bytes | bytearray | memoryview, t1: type[M], t2: type[M2], /) -> M | M2: ...
@overload
def decode_message(data: bytes | bytearray | memoryview, t1: type[M], t2: type[M2], t3: type[M3], /) -> M | M2 | M3: ...
@overload
def decode_message(data: bytes | bytearray | memoryview, *types: type[Message]) -> Message: ...
def decode_message(data: bytes | bytearray | memoryview, *types: type[Message]) -> Message:
    """Decode a message that may be any of ``types`` (dispatch on its tag)."""
    names = {t.TYPE: t for t in types}
    body = unpackb(data, "/".join(names) + " message")
    tag = body.get("t") if isinstance(body, dict) else None
    if tag not in names:
        raise WireFormatError("/".join(names) + " message", f"unexpected type tag {tag!r}")
    return names[tag].from_map(body)
