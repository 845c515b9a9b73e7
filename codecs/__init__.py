"""Media for moving a KV-cache: the `Codec` family, its registry, and the built-in codecs.

Importing this package registers ``full``, ``int8`` and ``tokens``.
"""

from kvbus.codecs import errors
from kvbus.codecs import full as _full  # noqa: F401  (registers "full")
from kvbus.codecs import int8 as _int8  # noqa: F401  (registers "int8")
from kvbus.codecs import tokens as _tokens  # noqa: F401  (registers "tokens")
from kvbus.codecs.base import Codec, Encoded, ModelRunner, available_codecs, get_codec, register
from kvbus.codecs.errors import CodecError, DecodeError, RecomputeUnavailable, UnknownCodec
from kvbus.codecs.full import FullCodec
from kvbus.codecs.int8 import Int8Codec
from kvbus.codecs.tokens import TokensCodec

__all__ = [
    "Codec",
    "CodecError",
    "DecodeError",
    "Encoded",
    "FullCodec",
    "Int8Codec",
    "ModelRunner",
    "RecomputeUnavailable",
    "TokensCodec",
    "UnknownCodec",
    "available_codecs",
    "errors",
    "get_codec",
    "register",
]
