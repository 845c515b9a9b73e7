"""Media for moving a KV-cache: the `Codec` family, its registry and spec language, and the built-in codecs.

Importing this package registers ``full``, ``int8``, ``int4``, ``topk``, ``lowrank``,
``delta``, ``split``, ``tokens`` and ``summary``; `get_codec` also builds compositions such as
``"delta+topk(0.25)+int8"`` (grammar in `kvbus.codecs.spec`). Measured figures per medium live
in calibration profiles (`kvbus.codecs.calibration`).
"""

from kvbus.codecs import delta as _delta  # noqa: F401  (registers "delta")
from kvbus.codecs import errors
from kvbus.codecs import full as _full  # noqa: F401  (registers "full")
from kvbus.codecs import int4 as _int4  # noqa: F401  (registers "int4")
from kvbus.codecs import int8 as _int8  # noqa: F401  (registers "int8")
from kvbus.codecs import lowrank as _lowrank  # noqa: F401  (registers "lowrank")
from kvbus.codecs import split as _split  # noqa: F401  (registers "split")
from kvbus.codecs import summary as _summary  # noqa: F401  (registers "summary")
from kvbus.codecs import tokens as _tokens  # noqa: F401  (registers "tokens")
from kvbus.codecs import topk as _topk  # noqa: F401  (registers "topk")
from kvbus.codecs.base import (
    Codec,
    Encoded,
    GeneratingRunner,
    ModelRunner,
    available_codecs,
    get_codec,
    register,
)
from kvbus.codecs.calibration import CalibrationProfile, CodecFigures, default_profile_path, load_profile, save_profile
from kvbus.codecs.delta import DeltaCodec, prefix_version
from kvbus.codecs.errors import (
    CalibrationError,
    CodecError,
    DecodeError,
    DeltaBaseMismatch,
    NonFiniteValues,
    RecomputeUnavailable,
    SpecError,
    SummaryUnavailable,
    UnknownCodec,
)
from kvbus.codecs.full import FullCodec
from kvbus.codecs.int4 import Int4Codec
from kvbus.codecs.int8 import Int8Codec
from kvbus.codecs.layerwise import LayerBuffer, LayerwiseCodec
from kvbus.codecs.lowrank import LowRankCodec
from kvbus.codecs.runner import HFRunner
from kvbus.codecs.spec import parse_spec
from kvbus.codecs.split import SplitCodec
from kvbus.codecs.summary import ModelSummarizer, Summarizer, SummaryCodec, TailSummarizer
from kvbus.codecs.tokens import TokensCodec
from kvbus.codecs.topk import TopKCodec


def canonical_spec(spec: str) -> str:
    """The canonical form of a medium spec (``get_codec(spec).name``).

    Raises:
        UnknownCodec, SpecError: as `get_codec`.
    """
    return get_codec(spec).name


__all__ = [
    "CalibrationError",
    "CalibrationProfile",
    "Codec",
    "CodecError",
    "CodecFigures",
    "DecodeError",
    "DeltaBaseMismatch",
    "DeltaCodec",
    "Encoded",
    "FullCodec",
    "GeneratingRunner",
    "HFRunner",
    "Int4Codec",
    "Int8Codec",
    "LayerBuffer",
    "LayerwiseCodec",
    "LowRankCodec",
    "ModelRunner",
    "ModelSummarizer",
    "NonFiniteValues",
    "RecomputeUnavailable",
    "SpecError",
    "Summarizer",
    "SummaryCodec",
    "SummaryUnavailable",
    "TailSummarizer",
    "TokensCodec",
    "SplitCodec",
    "TopKCodec",
    "UnknownCodec",
    "available_codecs",
    "canonical_spec",
    "default_profile_path",
    "errors",
    "get_codec",
    "load_profile",
    "parse_spec",
    "prefix_version",
    "register",
    "save_profile",
]
