"""The receiver's side of one streamed transfer: chunks checked and placed, credit, repair requests.

Chunks arrive on the transfer's data subject. Each is checked against the digest the sender's
`Open` announced for its index (`kvbus.bus.chunking.ChunkVerifier`); one with a bad index, size
or digest is dropped and asked for again from the sender, whatever its headers say; duplicates
are dropped. Every ``ack_every`` chunks (and whenever a gap shows) the receiver acknowledges its
position and lists what is missing. When the last chunk is in, the agent's finish callback
decodes and delivers the payload and sends the final verdict (`IncomingTransfer.report`).
Only a chunk that passes its digest counts as progress (`last_progress`): junk keeps nothing alive.

The transfer is also the `ChunkSink` of its direct paths (``shm``, ``tcp``): a chunk that
arrives there, already hashed by the path, must have the digest the `Open` announced for its
index, and then goes through the same placement, duplicate, repair and verdict rules as a
chunk from NATS (`_place`). Acknowledgements go back on the direct path while it is up (the
verdict on NATS as well); when it fails, the sender resumes on NATS and the chunks already
in stay. A payload that came whole on one direct path is delivered as views of the buffer it
landed in (the TCP receive buffer, the shared segment's mapping), without a copy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.trace import INVALID_SPAN, Span

from kvbus.bus.chunking import ChunkPlan, ChunkVerifier, Reassembly
from kvbus.bus.config import BusConfig
from kvbus.bus.paths import DataPlane, PathError, ReceiveSession
from kvbus.bus.paths.shm import address
from kvbus.kvcache import KVCache
from kvbus.net.transport import Transport
from kvbus.protocol import CHUNK_INDEX_HEADER, DIGEST_BYTES, Ack, Open, PathName, Reason, packb, unpackb

logger = logging.getLogger(__name__)

#: What a placed chunk asks of the transfer next (`IncomingTransfer._place`).
_NOTHING, _ACK, _GAP, _DONE = range(4)


class IncomingTransfer:
    """The receiver's side of one streamed transfer: reassembly, verification, repair requests."""

    def __init__(
        self,
        transport: Transport,
        open_msg: Open,
        rx: str,
        config: BusConfig,
        finish: Callable[[IncomingTransfer], Awaitable[None]],
        plan: ChunkPlan | None = None,
    ) -> None:
        self.transport = transport
        plan = plan or ChunkPlan(open_msg.sizes, open_msg.chunk_size)
        # While it waits for chunks a partial keeps its codec metadata packed and its sizes in the
        # plan's array: what it holds is then known to the byte (`overhead`), not a decoded map of
        # whatever a hostile sender packed into it.
        self._meta = packb(open_msg.meta)
        self.open = dataclasses.replace(open_msg, meta={}, sizes=[])
        """The transfer's `Open`, without its metadata and sizes (see `opened`)."""
        self.rx = rx
        self.config = config
        self._finish = finish
        self.assembly = Reassembly(plan.sizes, open_msg.chunk_size, plan)
        self.verifier = ChunkVerifier(plan, open_msg.digests)
        self.overhead = len(self._meta) + len(open_msg.digests) + 9 * plan.n_chunks + 32 * len(plan.sizes) + 2048
        """Bytes of bookkeeping this partial holds besides the payload (what the overhead cap counts)."""
        self.have = bytearray(open_msg.n_chunks)
        self.count = 0
        self.next = 0
        self.corrupt = 0
        self.duplicates = 0
        self.last_progress = time.monotonic()
        """When the transfer last made valid progress (its Open, then each chunk that passed its digest)."""
        self.started = time.perf_counter()
        self.completed = False
        self._sub: Subscription | None = None
        self._since_ack = 0
        self._asked: set[int] = set()
        self._done_task: asyncio.Task[None] | None = None
        self.spans: tuple[Span, Span] = (INVALID_SPAN, INVALID_SPAN)
        """The receiver's ``kvbus.receive`` and ``kvbus.reassemble`` spans (set by the agent)."""
        self.plane: DataPlane | None = None
        """The receiving process's data plane, when the transfer was offered direct paths (set by the agent)."""
        self.paths: list[str] = ["nats"]
        """The paths this receiver takes the transfer on (its `OpenReply`'s)."""
        self.via: set[str] = set()
        """The direct paths a sender opened for this transfer."""
        self._direct: dict[int, memoryview] = {}
        """Chunks that came on a direct path (placed into `assembly` only if the payload is not
        whole in one buffer)."""
        self._bases: list[memoryview] = []
        """Buffers the direct paths wrote into (a whole payload in one is delivered as its views)."""
        self.region: tuple[memoryview, Sequence[int]] | None = None
        """Set by `buffers` when they are slices of one buffer (at the plan's starts): decoders view them in bulk."""
        self.twins: list[tuple[memoryview, memoryview]] = []
        """Per buffer a direct path lent (``shm``): that buffer and a second copy-on-write mapping
        of the same bytes, which the receiver keeps as the delta base instead of a copy."""
        self._control: ReceiveSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.prepared: asyncio.Future[KVCache] | None = None
        """The codec's work started when the `Open` was accepted (`Codec.prepare`: ``split``'s
        prefill of its prefix), running in a worker thread while the chunks stream in."""

    @property
    def nbytes(self) -> int:
        """Bytes the payload will take once whole (what the partial caps count)."""
        return self.open.total

    def opened(self) -> Open:
        """The whole `Open` again, metadata and sizes included (for the decode)."""
        meta = unpackb(self._meta, "open metadata")
        return dataclasses.replace(self.open, meta=meta, sizes=list(self.assembly.plan.sizes))

    async def start(self) -> None:
        """Subscribe to the transfer's data subject."""
        self._sub = await self.transport.subscribe(self.open.data_subject, self._on_chunk)

    async def stop(self) -> None:
        """Unsubscribe and withdraw the direct paths (the partial payload is then dropped with this object)."""
        self.completed = True
        if self.prepared is not None and not self.prepared.done():
            self.prepared.cancel()  # its thread runs to its end; nobody waits for the result
        plane, self.plane = self.plane, None
        if plane is not None:
            await plane.withdraw(self.open.transfer_id)
        self._control = None
        self._bases.clear()
        self.twins.clear()
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:
                logger.debug("unsubscribe failed", exc_info=True)

    async def report(self, *, ok: bool, reason: str = "", code: Reason = Reason.NONE, decode_s: float = 0.0) -> None:
        """Send the final verdict: delivered (``ok``), or refused with ``code`` and ``reason``."""
        await self._ack(done=True, ok=ok, reason=reason, code=code, decode_s=decode_s)

    async def _ack(
        self,
        *,
        missing: list[int] | None = None,
        done: bool = False,
        ok: bool = True,
        reason: str = "",
        code: Reason = Reason.NONE,
        decode_s: float = 0.0,
    ) -> None:
        ack = Ack(
            transfer_id=self.open.transfer_id,
            rx=self.rx,
            next=self.next,
            received=self.count,
            missing=missing or [],
            done=done,
            ok=ok,
            reason=reason,
            decode_s=decode_s,
            code=code,
        )
        data = ack.encode()
        session = self._control
        if session is not None:
            try:
                await session.send_control(data)
                if not done:
                    return  # credit and repair on the direct path; the verdict goes on NATS too
            except (PathError, ValueError):
                self._control = None
        try:
            await self.transport.publish(self.open.ack_subject, data)
        except Exception:
            logger.warning("transfer %s: could not send ack", self.open.transfer_id, exc_info=True)

    async def _on_chunk(self, msg: Msg) -> None:
        if self.completed:
            return
        headers = msg.headers or {}
        try:
            index = int(headers[CHUNK_INDEX_HEADER])
        except (KeyError, ValueError):
            self.corrupt += 1
            logger.warning("transfer %s: chunk without a valid index header dropped", self.open.transfer_id)
            return
        if not 0 <= index < self.open.n_chunks:
            self.corrupt += 1
            logger.warning("transfer %s: chunk index %d out of range dropped", self.open.transfer_id, index)
            return
        if self.have[index]:
            self.duplicates += 1
            return
        data = msg.data
        if not self.verifier.check(index, data):
            self.corrupt += 1
            logger.warning("transfer %s: chunk %d failed its digest, asking again", self.open.transfer_id, index)
            self._asked.discard(index)
            await self._request_missing(index + 1)
            return
        await self._act(self._place(index, data, direct=False), index)

    def _place(self, index: int, data: bytes | memoryview, *, direct: bool) -> int:
        """Take verified chunk ``index`` (from NATS or a direct path); what to do next (`_ACK`, `_GAP`, ...)."""
        self.last_progress = time.monotonic()
        if direct:
            self._direct[index] = memoryview(data)
        else:
            self.assembly.add(index, data)
        self.have[index] = 1
        self.count += 1
        self._since_ack += 1
        self._asked.discard(index)
        while self.next < self.open.n_chunks and self.have[self.next]:
            self.next += 1
        if self.count == self.open.n_chunks:
            self.completed = True
            # Not in this callback: unsubscribing cancels the task that runs it.
            self._done_task = asyncio.create_task(self._complete(), name=f"kvbus-finish-{self.open.transfer_id}")
            return _DONE
        if index > self.next:
            return _GAP
        if self._since_ack >= self.config.ack_every:
            self._since_ack = 0
            return _ACK
        return _NOTHING

    async def _act(self, action: int, index: int) -> None:
        if action == _GAP:
            await self._request_missing(index)
        elif action == _ACK:
            await self._ack()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the direct paths (`ChunkSink`) ---------------------------------------------------------

    def chunk_arrived(self, index: int, data: memoryview, digest: str, root: str) -> None:
        """A direct path verified chunk ``index`` against ``digest`` (hashed from ``data``): keep it
        if that is the digest the `Open` announced, else ask for it again."""
        if self.completed or not 0 <= index < self.open.n_chunks:
            return
        if self.have[index]:
            self.duplicates += 1
            return
        at = index * DIGEST_BYTES
        try:
            announced = bytes.fromhex(digest) == self.verifier.digests[at : at + DIGEST_BYTES]
        except ValueError:
            announced = False
        if not announced or len(data) != self.verifier.chunk_len(index):
            logger.warning(
                "transfer %s: chunk %d on a direct path is not the announced one", self.open.transfer_id, index
            )
            self._unmark(index)
            self.chunk_corrupt(index, PathName.TCP)
            return
        action = self._place(index, data, direct=True)
        if action in (_ACK, _GAP):
            self._spawn(self._act(action, index))

    def _unmark(self, index: int) -> None:
        """Let the direct paths take chunk ``index`` again (the copy they verified was not the announced one)."""
        registry = self.plane.registry if self.plane is not None else None
        expected = registry.get(self.open.transfer_id) if registry is not None else None
        if expected is not None:
            expected.have[index] = 0

    def chunk_corrupt(self, index: int, path: PathName) -> None:
        """Chunk ``index`` failed its digest on a direct path: ask for it again."""
        if self.completed:
            return
        self.corrupt += 1
        self._asked.discard(index)
        self._spawn(self._request_missing(index + 1))

    def path_opened(self, session: ReceiveSession) -> None:
        """The sender bound a direct path: acks go back on it; what it writes into may be delivered as is."""
        self.via.add(session.kind.value)
        self._control = session
        self.last_progress = time.monotonic()
        for base in (getattr(session, "view", None), getattr(getattr(session, "expected", None), "buffer", None)):
            if isinstance(base, memoryview) and base.nbytes >= self.open.total:
                self._bases.append(base)
        view, twin = getattr(session, "view", None), getattr(session, "twin", None)
        if isinstance(view, memoryview) and isinstance(twin, memoryview) and twin.nbytes == view.nbytes:
            self.twins.append((view, twin))

    def path_lost(self, session: ReceiveSession, error: PathError) -> None:
        """The direct path failed: the sender goes on over NATS (acks too); what arrived stays."""
        if self._control is session:
            self._control = None
        logger.info("transfer %s: the %s path failed (%s)", self.open.transfer_id, session.kind.value, error.detail)

    def buffers(self) -> list[memoryview]:
        """The payload's buffers, once every chunk is in: views of the one buffer a direct path
        wrote the whole payload into, else rebuilt by the `Reassembly`."""
        plan = self.assembly.plan
        if self._direct and len(self._direct) == self.open.n_chunks:
            base = self._contiguous_base()
            if base is not None:
                self.region = (base, plan.starts)
                return [base[s : s + n] for s, n in zip(plan.starts, plan.sizes)]
        for i, data in self._direct.items():
            self.assembly.add(i, data)
        self._direct.clear()
        return self.assembly.result()

    def _contiguous_base(self) -> memoryview | None:
        ranges = self.assembly.plan.ranges
        for base in self._bases:
            start = address(base)
            if all(address(self._direct[i]) == start + lo for i, (lo, _) in enumerate(ranges)):
                return base[: self.open.total]
        return None

    async def _complete(self) -> None:
        try:
            await self._finish(self)
        except Exception:
            logger.exception("transfer %s: finishing failed", self.open.transfer_id)
            await self.report(ok=False, reason="receiver failed while finishing", code=Reason.INTERNAL)
        finally:
            await self.stop()

    async def _request_missing(self, upto: int) -> None:
        """Ask for every chunk below ``upto`` not yet received and not already asked for."""
        missing = [
            i for i in range(self.next, min(upto, self.open.n_chunks)) if not self.have[i] and i not in self._asked
        ][: self.config.max_missing]
        if missing:
            self._asked.update(missing)
            self._since_ack = 0
            await self._ack(missing=missing)

    def verify(self) -> bool:
        """Whether every chunk is in (each passed the digest the `Open` announced for it)."""
        return self.count == self.open.n_chunks and all(self.have)
