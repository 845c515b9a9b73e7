"""Queued transfers indexed by (sender, receivers) pair, with the columns the round robin needs.

Each pair with queued work holds a numbered slot. Per slot, numpy columns keep what its weight
W_ij is made of (the pair's role priorities and since when it has waited with nothing
running) and how many of its transfers run, so the weights of all pairs are one vector expression and a round
robin pick is a few vector operations: the policy's cost per grant grows with the number of
pairs only through C loops.
"""

from __future__ import annotations

import numpy as np

from kvbus.group_scheduler.state import Pending
from kvbus.group_scheduler.weights import UrgencyModel
from kvbus.group_scheduler.wrr import PairPicker

Pair = tuple[str, tuple[str, ...]]


def _special(p: Pending) -> bool:
    """Transfers whose urgency has more than the waiting term (critical, or with a deadline)."""
    return p.request.critical or p.deadline_at is not None


class PairQueues:
    """FIFO queues of transfers per pair in numbered slots."""

    def __init__(self, picker: PairPicker | None = None, *, per_pair: int = 1, capacity: int = 64) -> None:
        self.picker = picker
        self._incremental = picker is not None and picker.incremental
        """The picker keeps its own index of the ready slots (told of every change here)."""
        self.per_pair = per_pair
        self.slots: dict[Pair, int] = {}
        self.queues: list[list[Pending]] = []
        self.free: list[int] = []
        self.n = 0
        """Slots in use are below this."""
        self.since = np.zeros(capacity)
        """Since when the pair has waited with nothing running (``inf`` while it runs)."""
        self.rp = np.zeros(capacity)
        """Role priority of the sender plus the highest of the receivers'."""
        self.has_work = np.zeros(capacity, dtype=bool)
        self.running = np.zeros(capacity, dtype=np.int64)
        self.ready = np.zeros(capacity, dtype=bool)
        """Has queued work and fewer than ``per_pair`` running: may be picked."""
        self.special_heads: set[int] = set()
        self._w = np.zeros(capacity)
        self._w_at = -np.inf
        self._w_stale: set[int] = set()

    def __len__(self) -> int:
        return len(self.slots)

    def _grow(self) -> None:
        cap = 2 * len(self.since)
        for name in ("since", "rp", "has_work", "running", "ready", "_w"):
            old = getattr(self, name)
            new = np.zeros(cap, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def push(self, p: Pending, rp: float, running: int, since: float) -> int:
        """Queue ``p`` behind its pair's earlier transfers; returns its pair's slot.

        ``since`` is when a new pair started waiting (ignored for a pair already queued).
        """
        pair = p.pair
        slot = self.slots.get(pair)
        if slot is not None:
            self.queues[slot].append(p)
            return slot
        if self.free:
            slot = self.free.pop()
            self.queues[slot] = [p]
        else:
            slot = self.n
            self.n += 1
            if slot >= len(self.since):
                self._grow()
            self.queues.append([p])
        self.slots[pair] = slot
        self.rp[slot] = rp
        self.running[slot] = running
        self.since[slot] = since
        self.has_work[slot] = True
        self.ready[slot] = ready = running < self.per_pair
        self._w_stale.add(slot)
        self._set_head(slot)
        if self._incremental:
            self.picker.assign(slot, pair)  # type: ignore[union-attr]
            (self.picker.ready if ready else self.picker.unready)(slot)  # type: ignore[union-attr]
        elif self.picker is not None:
            self.picker.reset(slot)
        return slot

    def remove(self, p: Pending) -> None:
        """Take ``p`` out of its pair's queue; a pair left empty frees its slot."""
        slot = self.slots[p.pair]
        queue = self.queues[slot]
        was_head = queue[0] is p
        queue.remove(p)
        if not queue:
            del self.slots[p.pair]
            self.has_work[slot] = False
            self.ready[slot] = False
            if self._incremental:
                self.picker.release(slot)  # type: ignore[union-attr]
            self.special_heads.discard(slot)
            self.free.append(slot)
        elif was_head:
            self._set_head(slot)
            self._w_stale.add(slot)

    def _set_head(self, slot: int) -> None:
        head = self.queues[slot][0]
        if _special(head):
            self.special_heads.add(slot)
        else:
            self.special_heads.discard(slot)

    def head(self, slot: int) -> Pending:
        """The oldest queued transfer of ``slot``'s pair (the next it would start)."""
        return self.queues[slot][0]

    def set_running(self, pair: Pair, count: int, since: float) -> None:
        """The pair's running count changed; ``since`` is when its waiting (re)started."""
        slot = self.slots.get(pair)
        if slot is not None:
            self.running[slot] = count
            self.since[slot] = since
            self.ready[slot] = ready = count < self.per_pair
            self._w_stale.add(slot)
            if self._incremental:
                (self.picker.ready if ready else self.picker.unready)(slot)  # type: ignore[union-attr]

    def waiting_since(self, pair: Pair) -> float:
        """Since when ``pair`` has waited with nothing running; inf if it has no queued work."""
        slot = self.slots.get(pair)
        return float(self.since[slot]) if slot is not None else float("inf")

    def eligible(self) -> np.ndarray:
        """A copy of the slots that may be picked (queued work, fewer than ``per_pair`` running)."""
        return self.ready[: self.n].copy()

    def weights(self, now: float, model: UrgencyModel, max_age: float = 0.0) -> np.ndarray:
        """W_ij of every slot: role priorities plus the urgency of the pair's oldest transfer.

        A vector computed less than ``max_age`` ago is reused (waiting terms move little within
        a slice), with the slots that changed since brought up to date; writes to the returned
        view update it.
        """
        n = self.n
        if now - self._w_at < max_age:
            w = self._w[:n]
            for slot in self._w_stale:
                if slot < n and self.has_work[slot]:
                    w[slot] = self.weight(slot, now, model)
            self._w_stale.clear()
            return w
        self._w_stale.clear()
        self._w_at = now
        with np.errstate(invalid="ignore"):  # inf - inf (a running pair's since) is NaN: no wait
            waiting = model.waiting_terms(now - self.since[:n])
        w = self._w[:n]
        np.add(self.rp[:n], model.base, out=w)
        w += waiting
        for slot in self.special_heads:
            w[slot] = self.weight(slot, now, model)
        return w

    def weight(self, slot: int, now: float, model: UrgencyModel) -> float:
        """W_ij of one slot: its role priorities plus the urgency of its oldest queued transfer."""
        since = float(self.since[slot])
        return float(self.rp[slot] + model.urgency(self.queues[slot][0], now, since=min(since, now)))
