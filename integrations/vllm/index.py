"""The prefix index: which agent holds the KV of a prefix, in a JetStream KV bucket.

Every time an engine stores blocks it writes one entry per block key: ``<key> -> {agent, tokens}``.
Keys chain (a key names its whole prefix), so the index answers "who holds the longest prefix of
this prompt" with a binary search over the prompt's block keys: about log2(blocks) reads, one
round trip each, independent of how many agents there are. The last writer of a key wins; that
is enough, since one holder per prefix is all a pull needs, and a holder that evicted the prefix
or went away is found out by asking it (`HaveRequest`) before the scheduler commits to a load.

Why JetStream KV: kvbus already keeps its agent directory there, every process of a deployment
reaches it with the NATS connection it has, entries expire on their own (the bucket's TTL), and
a lookup costs a few sub-millisecond reads instead of a fan-out to every agent (which would have
to wait for the slowest, or for a timeout, on every prompt). The cache tier (Redis) is the other
source; it is asked separately because its records outlive the agents that wrote them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvbus.errors import WireFormatError
from kvbus.protocol import check_name, packb, unpackb

if TYPE_CHECKING:
    from kvbus.net.transport import Transport

logger = logging.getLogger(__name__)

#: Longest index value we decode.
MAX_ENTRY_BYTES = 1024
#: Index writes in flight at once.
WRITE_CONCURRENCY = 32


def encode_entry(agent: str, tokens: int) -> bytes:
    """An index value: the holder and the prefix length its key names."""
    return packb({"agent": agent, "tokens": int(tokens)})


def decode_entry(raw: bytes) -> tuple[str, int]:
    """``(agent, tokens)`` of an index value.

    Raises:
        WireFormatError: the value is malformed.
    """
    body = unpackb(raw, "prefix index entry", MAX_ENTRY_BYTES)
    if not isinstance(body, dict):
        raise WireFormatError("prefix index entry", "expected a map")
    agent, tokens = body.get("agent"), body.get("tokens")
    try:
        check_name("agent", agent)
    except ValueError as exc:
        raise WireFormatError("prefix index entry", str(exc)) from None
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
        raise WireFormatError("prefix index entry", f"tokens must be a positive integer, got {tokens!r:.20}")
    return str(agent), tokens


class PrefixIndex:
    """Block key -> holder, over a JetStream KV bucket (create with `connect`)."""

    def __init__(self, bucket: Any) -> None:
        self.bucket = bucket

    @classmethod
    async def connect(cls, transport: Transport, name: str, *, ttl_s: float) -> PrefixIndex | None:
        """The index in bucket ``name`` over ``transport``'s NATS connection (created with ``ttl_s``).

        Returns None when the transport has no JetStream (the connector then only loads pushed
        contexts and the cache tier's blocks).
        """
        js = transport.jetstream()
        if js is None:
            return None
        from nats.js.api import KeyValueConfig
        from nats.js.errors import BucketNotFoundError

        try:
            bucket = await js.key_value(name)
        except BucketNotFoundError:
            try:
                bucket = await js.create_key_value(KeyValueConfig(bucket=name, history=1, ttl=ttl_s))
            except Exception:  # noqa: BLE001 - created concurrently by another engine: use theirs
                bucket = await js.key_value(name)
        return cls(bucket)

    async def publish(self, keys: Sequence[str], agent: str, block_size: int) -> int:
        """Say that ``agent`` holds every prefix named by ``keys`` (``keys[i]`` covers ``(i + 1) * block_size`` tokens).

        Returns:
            How many entries were written (failures are logged, not raised: the index is a hint).
        """
        sem = asyncio.Semaphore(WRITE_CONCURRENCY)

        async def put(i: int, key: str) -> bool:
            async with sem:
                try:
                    await self.bucket.put(key, encode_entry(agent, (i + 1) * block_size))
                    return True
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.debug("prefix index: could not write %s", key, exc_info=True)
                    return False

        done = await asyncio.gather(*(put(i, k) for i, k in enumerate(keys)))
        return sum(done)

    async def holder(self, key: str) -> tuple[str, int] | None:
        """Who holds the prefix ``key`` names, or None."""
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self.bucket.get(key)
        except KeyNotFoundError:
            return None
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.debug("prefix index: could not read %s", key, exc_info=True)
            return None
        if entry is None or not entry.value:
            return None
        try:
            return decode_entry(entry.value)
        except WireFormatError:
            logger.warning("prefix index: ignoring a malformed entry for %s", key)
            return None

    async def longest(self, keys: Sequence[str], *, start: int = 0, exclude: str = "") -> tuple[str, int]:
        """The holder of the longest prefix among ``keys[start:]`` (binary search), as ``(agent, blocks)``.

        ``exclude`` (this agent) does not count. Returns ``("", 0)`` when no one holds
        ``keys[start]``. Assumes, as holders write them, that whoever holds a prefix holds its
        shorter prefixes too; a holder found this way is still asked before it is used.
        """
        lo, hi = start, len(keys)
        best: tuple[str, int] = ("", 0)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            found = await self.holder(keys[mid - 1])
            if found is not None and found[0] != exclude:
                best = (found[0], mid)
                lo = mid
            else:
                hi = mid - 1
        return best
