"""The codec family: `Codec`, `Encoded`, and the registry of media with its spec builder."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import torch

from kvbus.codecs.errors import DecodeError, SpecError, UnknownCodec
from kvbus.codecs.spec import Param, Stage, bind_params, parse_spec, render_stage
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature


class ModelRunner(Protocol):
    """What a receiver needs to rebuild KV from tokens (the `tokens` and `summary` media)."""

    signature: ModelSignature

    def prefill(self, tokens: torch.Tensor) -> KVCache:
        """Run the model over ``tokens`` ``[batch, n]`` and return their KV-cache."""
        ...


@runtime_checkable
class GeneratingRunner(ModelRunner, Protocol):
    """A runner that can also continue a context (what the default `summary` summariser needs)."""

    def generate(self, kv: KVCache, max_new_tokens: int, *, eos_token_id: int | None = None) -> torch.Tensor:
        """Greedy continuation of ``kv``: the new token ids ``[batch, k]``."""
        ...


@dataclass(eq=False)
class Encoded:
    """A KV-cache in one medium, ready for the wire.

    ``buffers`` are views of the encoded tensors (no copies of big tensors); on the wire they
    travel back to back, and ``meta`` (small, msgpack-able) says how to read them.
    """

    codec: str
    """The medium spec that produced it (e.g. ``"int8"``)."""
    meta: dict[str, Any]
    """Small metadata: shapes, dtypes, the model signature, codec parameters."""
    buffers: list[memoryview]
    """Byte views of the payload, in wire order."""
    keepalive: list[Any] = field(default_factory=list, repr=False)
    """Objects (tensors) that own the memory behind ``buffers``."""
    region: memoryview | None = field(default=None, repr=False)
    """On receipt, the one payload buffer that every buffer is a slice of (None: unknown)."""
    offsets: Sequence[int] = field(default=(), repr=False)
    """With `region`: where each buffer starts in it (``buffers[i] is region[offsets[i]:...]``).
    A decoder may then view many equal buffers with one tensor instead of one tensor each."""

    @property
    def nbytes(self) -> int:
        """Payload bytes on the wire (the metadata is not counted)."""
        return sum(b.nbytes for b in self.buffers)

    @property
    def sizes(self) -> list[int]:
        """Byte length of each buffer, in wire order (what the receiver splits the payload by)."""
        return [b.nbytes for b in self.buffers]

    @classmethod
    def from_payload(
        cls, codec: str, meta: dict[str, Any], payload: memoryview | bytes | bytearray, sizes: Sequence[int]
    ) -> Encoded:
        """Split a received contiguous payload back into its buffers (views, no copies).

        Raises:
            DecodeError: the sizes do not add up to the payload.
        """
        view = memoryview(payload).cast("B")
        if not isinstance(sizes, (list, tuple)) or not all(isinstance(n, int) and n >= 0 for n in sizes):
            raise DecodeError(codec, "buffer sizes must be a list of non-negative integers")
        if sum(sizes) != view.nbytes:
            raise DecodeError(codec, f"buffer sizes add up to {sum(sizes)} bytes, payload has {view.nbytes}")
        buffers, offsets, offset = [], [], 0
        for n in sizes:
            buffers.append(view[offset : offset + n])
            offsets.append(offset)
            offset += n
        return cls(codec=codec, meta=meta, buffers=buffers, keepalive=[payload], region=view, offsets=offsets)


#: Composition stages, in the order they may appear in a spec (see `kvbus.codecs.spec`).
STAGES = ("delta", "split", "select", "kv", "tokens", "summary")


class Codec(ABC):
    """One medium: how a KV-cache is turned into bytes and back.

    Subclasses are registered with `register` under their medium name and declare ``stage``
    (where they may appear in a composition) and ``params`` (what a spec may set). An instance's
    ``name`` is its canonical spec (``"topk(0.5)+int8"``); ``Encoded.codec`` carries it, and
    ``get_codec(codec.name)`` rebuilds an equal codec on the receiver.

    ``decode`` must treat ``encoded`` as hostile: every size, shape and count in ``meta`` is
    checked before memory is allocated, and anything wrong raises a `CodecError` (usually
    `DecodeError`).

    ``medium``, ``stage`` and ``params`` belong to the class; ``name``, ``lossless``, ``needs_kv``,
    ``fidelity``, ``cheap_decode`` and ``cheap_encode`` are class defaults that an instance may refine (a composition
    is lossless only if every stage is, and its fidelity comes from the calibration profile).
    """

    name: str
    """The medium name (class) or the canonical spec (instance)."""
    medium: ClassVar[str] = ""
    """The registered medium name of the class (``"topk"``)."""
    stage: ClassVar[str] = "kv"
    """Where it may appear in a composition: one of `STAGES`."""
    params: ClassVar[tuple[Param, ...]] = ()
    """Parameters a spec may set."""
    lossless: bool = False
    needs_kv: bool = True
    """False for media that carry no KV (the receiver recomputes)."""
    fidelity: float = 1.0
    """Fidelity factor of one hop: measured (calibration profile) if available, else this default."""
    cheap_decode: bool = False
    """True when decode only builds views (no pass over the data): run it on the event loop."""
    cheap_encode: bool = False
    """True when encode only builds views of contiguous tensors (no pass over the data): the
    sender runs it on the event loop whatever the size, when the cache's tensors are contiguous."""
    recomputes: bool = False
    """True when decoding runs the receiver's model over part of the context (``split``): the
    receiver decodes it off the event loop, whatever the payload's size."""

    def __init__(self, *, inner: Codec | None = None, **args: Any) -> None:
        """Build a codec with parameter values ``args`` (validated) around ``inner`` (wrappers only).

        Raises:
            SpecError: a parameter is unknown or out of range, or ``inner`` cannot be wrapped.
        """
        cls = type(self)
        spec = render_stage(cls.medium, (), {})
        self.args: dict[str, Any] = bind_params(cls.params, Stage(cls.medium, (), tuple(args.items())), spec)
        self.inner = inner
        self.name = render_stage(cls.medium, cls.params, self.args)
        if inner is not None:
            self.name = f"{self.name}+{inner.name}"
        if inner is not None:
            self.lossless = cls.lossless and inner.lossless
            self.needs_kv = cls.needs_kv and inner.needs_kv
            self.cheap_decode = False
            self.cheap_encode = False
        self.fidelity = self._fidelity_factor()

    def _fidelity_factor(self) -> float:
        """The measured factor of this spec (or of this stage at default parameters) when the active
        profile has one, else the product of the stages' class defaults."""
        if self.is_lossless:
            return 1.0
        from kvbus.codecs.calibration import measured_fidelity

        cls = type(self)
        at_defaults = render_stage(cls.medium, (), {}) + (f"+{self.inner.name}" if self.inner is not None else "")
        for spec in (self.name, at_defaults):  # this exact spec, else the same stage at its default parameters
            measured = measured_fidelity(spec)
            if measured is not None:
                return measured
        own = type(self).fidelity
        return own * self.inner.fidelity if self.inner is not None else own

    @property
    def is_lossless(self) -> bool:
        """Lossless end to end: this stage and every inner one."""
        return type(self).lossless and (self.inner is None or self.inner.is_lossless)

    def usable(self, sender: ModelSignature, receiver: ModelSignature) -> bool:
        """Whether a receiver with ``receiver`` can use what a sender with ``sender`` encodes."""
        return not self.needs_kv or sender.compatible_with(receiver)

    @abstractmethod
    def encode(self, kv: KVCache, *, base: KVCache | None = None, runner: ModelRunner | None = None) -> Encoded:
        """Encode ``kv``; the result's buffers may share memory with it.

        Args:
            kv: the context to send.
            base: what the receiver already holds from this sender (token ids at least), for
                delta media; others ignore it.
            runner: the sender's model, for media that run it (``summary``); others ignore it.
        """

    @abstractmethod
    def decode(self, encoded: Encoded, *, base: KVCache | None = None, runner: ModelRunner | None = None) -> KVCache:
        """Rebuild a KV-cache.

        The result's fidelity is the sender's times this medium's factor (1 when lossless).

        Args:
            encoded: what `encode` produced, possibly after a trip over the wire.
            base: the receiver's last context from this sender, for delta media.
            runner: the receiver's model, for media that recompute.

        Raises:
            DecodeError: the payload or metadata is malformed.
        """

    def prepare(self, meta: Any, runner: ModelRunner | None) -> Callable[[], KVCache] | None:
        """Work a receiver may start as soon as a streamed transfer's `Open` arrives, before its payload.

        Called by the receiver on the event loop, with the `Open`'s codec metadata (hostile: check
        it) and the receiver's model, once it has accepted the `Open`. The function returned runs
        in a worker thread while the chunks stream in; what it returns is handed to `decode` as
        ``base``. ``split`` prefills the prefix it names here, so that the recompute overlaps
        the transfer. Default: nothing to start (None).

        Raises:
            DecodeError: the metadata is malformed (the receiver refuses the transfer).
        """
        return None

    def estimate_nbytes(self, signature: ModelSignature, n_tokens: int, batch: int = 1) -> int:
        """Predicted payload bytes for ``n_tokens`` of context (used before encoding)."""
        return batch * n_tokens * (signature.kv_bytes_per_token() + 8)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and type(other) is type(self) and other.name == self.name

    def __hash__(self) -> int:
        return hash((type(self), self.name))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


C = TypeVar("C", bound=type[Codec])

_REGISTRY: dict[str, type[Codec]] = {}


def register(name: str) -> Callable[[C], C]:
    """Class decorator that registers a codec class under the medium name ``name``.

    Raises:
        ValueError: ``name`` is taken or not a valid spec name, or the class's stage is unknown.
    """

    def wrap(cls: C) -> C:
        if name in _REGISTRY:
            raise ValueError(f"codec {name!r} is registered twice")
        if parse_spec(name)[0].name != name or "(" in name or "+" in name:
            raise ValueError(f"codec name {name!r} must match [a-z][a-z0-9_]*")
        if cls.stage not in STAGES:
            raise ValueError(f"codec {name!r} has stage {cls.stage!r}, expected one of {STAGES}")
        cls.name = name
        cls.medium = name
        _REGISTRY[name] = cls
        return cls

    return wrap


#: What each wrapper stage may wrap.
_WRAPS = {"delta": ("select", "kv", "tokens"), "split": ("select", "kv"), "select": ("kv",)}
#: The inner codec of a wrapper given none.
DEFAULT_INNER = "full"


def get_codec(spec: str) -> Codec:
    """The codec a medium spec names (``"int8"``, ``"topk(0.25)+int4"``, ``"delta+int8"``).

    See `kvbus.codecs.spec` for the grammar and the canonical form. The returned codec's
    ``name`` is the canonical spec, and ``get_codec(codec.name)`` gives an equal codec.

    Raises:
        UnknownCodec: a stage names no registered medium (a `ValueError` listing the known ones).
        SpecError: the spec is malformed, a parameter is bad, or the stages do not compose
            (also a `ValueError`).
    """
    try:
        stages = parse_spec(spec)
    except SpecError:
        if isinstance(spec, str) and len(spec) <= 256:  # name the unknown medium rather than the syntax
            for piece in spec.split("+"):
                m = re.match(r"\s*([A-Za-z][A-Za-z0-9_.-]*)", piece)
                if m and m.group(1).lower() not in _REGISTRY:
                    raise UnknownCodec(m.group(1).lower(), _REGISTRY) from None
        raise
    shown = spec if len(spec) <= 60 else spec[:57] + "..."
    classes = []
    for st in stages:
        cls = _REGISTRY.get(st.name)
        if cls is None:
            raise UnknownCodec(st.name, _REGISTRY)
        classes.append(cls)
    kinds = [cls.stage for cls in classes]
    for i, (cls, kind) in enumerate(zip(classes, kinds)):
        allowed = _WRAPS.get(kind)
        if i + 1 < len(classes):
            if allowed is None:
                raise SpecError(shown, f"{cls.medium!r} cannot wrap another medium; it must come last")
            if kinds[i + 1] not in allowed:
                raise SpecError(
                    shown,
                    f"{cls.medium!r} cannot wrap {classes[i + 1].medium!r} (it wraps {' or '.join(allowed)} media)",
                )
        elif kind == "summary" and i > 0:
            raise SpecError(shown, "'summary' stands alone")
    codec: Codec | None = None
    if _WRAPS.get(kinds[-1]) is not None:
        codec = _REGISTRY[DEFAULT_INNER]()
    for st, cls in zip(reversed(stages), reversed(classes)):
        values = bind_params(cls.params, st, shown)
        codec = cls(inner=codec, **values) if codec is not None else cls(**values)
    assert codec is not None
    return codec


def available_codecs() -> list[str]:
    """Names of every registered medium (the base names; see `get_codec` for compositions)."""
    return sorted(_REGISTRY)
