"""An agent's inbox: verified deliveries in arrival order, `receive` and `gather`."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterable

from kvbus.bus.errors import ReceiveTimeout
from kvbus.bus.types import Delivery


class Inbox:
    """Deliveries waiting to be taken; those `gather` passed over wait in a stash for `receive`."""

    def __init__(self) -> None:
        self._deliveries: asyncio.Queue[Delivery] = asyncio.Queue()
        self._stash: collections.deque[Delivery] = collections.deque()

    def put(self, delivery: Delivery) -> None:
        """Add a verified delivery."""
        self._deliveries.put_nowait(delivery)

    def drain(self) -> list[Delivery]:
        """Take every delivery waiting now, without waiting for more."""
        got = list(self._stash)
        self._stash.clear()
        while not self._deliveries.empty():
            got.append(self._deliveries.get_nowait())
        return got

    async def receive(self, timeout: float | None = None) -> Delivery:
        """The next delivery.

        Raises:
            ReceiveTimeout: nothing arrived within ``timeout`` seconds.
        """
        if self._stash:
            return self._stash.popleft()
        try:
            return await asyncio.wait_for(self._deliveries.get(), timeout)
        except TimeoutError:
            raise ReceiveTimeout(timeout or 0.0) from None

    async def gather(self, from_: Iterable[str], *, timeout: float | None = None) -> dict[str, Delivery]:
        """One delivery from each of ``from_``; others stay for `receive`.

        Raises:
            ReceiveTimeout: not all arrived within ``timeout`` seconds.
        """
        wanted = set(from_)
        got: dict[str, Delivery] = {}
        for d in list(self._stash):
            if d.sender in wanted and d.sender not in got:
                got[d.sender] = d
                self._stash.remove(d)
        deadline = None if timeout is None else time.monotonic() + timeout
        others: list[Delivery] = []
        try:
            while len(got) < len(wanted):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    d = await asyncio.wait_for(self._deliveries.get(), left)
                except TimeoutError:
                    missing = sorted(wanted - set(got))
                    raise ReceiveTimeout(timeout or 0.0, f"delivery from {', '.join(missing)}") from None
                if d.sender in wanted and d.sender not in got:
                    got[d.sender] = d
                else:
                    others.append(d)
        finally:
            self._stash.extend(others)
        return got
