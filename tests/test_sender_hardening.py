"""Issue 31 (hardening, round three), the sender's findings, against a real nats-server, a real
scheduler and a receiving agent in another OS process (`tests/peer.py`):

- 10: outside secure mode any client may answer an `Open` or publish on an ack subject. A reply
  for another transfer id decides nothing (the `Open` is asked again); while the bytes go on a
  direct path, a verdict on NATS does not count, only the one on the path bound with the
  receiver's token does.
- 6: a direct path that damages every chunk is left for NATS after a few repairs; the transfer
  completes there, verified, once.
- 4: a failure after the bytes may have arrived is `TransferInDoubt`, a plain `TransferError`
  only where nothing can have been delivered; a retry with the same idempotency key is answered
  with the first verdict.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import uuid
from collections.abc import Sequence
from typing import Any

import pytest

from kvbus.bus import Bus, ReceiveTimeout, TransferError, TransferInDoubt, TransferTimeout
from kvbus.bus.incoming import IncomingTransfer
from kvbus.bus.paths.tcp import TcpSendSession
from kvbus.bus.route import DIRECT_REPAIR_LIMIT
from kvbus.protocol import Ack, OpenReply, ack_subject, inbox_subject
from tests.conftest import FAST, ready_up
from tests.kvutil import kv_of_bytes
from tests.peer import SIG, Peer, kv_digest
from tests.test_helm import CHART, HELM, NAMESPACE, RELEASE, helm

MB = 1 << 20


# -- 10: non-secure mode -------------------------------------------------------------------------------


@pytest.mark.parametrize("sender_bus", ["tcp,nats"], indirect=True)
async def test_a_reply_to_the_open_for_another_transfer_is_ignored_and_the_open_asked_again(
    nats_url: str, sender_bus: Bus, bus: Bus
) -> None:
    """Finding 10: another client answers the `Open` first (the receiver is stopped until then)
    with "done" for another transfer id. The sender took the first reply as the verdict and
    reported a delivery that never happened; now it ignores it, asks again, and the receiver
    gets the transfer."""
    name = f"foreign-rx-{uuid.uuid4().hex[:6]}"
    peer = await Peer.agent(nats_url, name)
    answered: list[str] = []

    async def rogue(msg: Any) -> None:
        if answered:
            return
        answered.append(msg.subject)
        reply = OpenReply(transfer_id="f" * 32, ok=True, done=True)
        await bus.transport.reply(msg, reply.encode())
        await bus.transport.flush()
        os.kill(peer.proc.pid, signal.SIGCONT)

    try:
        tx = await sender_bus.agent(f"foreign-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
        sub = await bus.transport.subscribe(inbox_subject(name, tx.name), rogue)
        await bus.transport.flush()
        os.kill(peer.proc.pid, signal.SIGSTOP)  # the rogue answers first
        try:
            kv = kv_of_bytes(SIG, 4 * MB, seed=21)
            report = await tx.send(name, kv, medium="full")
        finally:
            os.kill(peer.proc.pid, signal.SIGCONT)
            await sub.unsubscribe()
        assert answered
        got = await peer.line(timeout=30)
        assert got["transfer_id"] == report.transfer_id and got["digest"] == kv_digest(kv)
    finally:
        await peer.stop()


@pytest.mark.parametrize(
    ("sender_bus", "path"), [("shm,tcp,nats", "shm"), ("tcp,nats", "tcp")], indirect=["sender_bus"], ids=["shm", "tcp"]
)
async def test_a_verdict_on_nats_does_not_count_while_the_bytes_go_on_a_direct_path(
    nats_url: str, sender_bus: Bus, bus: Bus, path: str
) -> None:
    """Finding 10: the receiver freezes mid-transfer on a direct path; another client publishes
    "done, ok" for the transfer on the receiver's NATS ack subject. The sender counted it and
    `send()` reported success while the addressee got nothing; now only the bound path's verdict
    counts and the send fails."""
    name = f"nats-verdict-rx-{path}-{uuid.uuid4().hex[:6]}"
    peer = await Peer.agent(nats_url, name, "--stall-at-chunk", "9")
    try:
        tx = await sender_bus.agent(f"nats-verdict-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
        # Nine chunks (one per buffer): the receiver freezes on the last, every byte read (a
        # frozen reader would leave a ``tcp`` sender blocked on its socket).
        send = asyncio.create_task(tx.send(name, kv_of_bytes(SIG, 12 * MB, seed=22), medium="full"))
        stalled = await peer.line()
        assert stalled["via"] == [path]
        tid = stalled["stalled"]
        forged = Ack(transfer_id=tid, rx=name, next=1 << 20, received=1 << 20, done=True, ok=True)
        await bus.transport.publish(ack_subject(tx.name, name), forged.encode())
        await bus.transport.flush()
        with pytest.raises(TransferError) as info:
            await asyncio.wait_for(send, 60)
        assert info.value.transfer_id == tid
    finally:
        await peer.stop()


#: What `kvbus up`'s banner and the chart's NOTES say outside secure mode.
BANNER = "not secure (no --secure): any NATS client can read any agent's KV and fake its deliveries"
NOTES_WARNING = "make its send() report a delivery that never happened"


def test_kvbus_up_says_what_non_secure_mode_cannot_protect(tmp_path: Any) -> None:
    """Finding 10: `kvbus up` without ``--secure`` says so, and what it means, in its banner."""
    proc, out = ready_up(tmp_path)
    try:
        assert BANNER in out, out
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(HELM is None, reason="helm binary not found (scripts/install-helm.sh)")
@pytest.mark.parametrize(
    ("sets", "warned"),
    [
        ((), None),
        (("nats.auth.enabled=false",), "nats.auth.enabled is false"),
        (
            ("nats.enabled=false", "nats.external.url=nats://nats.elsewhere:4222"),
            "nats.external.existingSecret is empty",
        ),
    ],
    ids=["default-secure", "auth-off", "external-without-users"],
)
def test_the_chart_is_secure_by_default_and_its_notes_warn_when_it_is_not(
    sets: tuple[str, ...], warned: str | None
) -> None:
    """Finding 10: the chart's default is per-agent users (no warning); turning them off takes an
    explicit value, and the NOTES then say what that cannot protect (an external NATS without
    users was not warned about)."""
    args = [a for s in sets for a in ("--set", s)]
    out = helm("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE, *args)
    notes = out[out.index("NOTES:") :]
    if warned is None:
        assert "secure mode is off" not in notes and "Bus.connect(url, secure=True" in notes
    else:
        flat = " ".join(notes.split())
        assert f"WARNING: {warned}: secure mode is off." in flat and NOTES_WARNING in flat
        assert "Bus.connect(url)" in notes


# -- 6: a direct path that damages every chunk ------------------------------------------------------------------


@pytest.mark.parametrize("sender_bus", ["tcp,nats"], indirect=True)
async def test_a_tcp_path_that_damages_every_chunk_is_left_for_nats_and_delivers_once(
    nats_url: str, sender_bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 6: every chunk on ``tcp`` arrives with one byte changed (the damage of
    `kvbus bench chaos`'s ``damage_tcp``). The sender resent on ``tcp`` until the peer timeout
    failed the transfer; now it leaves the path after `DIRECT_REPAIR_LIMIT` repairs and the
    transfer completes on NATS, verified, once."""
    name = f"damaged-rx-{uuid.uuid4().hex[:6]}"
    peer = await Peer.agent(nats_url, name)
    damaged: list[int] = []
    original = TcpSendSession.send_chunk

    async def damaging(
        self: TcpSendSession, index: int, pieces: Sequence[memoryview], digest: str, *, root: str = ""
    ) -> None:
        data = bytearray(b"".join(pieces))
        data[len(data) // 2] ^= 0x5A  # under the announced digest: the receiver asks again
        damaged.append(index)
        await original(self, index, [memoryview(data)], digest, root=root)

    monkeypatch.setattr(TcpSendSession, "send_chunk", damaging)
    try:
        tx = await sender_bus.agent(f"damaged-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
        kv = kv_of_bytes(SIG, 24 * MB, seed=23)
        report = await tx.send(name, kv, medium="full")
        assert report.paths == ("tcp", "nats") and report.path == "nats"
        # A few repairs on tcp, then every chunk from the last ack once on NATS.
        assert len(damaged) >= DIRECT_REPAIR_LIMIT and report.retransmits <= DIRECT_REPAIR_LIMIT
        got = await peer.line()
        assert got["transfer_id"] == report.transfer_id and got["digest"] == kv_digest(kv)
        # Once: the next delivery is the next transfer (on tcp again, now undamaged).
        monkeypatch.setattr(TcpSendSession, "send_chunk", original)
        marker = kv_of_bytes(SIG, 4 * MB, seed=24)
        second = await tx.send(name, marker, medium="full")
        got2 = await peer.line()
        assert got2["transfer_id"] == second.transfer_id and got2["digest"] == kv_digest(marker)
        assert second.paths == ("tcp",)
    finally:
        await peer.stop()


# -- 4: "failed" while delivered ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sender_bus", "path"), [("shm,tcp,nats", "shm"), ("tcp,nats", "tcp")], indirect=["sender_bus"], ids=["shm", "tcp"]
)
async def test_a_receiver_killed_between_its_verdict_and_the_senders_read_of_it_is_in_doubt(
    nats_url: str, sender_bus: Bus, path: str
) -> None:
    """Finding 4: the receiver delivers, then is killed -9 before the sender reads its verdict.
    The sender said the transfer failed (`ReceiverGone`) and an application that retried on that
    delivered it twice; now it says `TransferInDoubt`, with the failure it saw as ``cause``."""
    name = f"doubt-rx-{path}-{uuid.uuid4().hex[:6]}"
    peer = await Peer.agent(nats_url, name, "--hang-after-delivery")
    try:
        tx = await sender_bus.agent(f"doubt-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
        kv = kv_of_bytes(SIG, 12 * MB, seed=41)
        send = asyncio.create_task(tx.send(name, kv, medium="full", idempotency_key="doubt-1"))
        delivered = await peer.line()  # printed by the receiver as it delivers, before its verdict
        assert delivered["digest"] == kv_digest(kv)
        os.kill(peer.proc.pid, signal.SIGKILL)
        with pytest.raises(TransferInDoubt) as info:
            await asyncio.wait_for(send, 60)
        assert info.value.transfer_id == delivered["transfer_id"]
        assert isinstance(info.value.cause, TransferError) and not isinstance(info.value.cause, TransferInDoubt)
    finally:
        await peer.stop()


@pytest.mark.usefixtures("nats_only")
async def test_a_transfer_that_fails_before_every_chunk_went_out_is_a_plain_failure(nats_url: str, bus: Bus) -> None:
    """Finding 4, the other side: the receiver freezes at its second chunk, so the sender (its
    window full) never sends the rest: nothing can have been delivered, the failure is plain."""
    name = f"plain-rx-{uuid.uuid4().hex[:6]}"
    peer = await Peer.agent(nats_url, name, "--stall-at-chunk", "2", "--paths", "nats")
    try:
        tx = await bus.agent(f"plain-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
        n_chunks = (24 * MB) // bus.chunk_size
        assert n_chunks > 2 + FAST.window  # the window stops the sender short of the last chunk
        with pytest.raises(TransferTimeout) as info:
            await tx.send(name, kv_of_bytes(SIG, 24 * MB, seed=42), medium="full")
        assert not isinstance(info.value, TransferInDoubt)
    finally:
        await peer.stop()


async def test_a_retry_with_the_same_idempotency_key_is_answered_with_the_first_verdict(
    nats_url: str, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 4: the receiver delivers and goes away before its verdict leaves (its agent closes);
    the sender gets `TransferInDoubt`. The agent comes back on the same bus, and the send is
    retried with the same key: answered "done" from the first delivery, not delivered again; a
    send with another key is delivered."""
    other = await Bus.connect(nats_url, config=FAST)
    try:
        name = f"key-rx-{uuid.uuid4().hex[:6]}"
        rx = await other.agent(name, signature=SIG)
        tx = await bus.agent(f"key-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
        report = IncomingTransfer.report
        closing: list[asyncio.Task[None]] = []

        async def vanish(self: IncomingTransfer, *, ok: bool, **kwargs: Any) -> None:
            if ok and self.rx == name and not closing:
                closing.append(asyncio.create_task(rx.close()))  # gone before its verdict leaves
                return
            await report(self, ok=ok, **kwargs)

        monkeypatch.setattr(IncomingTransfer, "report", vanish)
        kv = kv_of_bytes(SIG, 6 * MB, seed=43)
        with pytest.raises(TransferInDoubt):
            await tx.send(name, kv, medium="full", idempotency_key="job-7")
        await closing[0]
        monkeypatch.setattr(IncomingTransfer, "report", report)
        rx = await other.agent(name, signature=SIG)  # the same name on the same bus: its memory
        again = await tx.send(name, kv, medium="full", idempotency_key="job-7")
        assert again.transfer_id  # answered with the first verdict: delivered
        with pytest.raises(ReceiveTimeout):
            await rx.receive(timeout=0.5)  # ...and not delivered a second time
        fresh = await tx.send(name, kv, medium="full", idempotency_key="job-8")
        assert (await rx.receive(timeout=5)).transfer_id == fresh.transfer_id
    finally:
        await other.close()
