"""The frames of the direct paths (``tcp`` and ``shm``): a fixed 48-byte header, then ``length``
bytes of payload (``tcp`` DATA carries the chunk; ``shm`` DATA carries none: the bytes are in
the shared segment).

    u8 type | u8 flags | u16 0 | u32 stream | u64 length | u32 index | u32 0 | u64 digest | 16s root

A sender opens a stream per transfer with BIND (payload: the 32-byte token, then the transfer
id) and waits for BOUND or REFUSED; then DATA frames (chunk ``index`` with its xxh3-64
``digest``; with ``FLAG_ROOT`` the last one also carries the xxh3-128 whole-payload digest in
``root``), and END. CTRL frames carry small control messages, either way; RELEASE (``shm``)
tells the sender the receiver no longer maps the stream's segment. Each side checks a header
against the frames it takes (`RECEIVER`, `SENDER`) before it allocates for the payload: a
sender takes control frames only.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from kvbus.bus.paths.errors import PathProtocolError

HEADER = struct.Struct("!BBHIQIIQ16s")
HEADER_SIZE = HEADER.size
TOKEN_BYTES = 32
#: Largest BIND payload: the token and a transfer id of at most 64 bytes.
MAX_BIND = TOKEN_BYTES + 64
#: Largest CTRL payload.
MAX_CTRL = 64 * 1024
#: Largest REFUSED payload (a reason for people).
MAX_REASON = 256
#: Largest DATA payload a receiver considers at all (its transfer's chunk sizes bound it further).
MAX_DATA = 1 << 32

FLAG_ROOT = 1
"""DATA: ``root`` holds the whole-payload digest."""
FLAG_COMPLETE = 2
"""END: the sender finished the transfer (else it gave up on this path)."""
_NO_ROOT = bytes(16)


class FrameType(enum.IntEnum):
    """What a frame is."""

    BIND = 1
    BOUND = 2
    REFUSED = 3
    DATA = 4
    CTRL = 5
    END = 6
    RELEASE = 7
    """Receiver -> sender (``shm``): the stream's segment is no longer mapped; the sender may reuse it."""


@dataclass(frozen=True, slots=True)
class Side:
    """The frames one side of a direct connection takes, and the most payload bytes each may
    announce: a header is refused against this before a byte of its payload is allocated."""

    name: str
    """Who reads them ('a receiver', 'a sender'), for errors."""
    limits: Mapping[FrameType, int]
    """Per frame type taken, its largest payload; a type not listed is refused."""


RECEIVER = Side(
    "a receiver",
    {FrameType.BIND: MAX_BIND, FrameType.DATA: MAX_DATA, FrameType.CTRL: MAX_CTRL, FrameType.END: 0},
)
"""What a receiving connection takes from its sender (its transfer's chunk sizes bound DATA further)."""
SENDER = Side(
    "a sender",
    {
        FrameType.BOUND: 0,
        FrameType.REFUSED: MAX_REASON,
        FrameType.CTRL: MAX_CTRL,
        FrameType.END: 0,
        FrameType.RELEASE: 0,
    },
)
"""What a sending connection takes from its receiver: control frames only, none over `MAX_CTRL`
(data flows only towards a receiver, so a receiver cannot make its sender allocate more)."""


@dataclass(frozen=True, slots=True)
class Frame:
    """A decoded frame header."""

    type: FrameType
    stream: int
    length: int
    flags: int = 0
    index: int = 0
    digest: int = 0
    root: bytes = _NO_ROOT

    @property
    def root_hex(self) -> str:
        """The whole-payload digest as hex, or '' when the frame carries none."""
        return self.root.hex() if self.flags & FLAG_ROOT else ""


def pack(
    kind: FrameType, stream: int, length: int = 0, *, flags: int = 0, index: int = 0, digest: int = 0, root: str = ""
) -> bytes:
    """One frame header."""
    rb = _NO_ROOT
    if root:
        rb = bytes.fromhex(root)
        if len(rb) != 16:
            raise ValueError("root digest must be 32 hex characters")
        flags |= FLAG_ROOT
    return HEADER.pack(kind, flags, 0, stream, length, index, 0, digest, rb)


def unpack(buf: bytes | bytearray | memoryview, path: str, side: Side) -> Frame:
    """Decode and check a frame header read by ``side`` (`RECEIVER` or `SENDER`).

    Raises:
        PathProtocolError: unknown type, a type ``side`` does not take, reserved bits set, or a
            payload over the type's limit.
    """
    kind, flags, r1, stream, length, index, r2, digest, root = HEADER.unpack_from(buf)
    try:
        ftype = FrameType(kind)
    except ValueError:
        raise PathProtocolError(path, f"unknown frame type {kind}") from None
    limit = side.limits.get(ftype)
    if limit is None:
        raise PathProtocolError(path, f"{side.name} does not take {ftype.name} frames (one of {length} bytes came)")
    if r1 or r2 or flags & ~(FLAG_ROOT | FLAG_COMPLETE):
        raise PathProtocolError(path, "reserved header bits are set")
    if length > limit:
        raise PathProtocolError(path, f"{ftype.name} frame of {length} bytes is over its limit of {limit}")
    return Frame(ftype, stream, length, flags, index, digest, bytes(root))


def bind_payload(token: str, transfer_id: str) -> bytes:
    """The BIND payload: the raw token, then the transfer id."""
    raw = bytes.fromhex(token)
    tid = transfer_id.encode()
    if len(raw) != TOKEN_BYTES or not 1 <= len(tid) <= 64:
        raise ValueError("a token is 32 bytes and a transfer id 1-64 bytes")
    return raw + tid


def parse_bind(payload: bytes | bytearray | memoryview, path: str) -> tuple[bytes, str]:
    """(token, transfer id) of a BIND payload.

    Raises:
        PathProtocolError: too short, or a transfer id that is not ASCII.
    """
    data = bytes(payload)
    if len(data) <= TOKEN_BYTES:
        raise PathProtocolError(path, "BIND without a transfer id")
    try:
        tid = data[TOKEN_BYTES:].decode("ascii")
    except UnicodeDecodeError:
        raise PathProtocolError(path, "BIND with a transfer id that is not ASCII") from None
    return data[:TOKEN_BYTES], tid
