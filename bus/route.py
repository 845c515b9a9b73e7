"""The data path of one outgoing transfer to one receiver: a direct session (``shm``, ``tcp``)
when the receiver's `OpenReply` offers one and it opens, else NATS; and the fall back to NATS
when the direct path fails mid-transfer.

The transfer logic (`kvbus.bus.outgoing.OutgoingTransfer`) keeps the credit window, pacing,
repair and verdicts whatever the path: a `Route` only says where the next chunk goes. When the
direct path breaks, the route drops its session and the transfer resumes on NATS from the
receiver's last acknowledged chunk (chunks that did arrive on the direct path are dropped by
the receiver as duplicates, so nothing is delivered twice and nothing is lost). A route whose
process may not use NATS (``KVBUS_PATHS_ALLOWED`` without ``nats``) fails the receiver instead.

A direct path that damages chunks is left the same way: when the receiver has asked for
`DIRECT_REPAIR_LIMIT` chunks again without its position advancing in between, the route gives
the path up and the transfer resumes on NATS (repairs on the path that damaged the chunks
would only be damaged again).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from kvbus.bus.errors import TransferError
from kvbus.bus.paths import (
    DataPlane,
    Pacer,
    PathBroken,
    PathError,
    PathUnavailable,
    Segment,
    SendSession,
    TransferSpec,
)
from kvbus.errors import WireFormatError
from kvbus.protocol import DIGEST_BYTES, Ack, OpenReply, PathName

logger = logging.getLogger(__name__)

NATS: str = PathName.NATS.value

#: Chunks a receiver may ask for again on a direct path, its position (the first chunk it lacks)
#: not advancing in between, before the transfer leaves that path for NATS. One damaged chunk
#: now and then is repaired on the path; a path that damages (or loses) every chunk costs this
#: many resends, not every resend until the peer timeout.
DIRECT_REPAIR_LIMIT = 4


class Route:
    """Where one receiver's chunks go: ``path`` names it (``shm``, ``tcp`` or ``nats``).

    Args:
        plane: the sending process's data plane.
        spec: the transfer as both ends know it (chunk ranges, the NATS data subject).
        digests: the `Open`'s chunk digests (`DIGEST_BYTES` per chunk).
        on_ack: called with each `Ack` the receiver sent back on the direct path.
        on_lost: called once when the direct path failed and the route fell back (or failed).
        segment: the shared segment the payload was staged in, if any.
        pacer: what paces the transfer (its token bucket), told to the direct session
            (`SendSession.pace`: the kernel paces a ``tcp`` connection at its transfers' rates).
    """

    def __init__(
        self,
        plane: DataPlane,
        spec: TransferSpec,
        digests: bytes,
        *,
        on_ack: Callable[[Ack], None],
        on_lost: Callable[[PathError], None],
        segment: Segment | None = None,
        pacer: Pacer | None = None,
    ) -> None:
        self.plane = plane
        self.pacer = pacer
        self.segment = segment
        """Where the payload was staged (a shared segment: ``shm`` then copies nothing)."""
        self.spec = spec
        self.digests = digests
        self._on_ack = on_ack
        self._on_lost = on_lost
        self.session: SendSession | None = None
        self.path = NATS
        self.used: list[str] = []
        """Every path the transfer's bytes took, in order (a fall back adds ``nats``)."""
        self.nats_ok = NATS in plane.config.allowed_paths
        self._accepted: list[str] = []
        self._closing: set[asyncio.Task[None]] = set()
        self.broken: PathError | None = None
        """Why the direct path failed, once it has."""
        self._position = 0
        """The receiver's position (first chunk it lacks) in the last ack on the direct path."""
        self.repairs = 0
        """Chunks the receiver asked for again on the direct path since its position last advanced."""

    @property
    def summary(self) -> str:
        """The path for the scheduler's link estimate: the one used, or ``mixed`` after a fall back."""
        return self.used[0] if len(set(self.used)) == 1 else ("mixed" if self.used else self.path)

    async def open(self, reply: OpenReply) -> TransferError | None:
        """Take the receiver's first reply: open the fastest direct path both allow, else use NATS.

        Returns an error for the receiver when no allowed path reaches it (else None).
        """
        if self.used:
            return None  # a retried Open's reply: the path is chosen already
        self._accepted = list(reply.paths) or [NATS]  # an older receiver: NATS only
        try:
            offer = reply.offer
        except WireFormatError as exc:
            logger.warning("transfer %s: the receiver's path offer is malformed (%s)", self.spec.transfer_id, exc)
            offer = None
        if offer is not None and any(p != NATS for p in self._accepted):
            try:
                self.session = await self.plane.connect(
                    self.spec,
                    self._accepted,
                    offer,
                    on_control=self._control,
                    on_lost=self._lost,
                    segment=self.segment,
                    exclude=(PathName.NATS,),
                )
                self.path = self.session.kind.value
                self.session.pace(self.pacer)
            except PathUnavailable as exc:
                logger.info("transfer %s: no direct path to %s (%s)", self.spec.transfer_id, self.spec.receiver, exc)
        if self.session is None:
            self.path = NATS
            if not self._nats_allowed():
                self.used.append("none")
                return TransferError(
                    self.spec.transfer_id,
                    f"no allowed data path reaches {self.spec.receiver} (this process allows "
                    f"{','.join(self.plane.config.allowed_paths)}, the receiver takes {','.join(self._accepted)})",
                    peer=self.spec.receiver,
                )
        self.used.append(self.path)
        return None

    @property
    def bound(self) -> bool:
        """Whether the receiver's acks count only on the direct path: its session is up, or the
        path is still being chosen (`open` has not returned)."""
        return self.session is not None or not self.used

    @property
    def windowless(self) -> bool:
        """The chunks lie in a segment the receiver maps whole (``shm``): a credit window bounds
        no memory there, it would only make the sender wait for acks between batches of headers."""
        return self.session is not None and self.session.kind is PathName.SHM

    def repace(self) -> None:
        """The transfer's rate changed: the direct session's kernel pacing follows at once."""
        if self.session is not None:
            self.session.pace(self.pacer)

    def _nats_allowed(self) -> bool:
        return self.nats_ok and NATS in self._accepted

    def digest(self, index: int) -> str:
        """Chunk ``index``'s digest as the `Open` announced it (hex)."""
        at = index * DIGEST_BYTES
        return self.digests[at : at + DIGEST_BYTES].hex()

    async def send(self, index: int, data: bytes | memoryview) -> bool:
        """Send chunk ``index`` on the direct path; False when the chunk must go on NATS instead
        (no direct session, or it broke just now: the route has fallen back)."""
        session = self.session
        if session is None:
            return False
        try:
            await session.send_chunk(index, [memoryview(data)], self.digest(index))
        except PathError as exc:
            self._lost(exc)
            return False
        return True

    def _control(self, data: bytes) -> None:
        try:
            ack = Ack.decode(data)
        except WireFormatError:
            logger.warning("transfer %s: malformed ack on the %s path dropped", self.spec.transfer_id, self.path)
            return
        if ack.rx != self.spec.receiver or ack.transfer_id != self.spec.transfer_id:
            logger.warning("transfer %s: an ack for another transfer on its path dropped", self.spec.transfer_id)
            return
        if self.session is None and ack.missing:
            # The path was left: what it lost is sent again on NATS from the last ack anyway.
            ack = dataclasses.replace(ack, missing=[])
        self._on_ack(ack)
        self._count_repairs(ack)

    def _count_repairs(self, ack: Ack) -> None:
        """Give the direct path up once the receiver asked for `DIRECT_REPAIR_LIMIT` chunks again
        on it without its position advancing (see the module's docstring)."""
        session = self.session
        if session is None or ack.done:
            return
        if ack.next > self._position:
            self._position, self.repairs = ack.next, 0
        self.repairs += len(ack.missing)
        if self.repairs >= DIRECT_REPAIR_LIMIT:
            logger.warning(
                "transfer %s: %s asked for %d chunks again on the %s path without progress; leaving it",
                self.spec.transfer_id,
                self.spec.receiver,
                self.repairs,
                self.path,
            )
            detail = f"the receiver asked for {self.repairs} chunks again without progress (damaged or lost on it)"
            self._lost(PathBroken(self.path, detail, peer=self.spec.receiver))

    def _lost(self, error: PathError) -> None:
        session, self.session = self.session, None
        if session is None:
            return
        self.broken = error
        self._close(session, completed=False)
        self._on_lost(error)

    def fall_back(self) -> bool:
        """After the direct path failed: go on over NATS; False when this process or the receiver does not allow it."""
        if not self._nats_allowed():
            return False
        if self.path != NATS:
            logger.warning(
                "transfer %s: the %s path to %s failed (%s); resuming on NATS",
                self.spec.transfer_id,
                self.path,
                self.spec.receiver,
                self.broken.detail if self.broken is not None else "",
            )
            self.path = NATS
            self.used.append(NATS)
        return True

    def _close(self, session: SendSession, *, completed: bool) -> None:
        task = asyncio.get_running_loop().create_task(session.close(completed=completed))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self, *, completed: bool) -> None:
        """End the direct session, if any (the connection stays for other transfers)."""
        session, self.session = self.session, None
        if session is not None:
            try:
                await session.close(completed=completed)
            except Exception:
                logger.debug("closing the %s session failed", session.kind.value, exc_info=True)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
