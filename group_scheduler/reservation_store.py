"""The group's admitted reservations in JetStream KV, so a restarted scheduler (or a standby that
takes over) still has them: bucket ``kvbus_sched_reservations``, key ``<group>.<reservation id>``."""

from __future__ import annotations

import logging
import time
from typing import Any

from nats.js.errors import KeyNotFoundError, NoKeysError

from kvbus.errors import WireFormatError
from kvbus.group_scheduler.reservations import Reservation, ReservationTable
from kvbus.net.buckets import BUCKET_WAIT_S, transport_bucket, with_retry
from kvbus.net.transport import Transport
from kvbus.protocol import FlowReservation

logger = logging.getLogger(__name__)

#: JetStream KV bucket where group schedulers keep their admitted reservations (key ``<group>.<id>``).
RESERVATIONS_BUCKET = "kvbus_sched_reservations"


class ReservationStore:
    """Persists one group's reservations; failures are logged, never raised (the table in memory holds).

    Args:
        transport: the NATS seam (a transport without a NATS connection stores nothing).
        group: the group's name (the keys' prefix).
    """

    def __init__(self, transport: Transport, group: str) -> None:
        self.transport = transport
        self.group = group
        self._bucket: Any = None

    def _key(self, reservation_id: str) -> str:
        return f"{self.group}.{reservation_id}"

    async def put(self, r: Reservation) -> None:
        """Keep ``r`` (as its `FlowReservation`)."""
        try:
            if self._bucket is None:
                self._bucket = await transport_bucket(self.transport, RESERVATIONS_BUCKET)
            if self._bucket is not None:
                await self._bucket.put(self._key(r.reservation_id), r.message(self.group).encode())
        except Exception:
            logger.warning("could not persist reservation %s", r.reservation_id, exc_info=True)

    async def delete(self, reservation_id: str) -> None:
        """Forget a cancelled reservation."""
        try:
            if self._bucket is not None:
                await self._bucket.delete(self._key(reservation_id))
        except Exception:
            logger.debug("could not delete reservation %s", reservation_id, exc_info=True)

    async def restore(self, table: ReservationTable, headroom: float, *, wait_s: float = BUCKET_WAIT_S) -> None:
        """Put the group's stored reservations back into ``table``, each at ``headroom`` x size / deadline.

        The bucket is read again while JetStream does not answer (its stream electing a leader after
        a server died), for up to ``wait_s`` seconds; a stored entry that does not decode (or has no
        deadline) is skipped, the others are restored.
        """
        try:
            self._bucket = await transport_bucket(self.transport, RESERVATIONS_BUCKET)
            if self._bucket is None:
                return
            entries = await with_retry(self._read, f"reservations of group {self.group}", wait_s=wait_s)
        except Exception:
            logger.warning("could not restore the reservations of group %s", self.group, exc_info=True)
            return
        now = time.monotonic()
        for key, value in entries:
            try:
                r = Reservation.from_message(FlowReservation.decode(value), now)
                rate = headroom * r.size_bytes / r.deadline_s
            except (WireFormatError, ValueError, ArithmeticError) as exc:
                logger.warning("group %s: stored reservation %s skipped: %s", self.group, key, exc)
                continue
            r.rate_bps = rate
            table.add(r)
        if len(table):
            logger.info("group %s: %d reservations restored", self.group, len(table))

    async def _read(self) -> list[tuple[str, bytes]]:
        """Every stored entry of this group, read in one go (so a retry starts from scratch)."""
        try:
            keys = await self._bucket.keys()
        except NoKeysError:
            return []
        out = []
        for key in keys:
            if not key.startswith(f"{self.group}."):
                continue
            try:
                entry = await self._bucket.get(key)
            except KeyNotFoundError:
                continue  # deleted (cancelled) since the listing
            out.append((key, bytes(entry.value or b"")))
        return out
