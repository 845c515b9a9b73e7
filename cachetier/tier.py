"""`CacheTier`: an agent's KV memory, in blocks, with a compressed remote tier behind it.

A context's KV is held in blocks of ``block_tokens`` tokens keyed by the content hash of their
token prefix (`kvbus.cachetier.keys`). Each block is in one of two local states:

- resident: its KV tensors are in memory (it may also have a stub, when the remote tier holds
  the same payload: shedding it again then costs no write);
- remote: only its stub (key, codec, shape, dtype, checksum, size) and token ids are kept.

A block the tier knows nothing about (never stored, or dropped) is looked up in the remote tier
(another agent may have stored it: records are shared by key) and, failing that, recomputed
from its tokens by the model runner. A record that is missing, expired, corrupt or not the block
asked for is a miss, never wrong data.

When resident bytes would pass the high watermark, the least useful unpinned blocks are shed
until the low watermark: those with a stub lose their tensors, low-utility ones are dropped,
the rest are encoded (int8 by default: the policy chooses) and written in pipelined batches;
a block becomes a stub only once the server confirmed its write. If the remote tier fails, the
blocks still waiting are dropped: the budget holds, and they can be recomputed.

Concurrency: the tier's state is touched only on its event loop; encoding, decoding, checksums,
splitting and assembling run in worker threads. Loads of one block are single-flight: a second
`get` or prefetch of a block that is being loaded waits for the first instead of reading again.

`CacheTier` is the facade; the work is done by its parts: `kvbus.cachetier.residency` (the block
table, memory accounting, watermarks and shedding), `kvbus.cachetier.offload` (writing shed
blocks), `kvbus.cachetier.loader` (fetch, verification, recompute, single-flight, prefetch), on
top of `kvbus.cachetier.remote` (the Redis-protocol client) and `kvbus.cachetier.record` (the
record format and its checks).
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Callable

import torch

from kvbus.cachetier.config import CacheTierConfig
from kvbus.cachetier.errors import ContextMismatch, TierClosed
from kvbus.cachetier.keys import BlockSpan
from kvbus.cachetier.loader import Loader
from kvbus.cachetier.offload import Offloader
from kvbus.cachetier.policy import BlockInfo, ShedPolicy, UtilityPolicy
from kvbus.cachetier.record import Stub, storage_codec
from kvbus.cachetier.remote import RemoteStore
from kvbus.cachetier.residency import Residency
from kvbus.cachetier.types import ShedReport, Status, TierEvents, TierListener, TierStats
from kvbus.codecs import Codec, ModelRunner
from kvbus.errors import KVBusError
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature, dtype_name

logger = logging.getLogger(__name__)

__all__ = ["CacheTier"]


class CacheTier:
    """An agent's KV memory manager with a Redis-protocol remote tier.

    Create with ``await CacheTier.connect(redis_url, runner=runner)`` (or without a URL for a
    memory-only tier that drops what it sheds) and use as ``async with``. Hand it to
    ``bus.agent(..., cache=tier)``: probes report `memory_bytes` and `Agent.prefetch` calls
    `prefetch`.

    ``listener`` may be replaced at any time (the tier calls whichever is set; the bus wraps it
    in a metrics listener that forwards every event). The other attributes are fixed once the
    tier is built.
    """

    def __init__(
        self,
        signature: ModelSignature | None = None,
        *,
        runner: ModelRunner | None = None,
        remote: RemoteStore | None = None,
        config: CacheTierConfig | None = None,
        policy: ShedPolicy | None = None,
        listener: TierEvents | None = None,
        clock: Callable[[], float] = time.monotonic,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Build a tier on an already connected remote store (see `connect`).

        Args:
            signature: the model whose KV the tier holds (default: the runner's).
            runner: the model, to recompute blocks that are neither resident nor remote.
            remote: the remote tier; None keeps everything in memory and drops what it sheds.
            config: sizes, watermarks and remote settings (default: `CacheTierConfig.from_env`).
            policy: utility and shedding decisions (default: `UtilityPolicy` from the config).
            listener: hook called on offloads, fetches, misses, drops and recomputes.
            clock: monotonic seconds, for utility decay (tests pass a fake one).
            dtype: the KV dtype (default: the signature's).
        """
        if signature is None:
            signature = getattr(runner, "signature", None)
        if signature is None:
            raise ValueError("a cache tier needs the model signature (or a runner that has one)")
        self.signature = signature
        self.dtype = dtype or signature.torch_dtype
        dtype_name(self.dtype)
        self.runner = runner
        self.remote = remote
        self.config = config or CacheTierConfig.from_env()
        self.policy = policy or UtilityPolicy(
            codec=self.config.codec, half_life=self.config.half_life, drop_below=self.config.drop_below
        )
        self._codecs: dict[str, Codec] = {}
        # Fail now, not at the first offload, on a codec that cannot store blocks.
        self._codec_for(BlockInfo("0" * 32, 0, self.config.block_tokens, 0, 1.0))
        self.listener: TierEvents = listener or TierListener()
        """The hook the tier calls on offloads, fetches, misses, drops and recomputes (replaceable)."""
        self.clock = clock
        self.stats = TierStats()
        offloader = Offloader(
            remote, self.config, signature, self.stats, codec_for=self._codec_for, notify=self._notify
        )
        self._table = Residency(
            signature,
            self.dtype,
            self.config,
            self.policy,
            self.stats,
            clock=clock,
            offloader=offloader,
            notify=self._notify,
        )
        self._loader = Loader(
            self._table, remote, runner, self.config, self.stats, codec_for=self._codec_for, notify=self._notify
        )

    @classmethod
    async def connect(
        cls,
        redis_url: str | None,
        *,
        signature: ModelSignature | None = None,
        runner: ModelRunner | None = None,
        config: CacheTierConfig | None = None,
        policy: ShedPolicy | None = None,
        listener: TierEvents | None = None,
        clock: Callable[[], float] = time.monotonic,
        dtype: torch.dtype | None = None,
    ) -> CacheTier:
        """A tier whose remote tier is the Redis-protocol server at ``redis_url``.

        Args:
            redis_url: ``redis://[[user]:password@]host:port/db`` or ``rediss://`` (TLS); None
                for a memory-only tier.
            signature, runner, config, policy, listener, clock, dtype: as for the constructor.

        Raises:
            RemoteUnavailable: the server cannot be reached or refuses the credentials.
        """
        config = config or CacheTierConfig.from_env()
        remote = await RemoteStore.connect(redis_url, config) if redis_url else None
        try:
            return cls(
                signature,
                runner=runner,
                remote=remote,
                config=config,
                policy=policy,
                listener=listener,
                clock=clock,
                dtype=dtype,
            )
        except BaseException:
            if remote is not None:
                await remote.close()
            raise

    # -- state ----------------------------------------------------------------------------------

    @property
    def status(self) -> Status:
        """Open, or closed by `close`."""
        return self._table.status

    @property
    def memory_bytes(self) -> int:
        """Bytes the tier holds in memory: resident KV and the token ids of every block."""
        return self._table.memory

    @property
    def budget_bytes(self) -> int:
        """The memory budget the watermarks are fractions of (from the config)."""
        return self.config.budget_bytes

    def __len__(self) -> int:
        """Blocks the tier knows (resident or remote)."""
        return len(self._table.blocks)

    def resident_blocks(self) -> int:
        """How many blocks have their KV in memory."""
        return sum(1 for b in self._table.blocks.values() if b.resident)

    def stubs(self) -> list[Stub]:
        """The stubs of blocks that are only remote."""
        return [b.stub for b in self._table.blocks.values() if b.stub is not None and not b.resident]

    def spans(self, context: KVCache | torch.Tensor, *, salt: str = "") -> list[BlockSpan]:
        """The blocks (keys and token ranges) covering ``context``, of ``salt`` (see `block_spans`)."""
        return self._table.spans(self._ids(context), salt=salt)

    def lookup(self, context: KVCache | torch.Tensor, *, salt: str = "") -> int:
        """Tokens at the start of ``context`` whose blocks the tier holds, resident or remote (no I/O).

        Every method takes the context's ``salt`` (a tenant's; "" for none): blocks put with one
        salt are found only with that salt.
        """
        held = 0
        for span in self.spans(context, salt=salt):
            if span.key not in self._table.blocks:
                break
            held = span.stop
        return held

    def _check_open(self) -> None:
        if self.status is Status.CLOSED:
            raise TierClosed()

    # -- contexts -------------------------------------------------------------------------------

    def _ids(self, context: KVCache | torch.Tensor) -> torch.Tensor:
        tokens = context.tokens if isinstance(context, KVCache) else context
        if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point or tokens.dim() not in (1, 2):
            raise ContextMismatch("token ids (an integer tensor [n] or [batch, n])", f"{tokens!r:.80}")
        ids = tokens.to(torch.int64)
        return ids.unsqueeze(0) if ids.dim() == 1 else ids

    def _check_kv(self, kv: KVCache) -> None:
        if not kv.signature.compatible_with(self.signature):
            raise ContextMismatch(
                f"KV of {self.signature.model} ({self.signature.digest()})",
                f"KV of {kv.signature.model} ({kv.signature.digest()})",
            )
        if not kv.has_kv:
            raise ContextMismatch("a context with KV", "a token-only context")
        if kv.dtype != self.dtype:
            raise ContextMismatch(f"KV in {self.dtype}", f"KV in {kv.dtype}")
        if kv.positions is not None:
            raise ContextMismatch("KV at positions 0..n-1", "a sparsified cache (explicit positions)")
        try:
            kv.validate()
        except KVBusError as exc:
            raise ContextMismatch("a cache that fits its signature", str(exc)) from None

    def _codec_for(self, block: BlockInfo) -> Codec:
        """The storage codec the policy chooses for ``block`` (cached per spec; its ``name`` is canonical).

        Raises:
            UnsuitableCodec: the spec is malformed or names a codec that cannot store blocks.
        """
        spec = self.policy.codec_for(block)
        codec = self._codecs.get(spec)
        if codec is None:
            codec = self._codecs[spec] = storage_codec(spec)
        return codec

    def _notify(self, event: str, keys: list[str]) -> None:
        try:
            getattr(self.listener, event)(keys)
        except Exception:
            logger.exception("cache tier listener failed on %s", event)

    # -- public API -----------------------------------------------------------------------------

    async def put(self, kv: KVCache, *, salt: str = "") -> list[str]:
        """Hold ``kv``'s KV (the prefix of tokens it covers), in blocks; the tier copies it.

        Blocks already held are shared, not stored twice. Sheds first if the new blocks would
        pass the high watermark.

        Returns:
            The keys of the blocks that cover ``kv``'s KV.

        Raises:
            ContextMismatch: ``kv`` is of another model or dtype, token-only, or sparsified.
        """
        self._check_open()
        self._check_kv(kv)
        ids = self._ids(kv)
        spans = self._table.spans(ids, stop=kv.seq_len, salt=salt)
        self.stats.puts += 1
        await self._table.store(kv, ids, spans)
        return [s.key for s in spans]

    async def get(self, context: KVCache | torch.Tensor, *, out: KVCache | None = None, salt: str = "") -> KVCache:
        """The KV of every token of ``context`` (token ids, or a `KVCache` whose tokens count).

        Resident blocks are used as they are; stubs are fetched, verified and decoded; blocks
        neither resident nor remote (or whose record is gone) are recomputed by the runner.
        The result is a new cache (its tensors are copies), or ``out`` filled in place when it
        is an empty cache of exactly that shape (an agent's ``kv_buffer``: a send of it on
        ``shm`` copies nothing).

        Raises:
            BlockUnavailable: blocks are missing and the tier has no runner to recompute them.
            ContextMismatch: the token ids are malformed.
        """
        self._check_open()
        return await self._loader.get(self._ids(context), out, salt)

    def prefetch(self, context: KVCache | torch.Tensor, *, salt: str = "") -> asyncio.Task[int]:
        """Workflow hint: ``context`` is needed soon; load its blocks in the background.

        Remote blocks are fetched and missing ones recomputed (when the tier has a runner), so
        that a later `get` finds them resident. Counts as an access of its blocks.

        Returns:
            The background task; its result is the number of blocks it loaded.
        """
        self._check_open()
        return self._loader.spawn_prefetch(self._ids(context), salt)

    async def load(self, context: KVCache | torch.Tensor, *, salt: str = "") -> int:
        """Make every block of ``context`` resident (what `prefetch` runs); returns how many it loaded.

        Raises:
            BlockUnavailable: blocks are missing and the tier has no runner to recompute them.
        """
        self._check_open()
        return await self._loader.prefetch(self._ids(context), salt)

    async def shed(self, target_bytes: int | None = None) -> ShedReport:
        """Shed blocks until resident bytes are at most ``target_bytes`` (default: the low watermark).

        The group scheduler's memory hint lands here. Blocks in use by a running `get` stay.
        """
        self._check_open()
        limit = self.config.low_bytes if target_bytes is None else max(0, int(target_bytes))
        return await self._table.shed(limit)

    def discard(self, context: KVCache | torch.Tensor, *, salt: str = "") -> int:
        """Forget ``context``'s blocks here (remote records stay for other agents); returns how many."""
        return self._table.discard(self.spans(context, salt=salt))

    async def close(self) -> None:
        """Stop background prefetches, release memory, close the remote connection."""
        if self.status is Status.CLOSED:
            return
        self._table.status = Status.CLOSED
        await self._loader.cancel()
        self._table.clear()
        if self.remote is not None:
            await self.remote.close()

    async def __aenter__(self) -> CacheTier:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __del__(self) -> None:
        if getattr(self, "status", Status.CLOSED) is not Status.CLOSED and getattr(self, "remote", None) is not None:
            warnings.warn("kvbus CacheTier was not closed", ResourceWarning, stacklevel=1)

    def __repr__(self) -> str:
        return (
            f"<CacheTier {self.signature.model} blocks={len(self._table.blocks)} "
            f"memory={self._table.memory}/{self.config.budget_bytes} "
            f"remote={self.remote.url if self.remote else None}>"
        )
