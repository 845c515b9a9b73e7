"""`Agent.kv_buffer`: a context built in a shared segment goes on ``shm`` without a copy, and its
first send freezes it, so that nobody, the producer included, changes what a receiver verified.

Real nats-server, real scheduler, two buses of one process (the ``shm`` path between them).
"""

from __future__ import annotations

import fcntl
import gc
import os
import uuid

import pytest
import torch

from kvbus.app.models import random_model
from kvbus.bus import Bus
from kvbus.bus.kvbuffer import kv_buffer
from kvbus.codecs import get_codec
from kvbus.codecs.runner import HFRunner
from kvbus.errors import SignatureMismatch
from tests.kvutil import kv_of_bytes
from tests.peer import SIG

MB = 1 << 20


@pytest.fixture(scope="module")
def runner() -> HFRunner:
    """A random Llama of 8 KB of KV per token: 400 tokens make a context past the 2 MB inline limit."""
    return random_model(n_layers=4, n_kv_heads=4, head_dim=64, vocab_size=500, seed=11)


def mappings_of(fd: int) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of the file behind ``fd``."""
    st = os.fstat(fd)
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and int(parts[4]) == st.st_ino and "memfd:" in line:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    return out


def mappings_of_inode(inode: int) -> list[str]:
    """This process's mappings of the ``kv_buffer`` segment whose memfd has ``inode``."""
    with open("/proc/self/maps") as f:
        return [line for line in f if "memfd:kvbus-kv" in line and int(line.split()[4]) == inode]


def shared_readonly_mappings() -> int:
    """This process's read-only shared mappings of ``kv_buffer`` segments (only a receiver's
    verification makes those)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "memfd:kvbus-kv" in line and line.split()[1] == "r--s")


def filled(n_tokens: int, seed: int):
    """A kv_buffer holding a seeded context, and that context."""
    src = kv_of_bytes(SIG, 12 * MB, seed=seed).slice(0, n_tokens)
    kv = kv_buffer(SIG, src.n_tokens)
    kv.tokens.copy_(src.tokens)
    for dst, s in zip((*kv.keys, *kv.values), (*src.keys, *src.values)):
        dst.copy_(s)
    return kv, src.clone()


def test_a_kv_buffer_is_laid_out_as_the_full_payload() -> None:
    kv, src = filled(200, seed=3)
    assert kv.equal(src) and kv.segment is not None
    encoded = get_codec("full").encode(kv)
    base = kv.segment.address
    offset = 0
    for buf in encoded.buffers:  # every buffer of the payload lies at its offset, back to back
        assert torch.frombuffer(buf, dtype=torch.uint8).data_ptr() == base + offset
        offset += buf.nbytes
    assert offset == kv.segment.nbytes == get_codec("full").estimate_nbytes(SIG, 200)
    assert kv.slice(0, 10).segment is None and kv.clone().segment is None
    with pytest.raises(ValueError, match="at least one token"):
        kv_buffer(SIG, 0)


async def test_a_kv_buffer_goes_on_shm_without_a_copy_and_its_send_freezes_it(bus: Bus, sender_bus: Bus) -> None:
    rx = await bus.agent(f"kvbuf-rx-{uuid.uuid4().hex[:6]}", signature=SIG)
    tx = await sender_bus.agent(f"kvbuf-tx-{uuid.uuid4().hex[:6]}", signature=SIG)
    src = kv_of_bytes(SIG, 12 * MB, seed=5)
    kv = tx.kv_buffer(src.n_tokens)
    kv.tokens.copy_(src.tokens)
    for dst, s in zip((*kv.keys, *kv.values), (*src.keys, *src.values)):
        dst.copy_(s)
    seg = kv.segment
    report = await tx.send(rx.name, kv, medium="full")
    got = (await rx.receive(timeout=10)).kv
    assert report.path == "shm" and got.equal(src)
    # No copy: the receiver reads the producer's own segment (a staged payload would lie in
    # another one, from the pool), through a mapping of its own.
    theirs = [r for r in mappings_of(seg.fd) if not r[0] <= seg.address < r[1]]
    for t in (*got.keys, *got.values):
        assert any(lo <= t.data_ptr() < hi for lo, hi in theirs)
    # Frozen: sealed against every write, and the producer's writes stay in its own copy.
    assert fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE
    with pytest.raises(PermissionError):
        os.pwrite(seg.fd, b"x", 0)
    assert seg.untouched()
    kv.values[0].zero_()
    assert not seg.untouched()
    assert got.equal(src) and not torch.equal(kv.values[0], src.values[0])
    # Sent again after that write, it sends what the producer holds now (copied: the frozen
    # segment no longer is its payload), and the first delivery still does not change.
    await tx.send(rx.name, kv, medium="full")
    again = (await rx.receive(timeout=10)).kv
    assert again.equal(kv) and got.equal(src)


async def test_an_untouched_kv_buffer_is_shared_again_by_its_next_send(bus: Bus, sender_bus: Bus) -> None:
    rx = await bus.agent(f"kvbuf-rx2-{uuid.uuid4().hex[:6]}", signature=SIG)
    tx = await sender_bus.agent(f"kvbuf-tx2-{uuid.uuid4().hex[:6]}", signature=SIG)
    kv, src = filled(kv_of_bytes(SIG, 12 * MB, seed=9).n_tokens, seed=9)
    seg = kv.segment
    deliveries = []
    for _ in range(2):
        assert (await tx.send(rx.name, kv, medium="full")).path == "shm"
        deliveries.append((await rx.receive(timeout=10)).kv)
    theirs = [r for r in mappings_of(seg.fd) if not r[0] <= seg.address < r[1]]
    for got in deliveries:
        assert got.equal(src)
        assert any(lo <= got.keys[0].data_ptr() < hi for lo, hi in theirs)


def test_a_prefill_writes_into_a_kv_buffer_and_refuses_one_that_does_not_fit(runner: HFRunner) -> None:
    tokens = torch.randint(0, 500, (1, 40), generator=torch.Generator().manual_seed(1))
    out = kv_buffer(runner.signature, 40)
    got = runner.prefill(tokens, out=out)
    assert got is out and out.segment is not None
    assert got.equal(runner.prefill(tokens))
    for misfit in (
        kv_buffer(runner.signature, 41),  # another length
        kv_buffer(runner.signature, 40, batch=2),  # another batch
        kv_buffer(SIG, 40),  # another model
    ):
        with pytest.raises(SignatureMismatch):
            runner.prefill(tokens, out=misfit)


async def test_a_prefill_into_an_agents_kv_buffer_goes_on_shm_without_a_copy(
    bus: Bus, sender_bus: Bus, runner: HFRunner
) -> None:
    sig = runner.signature
    rx = await bus.agent(f"kvbuf-rx3-{uuid.uuid4().hex[:6]}", signature=sig)
    tx = await sender_bus.agent(f"kvbuf-tx3-{uuid.uuid4().hex[:6]}", signature=sig)
    tokens = torch.randint(0, 500, (1, 400), generator=torch.Generator().manual_seed(2))
    kv = runner.prefill(tokens, out=tx.kv_buffer(400))
    assert kv.nbytes > 2 * MB  # past the inline limit: it goes on a data path
    seg = kv.segment
    report = await tx.send(rx.name, kv, medium="full")
    got = (await rx.receive(timeout=10)).kv
    assert report.path == "shm" and got.equal(runner.prefill(tokens))
    theirs = [r for r in mappings_of(seg.fd) if not r[0] <= seg.address < r[1]]
    assert all(any(lo <= t.data_ptr() < hi for lo, hi in theirs) for t in (*got.keys, *got.values))


async def test_a_receiver_keeps_no_mapping_of_a_frozen_segment_after_the_transfer(bus: Bus, sender_bus: Bus) -> None:
    """The receiver's cache of mappings (kept so that a pooled segment, reused by its sender, is
    verified through filled page tables) must not keep a frozen one: nobody reuses it, and the
    mapping would hold its memory after the sender and the delivery let go (the engines of
    `bench agents` grew by a GB each until the machine ran out)."""
    rx = await bus.agent(f"kvbuf-rx4-{uuid.uuid4().hex[:6]}", signature=SIG)
    tx = await sender_bus.agent(f"kvbuf-tx4-{uuid.uuid4().hex[:6]}", signature=SIG)
    before = shared_readonly_mappings()
    for seed in range(4):
        kv, src = filled(kv_of_bytes(SIG, 6 * MB, seed=seed).n_tokens, seed=seed)
        assert (await tx.send(rx.name, kv, medium="full")).path == "shm"
        got = (await rx.receive(timeout=10)).kv
        assert got.equal(src)
        del kv, got
        gc.collect()
    assert shared_readonly_mappings() == before


async def test_a_transfer_is_not_kept_alive_by_its_shm_session_after_it_ended(bus: Bus, sender_bus: Bus) -> None:
    """A shm session stays registered until its receiver let go of the segment, which a receiver
    keeping the context as its delta base does only at the sender's next transfer to it. The
    session's callbacks held the whole transfer meanwhile (its payload, its context: a
    `kv_buffer` of 100 MB a hand-off in `bench agents`, whose engines grew until the machine ran
    out of memory)."""
    from kvbus.bus.outgoing import OutgoingTransfer

    rx = await bus.agent(f"kvbuf-rx5-{uuid.uuid4().hex[:6]}", signature=SIG)
    tx = await sender_bus.agent(f"kvbuf-tx5-{uuid.uuid4().hex[:6]}", signature=SIG)
    held = []
    for seed, medium in ((1, "full"), (2, "int8")):
        kv, _ = filled(kv_of_bytes(SIG, 6 * MB, seed=seed).n_tokens, seed=seed)
        inode = os.fstat(kv.segment.fd).st_ino
        assert (await tx.send(rx.name, kv, medium=medium)).path == "shm"
        held.append((await rx.receive(timeout=10)).kv)  # the application keeps what it got
        del kv
    gc.collect()
    assert [o for o in gc.get_objects() if type(o) is OutgoingTransfer] == []
    # The int8 payload was encoded elsewhere: nothing maps the cache's segment any more, not
    # even the token ids the sender keeps as the receiver's delta base (a copy, not a view of it).
    assert [r for r in mappings_of_inode(inode)] == []
