"""Decoded model signatures, cached: every request carries its sender's signature as a map, and
decoding it (and the receivers' directory entries) on every request and every medium choice was
a measurable part of the per-grant cost. Equal maps decode once; malformed ones still raise."""

from __future__ import annotations

from functools import lru_cache

from kvbus.signature import ModelSignature

#: Distinct signatures kept (a deployment has a handful of models).
CACHE_SIZE = 256


@lru_cache(maxsize=CACHE_SIZE)
def _decode(key: tuple[tuple[str, object], ...]) -> ModelSignature:
    return ModelSignature.from_dict(dict(key))


def signature_of(data: object) -> ModelSignature:
    """`ModelSignature.from_dict` with a cache for equal maps; raises `WireFormatError` when malformed."""
    if isinstance(data, dict):
        try:
            key = tuple(sorted(data.items()))
            hash(key)
        except TypeError:  # unhashable or unorderable values: decode (and fail) without the cache
            return ModelSignature.from_dict(data)
        return _decode(key)
    return ModelSignature.from_dict(data)
