"""Medium specs: the small language that names a codec and its parameters.

Grammar (whitespace is ignored)::

    spec   := stage ("+" stage)*
    stage  := NAME [ "(" [ arg ("," arg)* ] ")" ]
    arg    := value | NAME "=" value          (positional arguments first)
    value  := INT | FLOAT | NAME

``NAME`` is ``[a-z][a-z0-9_]*``. A positional argument sets the stage's first parameter
(``topk(0.25)`` is ``topk(keep=0.25)``, ``int4(64)`` is ``int4(g=64)``).

Composition, outermost first: an optional ``delta``, then an optional selector (``topk``),
then one KV codec (``full``, ``int8``, ``int4``, ``lowrank``); ``delta`` may also wrap
``tokens``; ``summary`` and ``tokens`` otherwise stand alone. A wrapper without an inner codec
wraps ``full`` (``delta`` is ``delta+full``).

The canonical form (a codec's ``.name``, ``Encoded.codec``, the keys of a calibration profile)
omits parameters at their default, prints the first parameter positionally and the others as
``key=value`` in declaration order, and always names the inner codec:
``get_codec("topk(keep=0.25) + int8").name == "topk+int8"``,
``get_codec("delta").name == "delta+full"``, ``get_codec("int4(g=64)").name == "int4(64)"``.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any

from kvbus.codecs.errors import SpecError

#: Longest spec accepted (specs arrive from the wire).
MAX_SPEC_CHARS = 256
#: Most stages in one spec.
MAX_STAGES = 4

_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
_STAGE = re.compile(r"([a-z][a-z0-9_]*)(?:\((.*)\))?\Z", re.S)
_INT = re.compile(r"[+-]?[0-9]+\Z")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\Z")


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter of a codec, as it may appear in a spec."""

    name: str
    """Its name in ``key=value`` form."""
    kind: type
    """``int``, ``float`` or ``str``."""
    default: Any
    """Its value when not given."""
    lo: float | None = None
    """Smallest allowed value (numbers)."""
    hi: float | None = None
    """Largest allowed value (numbers)."""
    choices: tuple[str, ...] = ()
    """Allowed values (strings)."""
    lo_open: bool = False
    """Whether ``lo`` itself is excluded."""

    def coerce(self, value: Any, spec: str, stage: str) -> Any:
        """``value`` checked and converted to this parameter's kind.

        Raises:
            SpecError: wrong kind or out of range.
        """
        where = f"{stage}({self.name}=...)"
        if self.kind is str:
            if not isinstance(value, str) or value not in self.choices:
                raise SpecError(spec, f"{where} must be one of {', '.join(self.choices)}, got {value!r}")
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(spec, f"{where} must be a number, got {value!r}")
        if self.kind is int:
            if not isinstance(value, int):
                raise SpecError(spec, f"{where} must be an integer, got {value!r}")
        else:
            value = float(value)
            if not math.isfinite(value):
                raise SpecError(spec, f"{where} must be finite, got {value!r}")
        low_bad = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        if low_bad or (self.hi is not None and value > self.hi):
            lo = "" if self.lo is None else f"{'>' if self.lo_open else '>='} {self.lo:g}"
            hi = "" if self.hi is None else f"<= {self.hi:g}"
            raise SpecError(spec, f"{where} must be {' and '.join(x for x in (lo, hi) if x)}, got {value!r}")
        return value

    def render(self, value: Any) -> str:
        """The canonical text of ``value``."""
        if self.kind is float:
            return repr(float(value))
        return str(value)


@dataclass(frozen=True, slots=True)
class Stage:
    """One parsed stage: a medium name, its positional and keyword arguments (not yet validated)."""

    name: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]


def _split_top(text: str, sep: str, spec: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
            if depth > 1:
                raise SpecError(spec, "nested parentheses")
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise SpecError(spec, "unbalanced ')'")
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise SpecError(spec, "unbalanced '('")
    parts.append(text[start:])
    return parts


def _value(text: str, spec: str) -> Any:
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    if _NAME.match(text):
        return text
    raise SpecError(spec, f"{text!r} is not a number or a name")


def parse_spec(spec: object) -> list[Stage]:
    """Split a spec into stages (syntax only; parameters are checked by the codecs).

    Raises:
        SpecError: not a string, too long, empty, or malformed.
    """
    if not isinstance(spec, str):
        raise SpecError(repr(spec)[:40], f"a medium spec must be a string, got {type(spec).__name__}")
    shown = spec if len(spec) <= 60 else spec[:57] + "..."
    if len(spec) > MAX_SPEC_CHARS:
        raise SpecError(shown, f"longer than {MAX_SPEC_CHARS} characters")
    text = "".join(spec.split()).lower()
    if not text:
        raise SpecError(shown, "empty")
    pieces = _split_top(text, "+", shown)
    if len(pieces) > MAX_STAGES:
        raise SpecError(shown, f"more than {MAX_STAGES} stages")
    stages = []
    for piece in pieces:
        m = _STAGE.match(piece)
        if not m:
            raise SpecError(shown, f"stage {piece!r} is not NAME or NAME(args)" if piece else "empty stage")
        name, inner = m.group(1), m.group(2)
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        if inner:
            for arg in _split_top(inner, ",", shown):
                if not arg:
                    raise SpecError(shown, f"empty argument in {piece!r}")
                if "=" in arg:
                    key, _, raw = arg.partition("=")
                    if not _NAME.match(key):
                        raise SpecError(shown, f"{key!r} is not a parameter name")
                    if key in kwargs:
                        raise SpecError(shown, f"{name}: parameter {key!r} given twice")
                    kwargs[key] = _value(raw, shown)
                else:
                    if kwargs:
                        raise SpecError(shown, f"{name}: positional argument after keyword arguments")
                    args.append(_value(arg, shown))
        stages.append(Stage(name, tuple(args), tuple(kwargs.items())))
    return stages


def bind_params(params: tuple[Param, ...], stage: Stage, spec: str) -> dict[str, Any]:
    """The full parameter values of ``stage`` (defaults filled in), validated.

    Raises:
        SpecError: too many positional arguments, an unknown or repeated parameter, a bad value.
    """
    if len(stage.args) > min(1, len(params)):
        what = "no parameters" if not params else f"one positional argument ({params[0].name})"
        raise SpecError(spec, f"{stage.name} takes {what}, got {len(stage.args)}")
    by_name = {p.name: p for p in params}
    given: dict[str, Any] = {}
    if stage.args:
        given[params[0].name] = stage.args[0]
    for key, value in stage.kwargs:
        if key not in by_name:
            known = ", ".join(by_name) or "none"
            raise SpecError(spec, f"{stage.name} has no parameter {key!r} (parameters: {known})")
        if key in given:
            raise SpecError(spec, f"{stage.name}: parameter {key!r} given twice")
        given[key] = value
    return {p.name: p.coerce(given[p.name], spec, stage.name) if p.name in given else p.default for p in params}


def render_stage(medium: str, params: tuple[Param, ...], values: dict[str, Any]) -> str:
    """The canonical text of one stage (defaults omitted; the first parameter positional)."""
    parts = []
    for i, p in enumerate(params):
        value = values[p.name]
        if value == p.default:
            continue
        text = p.render(value)
        parts.append(text if i == 0 else f"{p.name}={text}")
    return f"{medium}({','.join(parts)})" if parts else medium


@dataclass(frozen=True, slots=True)
class MediumSpec:
    """What a medium spec is made of, for the code that asks whether a medium is a delta, what
    it wraps or which codec it ends in, instead of cutting the spec's text. Built by `medium_spec`.

    ``name`` is the spec's text as parsed (whitespace removed, lower case), not its canonical
    form: ``get_codec(spec).name`` gives that.
    """

    stages: tuple[Stage, ...]
    """The parsed stages, outermost first."""
    pieces: tuple[str, ...]
    """Each stage's text, with its arguments."""

    @property
    def name(self) -> str:
        """The spec's text (``"delta+int4(64)"``)."""
        return "+".join(self.pieces)

    @property
    def delta(self) -> bool:
        """Whether the medium sends what the receiver lacks on top of a base it holds."""
        return self.stages[0].name == "delta"

    @property
    def inner(self) -> str:
        """The spec a delta wraps (``delta+int8`` -> ``int8``; a bare ``delta`` wraps ``full``);
        the spec itself when it is no delta."""
        if not self.delta:
            return self.name
        return "+".join(self.pieces[1:]) or "full"

    @property
    def outer(self) -> str:
        """The outermost stage's name, without arguments (``topk(0.25)+int8`` -> ``topk``)."""
        return self.stages[0].name

    @property
    def kind(self) -> str:
        """The innermost stage's name, without arguments (``delta+int4(64)`` -> ``int4``)."""
        return self.stages[-1].name

    def with_delta(self) -> MediumSpec:
        """This medium wrapped in a delta (itself when it is one already)."""
        if self.delta:
            return self
        return MediumSpec((Stage("delta", (), ()), *self.stages), ("delta", *self.pieces))

    def __str__(self) -> str:
        return self.name


@functools.lru_cache(maxsize=1024)
def medium_spec(spec: str) -> MediumSpec:
    """The structure of the medium spec ``spec`` (syntax only, as `parse_spec`; cached, since the
    scheduler asks for the same few media on every decision).

    Raises:
        SpecError: not a string, too long, empty, or malformed.
    """
    stages = tuple(parse_spec(spec))
    pieces = tuple(_split_top("".join(spec.split()).lower(), "+", spec))
    return MediumSpec(stages, pieces)
