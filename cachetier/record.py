"""The remote record of one block and the local stub that points at it.

A block lives remotely as one Redis hash, written by a single ``HSET`` (atomic: the payload and
its metadata exist together or not at all, whatever the server evicts or expires):

- ``meta``: msgpack of the `Stub` (codec, the codec's metadata as an embedded msgpack blob,
  layer shape, dtype, buffer sizes, payload and decoded sizes, and an xxh3-64 checksum over the
  codec's metadata blob and the buffers, so that neither can be altered alone);
- ``0`` .. ``n-1``: the codec's buffers, each its own field, so that neither the writer nor the
  reader copies them into one contiguous payload (and because Valkey moved an 11 MB block as
  61 fields as fast as one ``SET``/``GET``, but as one field over twice as slowly).

Everything read back is untrusted: `Stub.from_bytes` and `parse_record` check every field and
raise only `RecordFormatError` (a `KVBusError`), and `open_record` checks that what the codec
decoded is the block that was asked for.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import xxhash

from kvbus.cachetier.errors import RecordFormatError, UnsuitableCodec
from kvbus.codecs import Codec, Encoded, get_codec
from kvbus.errors import KVBusError
from kvbus.kvcache import KVCache
from kvbus.signature import DTYPES, ModelSignature, dtype_name

#: Version of the record layout; a reader refuses any other.
RECORD_VERSION = 1
#: Field holding the metadata.
META_FIELD = b"meta"
#: Most buffers a record may have.
MAX_BUFFERS = 1 << 14
#: Largest metadata accepted.
MAX_META_BYTES = 1 << 20
#: Largest payload a record may claim.
MAX_PAYLOAD = 1 << 40
#: Largest dimension of a layer shape.
MAX_DIM = 1 << 24
_KEY_RE = re.compile(r"[0-9a-f]{8,128}")
#: Characters of a codec spec (``int8``, ``int4(64)``, ``topk(keep=0.25)+int8``); the codec
#: library parses it, this only bounds it.
_CODEC_RE = re.compile(r"[A-Za-z0-9_.+(),=\- ]{1,256}")


def buffer_field(i: int) -> bytes:
    """The hash field of buffer ``i``."""
    return str(i).encode()


@dataclass(frozen=True, slots=True, eq=False)
class Stub:
    """What stays in memory when a block is offloaded: where it is and how to verify and size it."""

    key: str
    """The block's content key (see `kvbus.cachetier.keys`)."""
    codec: str
    """The codec the payload was encoded with."""
    shape: tuple[int, int, int, int]
    """One layer's keys (and values) ``[batch, kv_heads, seq, head_dim]`` once decoded."""
    dtype: str
    """The KV dtype once decoded."""
    checksum: int
    """xxh3-64 of the codec metadata blob and the payload's buffers, back to back."""
    size: int
    """Payload bytes in the remote tier."""
    nbytes: int
    """Resident bytes of the block once fetched and decoded (KV plus token ids)."""
    sizes: tuple[int, ...]
    """Bytes of each buffer, in order."""
    meta_blob: bytes = b"\x80"
    """The codec's metadata, msgpack (the checksum covers these exact bytes)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The codec's metadata, decoded from `meta_blob`."""

    def to_bytes(self) -> bytes:
        """The record's ``meta`` field."""
        packed: bytes = msgpack.packb(
            {
                "v": RECORD_VERSION,
                "key": self.key,
                "codec": self.codec,
                "shape": list(self.shape),
                "dtype": self.dtype,
                "checksum": self.checksum,
                "size": self.size,
                "nbytes": self.nbytes,
                "sizes": list(self.sizes),
                "meta": self.meta_blob,
            },
            use_bin_type=True,
        )
        return packed

    @classmethod
    def from_bytes(cls, raw: object) -> Stub:
        """Decode a record's ``meta`` field.

        Raises:
            RecordFormatError: anything is malformed or out of range.
        """
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise RecordFormatError("record meta", f"expected bytes, got {type(raw).__name__}")
        if len(raw) > MAX_META_BYTES:
            raise RecordFormatError("record meta", f"{len(raw)} bytes is more than {MAX_META_BYTES}")
        try:
            data = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:  # noqa: BLE001 - msgpack raises many types on hostile input
            raise RecordFormatError("record meta", f"not msgpack ({type(exc).__name__})") from None
        if not isinstance(data, dict):
            raise RecordFormatError("record meta", f"expected a map, got {type(data).__name__}")
        if _get(data, "v", int) != RECORD_VERSION:
            raise RecordFormatError("record meta", f"version {data['v']!r}, expected {RECORD_VERSION}")
        key = _get(data, "key", str)
        if not _KEY_RE.fullmatch(key):
            raise RecordFormatError("record meta", "key is not a hex digest")
        codec = _get(data, "codec", str)
        if not _CODEC_RE.fullmatch(codec):
            raise RecordFormatError("record meta", f"codec name {codec[:80]!r} is not a codec name")
        shape = _get(data, "shape", list)
        if len(shape) != 4 or not all(_int_in(d, 0, MAX_DIM) for d in shape):
            raise RecordFormatError("record meta", f"shape must be 4 integers in 0..{MAX_DIM}")
        dtype = _get(data, "dtype", str)
        if dtype not in DTYPES:
            raise RecordFormatError("record meta", f"dtype {dtype[:40]!r} is not one of {sorted(DTYPES)}")
        checksum = _get(data, "checksum", int)
        if not 0 <= checksum < 1 << 64:
            raise RecordFormatError("record meta", "checksum is not a 64-bit unsigned integer")
        size = _get(data, "size", int)
        nbytes = _get(data, "nbytes", int)
        for name, value in (("size", size), ("nbytes", nbytes)):
            if not 0 <= value <= MAX_PAYLOAD:
                raise RecordFormatError("record meta", f"{name}={value} is outside 0..{MAX_PAYLOAD}")
        sizes = _get(data, "sizes", list)
        if not 1 <= len(sizes) <= MAX_BUFFERS or not all(_int_in(s, 0, MAX_PAYLOAD) for s in sizes):
            raise RecordFormatError("record meta", f"sizes must be 1..{MAX_BUFFERS} integers in 0..{MAX_PAYLOAD}")
        if sum(sizes) != size:
            raise RecordFormatError("record meta", f"buffer sizes add up to {sum(sizes)}, size says {size}")
        blob = _get(data, "meta", bytes)
        try:
            meta = msgpack.unpackb(blob, raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:  # noqa: BLE001 - msgpack raises many types on hostile input
            raise RecordFormatError("record meta", f"codec metadata is not msgpack ({type(exc).__name__})") from None
        if not isinstance(meta, dict):
            raise RecordFormatError("record meta", f"codec metadata must be a map, got {type(meta).__name__}")
        return cls(
            key=key,
            codec=codec,
            shape=(shape[0], shape[1], shape[2], shape[3]),
            dtype=dtype,
            checksum=checksum,
            size=size,
            nbytes=nbytes,
            sizes=tuple(sizes),
            meta_blob=blob,
            meta=meta,
        )

    def same_payload(self, other: Stub) -> bool:
        """Whether ``other`` describes the very record this stub was written with."""
        return (
            self.key == other.key
            and self.codec == other.codec
            and self.checksum == other.checksum
            and self.sizes == other.sizes
            and self.meta_blob == other.meta_blob
            and self.shape == other.shape
            and self.dtype == other.dtype
            and self.nbytes == other.nbytes
        )


def _get(data: dict[str, Any], name: str, kind: type) -> Any:
    try:
        value = data[name]
    except KeyError:
        raise RecordFormatError("record meta", f"field {name!r} is missing") from None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise RecordFormatError("record meta", f"field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _int_in(value: object, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def checksum(meta_blob: bytes, buffers: list[memoryview] | list[bytes]) -> int:
    """xxh3-64 of ``meta_blob`` then ``buffers``, back to back (no copy)."""
    h = xxhash.xxh3_64(meta_blob)
    for b in buffers:
        h.update(b)
    return h.intdigest()


def storage_codec(spec: str) -> Codec:
    """The codec ``spec`` names, checked to store a block on its own.

    A block must decode from its record alone into dense KV for every one of its tokens: media
    that carry no KV (``tokens``, ``summary``), need the receiver's previous context (``delta``),
    leave a prefix to recompute (``split``) or keep only some positions (``topk``) cannot store one.

    Raises:
        UnsuitableCodec: it cannot; also for a spec the codec library refuses.
    """
    try:
        codec = get_codec(spec)
    except KVBusError as exc:
        raise UnsuitableCodec(str(spec)[:80], str(exc)) from None
    if not codec.needs_kv:
        raise UnsuitableCodec(codec.name, "it carries no KV")
    stage = getattr(codec, "stage", "kv")
    if stage == "delta":
        raise UnsuitableCodec(codec.name, "it needs the receiver's previous context to decode")
    if codec.recomputes:
        raise UnsuitableCodec(codec.name, "it leaves part of the block to be recomputed by a model")
    if stage != "kv":
        raise UnsuitableCodec(codec.name, "it does not keep the KV of every position")
    return codec


def build_record(key: str, kv: KVCache, codec: str) -> tuple[Stub, dict[bytes, Any], Encoded]:
    """Encode one block for the remote tier.

    Returns:
        ``(stub, fields, encoded)``: the stub to keep once the write is confirmed, the hash
        fields to write (views of ``encoded``'s buffers, which must stay alive until written).

    Raises:
        UnsuitableCodec: ``codec`` cannot store a block on its own.
    """
    medium = storage_codec(codec)
    encoded = medium.encode(kv)
    sizes = tuple(encoded.sizes)
    blob = msgpack.packb(encoded.meta, use_bin_type=True)
    stub = Stub(
        key=key,
        codec=medium.name,
        shape=_layer_shape(kv),
        dtype=dtype_name(kv.dtype),
        checksum=checksum(blob, encoded.buffers),
        size=sum(sizes),
        nbytes=kv.nbytes,
        sizes=sizes,
        meta_blob=blob,
        meta=encoded.meta,
    )
    fields: dict[bytes, Any] = {META_FIELD: stub.to_bytes()}
    for i, buf in enumerate(encoded.buffers):
        fields[buffer_field(i)] = buf
    return stub, fields, encoded


def _layer_shape(kv: KVCache) -> tuple[int, int, int, int]:
    if kv.keys:
        b, h, s, d = kv.keys[0].shape
        return (int(b), int(h), int(s), int(d))
    return (kv.batch, kv.signature.n_kv_heads, 0, kv.signature.head_dim)


def parse_record(fields: Mapping[Any, Any], key: str, expected: Stub | None = None) -> tuple[Stub, Encoded]:
    """Check a record read with ``HGETALL`` and split it into its stub and encoded payload.

    Args:
        fields: the hash as read (field name -> value, both bytes).
        key: the block key that was asked for.
        expected: the stub this tier kept when it wrote the block; None for a block another
            tier wrote (it is then checked against its own metadata only).

    Raises:
        RecordFormatError: the record is malformed, its payload does not match its checksum,
            or it is not the record ``expected`` describes.
    """
    if not isinstance(fields, Mapping):
        raise RecordFormatError("record", f"expected a hash, got {type(fields).__name__}")
    stub = Stub.from_bytes(fields.get(META_FIELD))
    if stub.key != key:
        raise RecordFormatError("record", f"it is the record of block {stub.key[:16]}, not {key[:16]}")
    if expected is not None and not expected.same_payload(stub):
        raise RecordFormatError("record", "it was rewritten since this tier wrote it (checksum differs)")
    n = len(stub.sizes)
    if len(fields) != n + 1:
        raise RecordFormatError("record", f"{len(fields)} fields, expected {n} buffers and the metadata")
    buffers: list[memoryview] = []
    for i, want in enumerate(stub.sizes):
        value = fields.get(buffer_field(i))
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise RecordFormatError("record", f"buffer {i} is missing")
        view = memoryview(value).cast("B")
        if view.nbytes != want:
            raise RecordFormatError("record", f"buffer {i} has {view.nbytes} bytes, expected {want}")
        buffers.append(view)
    if checksum(stub.meta_blob, buffers) != stub.checksum:
        raise RecordFormatError("record", "checksum mismatch (payload or codec metadata altered)")
    return stub, Encoded(codec=stub.codec, meta=stub.meta, buffers=buffers, keepalive=[fields])


def open_record(stub: Stub, encoded: Encoded, tokens: torch.Tensor, signature: ModelSignature) -> KVCache:
    """Decode a verified record and check that it is the block of ``tokens`` for ``signature``.

    Raises:
        RecordFormatError: the codec is unknown, the payload does not decode, or the decoded
            block has other tokens, another model, dtype or shape than asked for.
    """
    try:
        kv = storage_codec(stub.codec).decode(encoded)
    except KVBusError as exc:
        raise RecordFormatError("record payload", str(exc)) from None
    want_dtype = DTYPES[stub.dtype]
    if not kv.signature.compatible_with(signature):
        raise RecordFormatError("record payload", f"it holds KV of {kv.signature.model}, not {signature.model}")
    if kv.tokens.shape != tokens.shape or not torch.equal(kv.tokens, tokens.to(kv.tokens.dtype)):
        raise RecordFormatError("record payload", "its token ids are not the block's")
    if not kv.keys or kv.seq_len != tokens.shape[-1] or kv.dtype != want_dtype or kv.positions is not None:
        raise RecordFormatError(
            "record payload",
            f"it holds {kv.seq_len} KV positions in {kv.dtype}, expected {tokens.shape[-1]} in {want_dtype}",
        )
    if tuple(kv.keys[0].shape) != stub.shape:
        raise RecordFormatError("record payload", f"layer shape {list(kv.keys[0].shape)}, expected {list(stub.shape)}")
    if kv.nbytes != stub.nbytes:
        raise RecordFormatError("record payload", f"{kv.nbytes} bytes decoded, the stub says {stub.nbytes}")
    return kv


def adoptable(raw: bytes | None, key: str, kv: KVCache | None, codec: str) -> Stub | None:
    """The stub in an existing record's ``meta`` field ``raw`` if that record holds block ``key`` as
    ``kv`` with ``codec`` (so a tier can keep it instead of writing its own), else None.

    A damaged ``meta`` is not adoptable: the caller's write replaces the record.
    """
    if raw is None:
        return None
    try:
        stub = Stub.from_bytes(raw)
    except KVBusError:
        return None
    if (
        stub.key != key
        or stub.codec != codec
        or kv is None
        or stub.dtype != dtype_name(kv.dtype)
        or stub.shape != tuple(kv.keys[0].shape)
        or stub.nbytes != kv.nbytes
    ):
        return None
    return stub
