"""The message base of the wire protocol: msgpack maps with a type tag ``t`` and a protocol
version ``v``, decoded with size limits and a type check of every field.

Each message is a frozen dataclass with ``encode()`` and a validating ``decode()`` that raises
`WireFormatError` for anything malformed.

Every number is checked where it is decoded, so no part downstream ever sees a NaN, an infinity
or an absurd size: each numeric field declares its range (`Num`, made by `int_in` and
`float_in`; floats are finite unless the field says it takes infinity), list fields may declare
their elements (`ListOf`), and the floats inside maps and lists (codec metadata, decision
records, signatures) must be finite too. A bare ``int`` or ``float`` in a message's types still
gets the defaults (a signed 64-bit integer; a finite float).
"""

from __future__ import annotations

import enum
import functools
import math
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
    """Marker: a field of this type accepts any msgpack value (validated by its user; floats in it
    must still be finite)."""


#: Defaults of a bare ``int`` field: what msgpack's signed 64-bit integers hold.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: Ranges the messages' fields use.
MAX_COUNT = 2**32
"""Chunks, tokens, indexes, agents: counts that fit 32 bits."""
MAX_BYTES = 2**53
"""Byte sizes (8 PiB; every such integer is exact as a float)."""
MAX_EPOCH_S = 1e11
"""Wall-clock times in epoch seconds (year 5138)."""
MAX_SECONDS = 1e9
"""Durations and periods (31 years)."""
MAX_RATE_BPS = 1e15
"""Rates and capacities in bytes/s (8 Pbit/s)."""
MAX_PRIORITY = 1e6
"""Role priorities and weights."""


@dataclass(frozen=True, slots=True)
class Num:
    """The wire type of a numeric field: an integer or a float within ``lo..hi``.

    A float field is finite unless ``inf`` (then ``+inf`` is allowed, never NaN); an integer
    field takes no bool; an int arriving for a float field is converted.
    """

    kind: type
    """``int`` or ``float``."""
    lo: float
    hi: float
    optional: bool = False
    """None is allowed too."""
    inf: bool = False
    """``+inf`` is allowed (a float field that means "unbounded")."""

    def check(self, what: str, name: str, value: Any) -> Any:
        """``value`` if it is of this type and in range; raise `WireFormatError` otherwise."""
        if value is None and self.optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            got = "bool" if isinstance(value, bool) else type(value).__name__
            raise WireFormatError(what, f"field {name!r} must be {self.describe()}, got {got}")
        if self.kind is int:
            if not isinstance(value, int):
                raise WireFormatError(what, f"field {name!r} must be {self.describe()}, got float")
        else:
            value = float(value)
            if math.isnan(value) or (math.isinf(value) and not (self.inf and value > 0)):
                raise WireFormatError(what, f"field {name!r} must be {self.describe()}, got {value}")
            if math.isinf(value):
                return value
        if not self.lo <= value <= self.hi:
            shown = value if abs(value) < 1e30 else f"{value:.3g}"
            raise WireFormatError(what, f"field {name!r} is {shown}, outside {self.describe()}")
        return value

    def describe(self) -> str:
        """The type and range in words, for error messages."""
        kind = "an integer" if self.kind is int else ("a float" if self.inf else "a finite float")
        tail = " or null" if self.optional else ""
        return f"{kind} within {self.lo:g}..{self.hi:g}{' (or inf)' if self.inf else ''}{tail}"


def int_in(lo: int, hi: int, *, optional: bool = False) -> Num:
    """An integer field within ``lo..hi``."""
    return Num(int, lo, hi, optional)


def float_in(lo: float, hi: float, *, optional: bool = False, inf: bool = False) -> Num:
    """A float field within ``lo..hi``, finite unless ``inf``."""
    return Num(float, lo, hi, optional, inf)


@dataclass(frozen=True, slots=True)
class ListOf:
    """The wire type of a list field whose elements have a type (a `Num`, or ``str``)."""

    element: Any
    max_len: int = 1 << 16

    def check(self, what: str, name: str, value: Any) -> list[Any]:
        """``value`` if it is a list of at most ``max_len`` such elements; raise `WireFormatError` otherwise."""
        if not isinstance(value, list):
            raise WireFormatError(what, f"field {name!r} must be a list, got {type(value).__name__}")
        if len(value) > self.max_len:
            raise WireFormatError(what, f"field {name!r} has {len(value)} entries, more than {self.max_len}")
        element = self.element
        if isinstance(element, Num):
            if (
                element.kind is int
                and value
                and all(type(item) is int for item in value)
                and element.lo <= min(value)
                and max(value) <= element.hi
            ):
                return value  # plain ints in range (an Open's sizes: one pass, not a check per entry)
            for item in value:
                element.check(what, f"{name}[]", item)
        else:
            for item in value:
                if not isinstance(item, self.element) or isinstance(item, bool):
                    kind = self.element.__name__
                    raise WireFormatError(what, f"field {name!r} must hold {kind}s, got {type(item).__name__}")
        return value


#: Bare numeric types: the defaults.
_DEFAULT_INT = Num(int, INT64_MIN, INT64_MAX)
_DEFAULT_FLOAT = Num(float, -math.inf, math.inf)


def _finite(value: Any) -> bool:
    """Whether every float in a nested msgpack value is finite (maps and lists, walked without recursion)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


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


def field_types(cls: type[Message]) -> dict[str, Any]:
    """The wire type of each field of a registered message class (a copy; for fuzzers and docs)."""
    return dict(_FIELD_TYPES[cls])


def _check_type(what: str, name: str, value: Any, kind: Any) -> Any:
    if isinstance(kind, (Num, ListOf)):
        return kind.check(what, name, value)
    if kind is AnyValue or kind is dict or kind is list:
        if kind is not AnyValue and not isinstance(value, kind):
            raise WireFormatError(what, f"field {name!r} must be {kind.__name__}, got {type(value).__name__}")
        if not _finite(value):
            raise WireFormatError(what, f"field {name!r} holds a NaN or infinite number")
        return value
    if kind is int:
        return _DEFAULT_INT.check(what, name, value)
    if kind is float:
        return _DEFAULT_FLOAT.check(what, name, value)
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
    if isinstance(value, float) and float in allowed and not math.isfinite(value):
        raise WireFormatError(what, f"field {name!r} must be a finite number, got {value}")
    if int in allowed and isinstance(value, int) and not isinstance(value, bool):
        _DEFAULT_INT.check(what, name, value)
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
"""A finite float or null (prefer `float_in` with ``optional=True``, which gives a range too)."""
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
