"""A delay line on NFQUEUE, for kernels without netem: delay, jitter and loss of bridged packets.

It runs as its own process in the testbed's switch namespace (``python -m
kvbus.app.testbed.delayline QUEUE``). iptables (bridge netfilter on) sends the switch's forwarded
frames from or to impaired ports to NFQUEUE ``QUEUE``; the kernel holds each packet and tells
this process its id and the bridge ports it came in and goes out by (metadata only, never the
bytes). The process gives the kernel its verdict when the packet's time has come: accept after
the delay of both ports' links (plus uniform jitter, in order per path), or drop with the
links' loss probability. So packets queue in the kernel, TCP sees a real longer path, and
nothing is copied to user space.

Configuration is one JSON line on stdin, and again on every change::

    {"ports": {"p0": {"in": [delay_ms, jitter_ms, loss_pct], "out": [delay_ms, jitter_ms, loss_pct]}}}

``in`` applies to frames that enter the switch through the port (the host's upload), ``out`` to
frames that leave through it (its download). ``{"stats": true}`` prints one JSON line of
counters on stdout. End of stdin ends the process (iptables' ``--queue-bypass`` then lets
packets through untouched).
"""

from __future__ import annotations

import errno
import heapq
import json
import logging
import os
import random
import select
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

NETLINK_NETFILTER = 12
NETLINK_NO_ENOBUFS = 5
SOL_NETLINK = 270
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NLMSG_ERROR = 2
NLM_F_REQUEST = 1
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 4
NFQA_PACKET_HDR, NFQA_VERDICT_HDR, NFQA_IFINDEX_PHYSINDEV, NFQA_IFINDEX_PHYSOUTDEV = 1, 2, 7, 8
NF_DROP, NF_ACCEPT = 0, 1
#: Packets the kernel holds for this queue at most (beyond: dropped, like a full router buffer).
QUEUE_MAXLEN = 50_000


@dataclass(frozen=True, slots=True)
class Impairment:
    """Delay, jitter and loss of one direction of one port."""

    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0

    @classmethod
    def parse(cls, value: Any) -> Impairment:
        """From ``[delay_ms, jitter_ms, loss_pct]``.

        Raises:
            ValueError: not three numbers >= 0 (loss at most 100).
        """
        if not isinstance(value, list) or len(value) != 3 or not all(isinstance(x, int | float) for x in value):
            raise ValueError(f"an impairment is [delay_ms, jitter_ms, loss_pct], got {value!r}")
        delay, jitter, loss = (float(x) for x in value)
        if min(delay, jitter, loss) < 0 or loss > 100:
            raise ValueError(f"impairment {value!r} out of range")
        return cls(delay / 1000, jitter / 1000, loss / 100)

    def sample(self, rng: random.Random) -> float:
        """This packet's delay through this direction."""
        if self.jitter_s <= 0:
            return self.delay_s
        return max(0.0, self.delay_s + rng.uniform(-self.jitter_s, self.jitter_s))


NONE = Impairment()


def _attr(kind: int, data: bytes) -> bytes:
    length = 4 + len(data)
    return struct.pack("=HH", length, kind) + data + b"\0" * ((4 - length % 4) % 4)


class DelayLine:
    """The queue's listener: holds each packet for its path's delay, then accepts (or drops) it."""

    def __init__(self, queue: int, *, seed: int = 0) -> None:
        self.queue = queue
        self.rng = random.Random(seed)
        self.by_index: dict[int, tuple[Impairment, Impairment]] = {}
        self.pending: list[tuple[float, int, int]] = []  # (release time, seq, packet id)
        self.last_release: dict[tuple[int, int], float] = {}
        self.seq = 0
        self.stats = {"packets": 0, "dropped": 0, "accepted": 0, "max_held": 0}
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, 33, 32 << 20)  # SO_RCVBUFFORCE (root)
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 20)
        self.sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
        self.sock.bind((0, 0))
        self.sock.setblocking(False)
        self._nlseq = 0
        self._send(self._msg(NFQNL_MSG_CONFIG, _attr(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, 0))))
        self._send(
            self._msg(
                NFQNL_MSG_CONFIG,
                _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
                + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN))
                + _attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO))
                + _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO)),
            )
        )

    def _msg(self, kind: int, payload: bytes) -> bytes:
        self._nlseq += 1
        body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(self.queue)) + payload
        return (
            struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, NLM_F_REQUEST, self._nlseq, 0) + body
        )

    def _send(self, data: bytes) -> None:
        while True:
            try:
                self.sock.send(data)
                return
            except BlockingIOError:
                select.select([], [self.sock], [], 1.0)

    def configure(self, ports: dict[str, Any]) -> None:
        """Set the impairments per port name (interfaces of this namespace)."""
        table: dict[int, tuple[Impairment, Impairment]] = {}
        for name, spec in ports.items():
            index = socket.if_nametoindex(name)
            table[index] = (Impairment.parse(spec.get("in", [0, 0, 0])), Impairment.parse(spec.get("out", [0, 0, 0])))
        self.by_index = table

    def _on_packet(self, packet_id: int, physin: int, physout: int, now: float) -> bytes | None:
        self.stats["packets"] += 1
        rx = self.by_index.get(physin, (NONE, NONE))[0]
        tx = self.by_index.get(physout, (NONE, NONE))[1]
        keep = (1.0 - rx.loss) * (1.0 - tx.loss)
        if keep < 1.0 and self.rng.random() >= keep:
            self.stats["dropped"] += 1
            return self._verdict(packet_id, NF_DROP)
        path = (physin, physout)
        release = max(now + rx.sample(self.rng) + tx.sample(self.rng), self.last_release.get(path, 0.0))
        self.last_release[path] = release
        self.seq += 1
        heapq.heappush(self.pending, (release, self.seq, packet_id))
        self.stats["max_held"] = max(self.stats["max_held"], len(self.pending))
        return None

    def _verdict(self, packet_id: int, verdict: int) -> bytes:
        return self._msg(NFQNL_MSG_VERDICT, _attr(NFQA_VERDICT_HDR, struct.pack("!II", verdict, packet_id)))

    def _read(self) -> bytes:
        out = bytearray()
        now = time.monotonic()
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    continue
                raise
            off = 0
            while off + 16 <= len(data):
                length, kind, _, _, _ = struct.unpack_from("=IHHII", data, off)
                if length < 16:
                    break
                if kind == NLMSG_ERROR:
                    code = struct.unpack_from("=i", data, off + 16)[0]
                    if code:
                        logger.warning("delay line: netlink error %d", code)
                elif kind & 0xFF == NFQNL_MSG_PACKET:
                    packet_id, physin, physout = -1, 0, 0
                    a = off + 20
                    while a + 4 <= off + length:
                        alen, atype = struct.unpack_from("=HH", data, a)
                        if alen < 4:
                            break
                        atype &= 0x7FFF
                        if atype == NFQA_PACKET_HDR:
                            packet_id = struct.unpack_from("!I", data, a + 4)[0]
                        elif atype == NFQA_IFINDEX_PHYSINDEV:
                            physin = struct.unpack_from("!I", data, a + 4)[0]
                        elif atype == NFQA_IFINDEX_PHYSOUTDEV:
                            physout = struct.unpack_from("!I", data, a + 4)[0]
                        a += (alen + 3) & ~3
                    if packet_id >= 0:
                        msg = self._on_packet(packet_id, physin, physout, now)
                        if msg:
                            out += msg
                off += (length + 3) & ~3
        return bytes(out)

    def _release(self) -> bytes:
        out = bytearray()
        now = time.monotonic()
        while self.pending and self.pending[0][0] <= now:
            _, _, packet_id = heapq.heappop(self.pending)
            out += self._verdict(packet_id, NF_ACCEPT)
            self.stats["accepted"] += 1
        return bytes(out)

    def serve(self, control: Any) -> None:
        """Run until ``control`` (a text stream of JSON lines) ends."""
        fd = control.fileno()
        buffered = b""
        while True:
            timeout = max(0.0, self.pending[0][0] - time.monotonic()) if self.pending else 1.0
            ready, _, _ = select.select([self.sock, fd], [], [], timeout)
            out = b""
            if self.sock in ready:
                out += self._read()
            if fd in ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                buffered += chunk
                while b"\n" in buffered:
                    line, buffered = buffered.split(b"\n", 1)
                    self._command(line)
            out += self._release()
            if out:
                self._send(out)
        # Let go of what is held: accept it now rather than leave it to the kernel's timeout.
        rest = b"".join(self._verdict(p, NF_ACCEPT) for _, _, p in self.pending)
        if rest:
            self._send(rest)

    def _command(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            cmd = json.loads(line)
            if "ports" in cmd:
                self.configure(cmd["ports"])
            if cmd.get("stats"):
                print(json.dumps(self.stats), flush=True)
        except (ValueError, OSError, AttributeError) as exc:
            print(json.dumps({"error": str(exc)}), flush=True)


def main(argv: list[str]) -> int:
    """``python -m kvbus.app.testbed.delayline QUEUE``: serve until stdin closes."""
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m kvbus.app.testbed.delayline QUEUE_NUMBER", file=sys.stderr)
        return 2
    line = DelayLine(int(argv[0]))
    print(json.dumps({"ready": True}), flush=True)
    line.serve(sys.stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
