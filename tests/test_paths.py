"""The data paths across OS processes: each delivers bit-exact, tokens keep strangers out, a
kill -9 on either side leaves no segment or socket behind, TLS works on ``tcp``.

Every transfer runs between two `tests/paths_peer.py` processes (a receiver and a sender); this
process relays the receiver's offer to the sender, as the `Open` / `OpenReply` on NATS would,
and plays the stranger in the token tests.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvbus.bus.paths.frames import FrameType, bind_payload, pack
from tests.peer import Peer

MB = 1 << 20


@pytest.fixture
async def peers(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Peer, Peer]]:
    """A receiver and a sender process with the paths (and extra arguments) the test names."""
    args = getattr(request, "param", ("--paths", "shm,tcp"))
    rx = await Peer.paths("rx", *args)
    tx = await Peer.paths("tx", *args)
    try:
        yield rx, tx
    finally:
        await tx.stop()
        await rx.stop()


async def offer(
    rx: Peer, tx: Peer, tid: str, total: int, chunk: int, peer_paths: list[str], subject: str = ""
) -> dict[str, Any]:
    await rx.send(
        cmd="expect", tid=tid, total=total, chunk=chunk, peer_paths=peer_paths, peer_host=tx.host, subject=subject
    )
    return await rx.wait("offer")


async def transfer(
    rx: Peer, tx: Peer, paths: list[str], *, total: int = 64 * MB, chunk: int = MB, subject: str = "", **send: Any
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    tid = uuid.uuid4().hex
    reply = await offer(rx, tx, tid, total, chunk, paths, subject)
    await tx.send(
        cmd="send",
        tid=tid,
        total=total,
        chunk=chunk,
        seed=7,
        offer=reply["offer"],
        paths=reply["paths"],
        subject=subject,
        **send,
    )
    sent = await tx.wait("sent", tid)
    done = await rx.wait("done", tid)
    return reply, sent, done


def tcp_connections(pid: int, port: int) -> int:
    """Established TCP sockets of process ``pid`` with ``port`` at either end."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                local, remote, state, inode = cols[1], cols[2], cols[3], cols[9]
                ports = {int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)}
                if state == "01" and inode in inodes and port in ports:
                    count += 1
    return count


def shm_files() -> set[str]:
    """kvbus's entries in /dev/shm (other programs on the machine come and go there)."""
    return {n for n in os.listdir("/dev/shm") if "kvbus" in n}


# -- bit-exact on every path ------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["shm", "tcp"])
async def test_a_direct_path_delivers_64mb_bit_exact_across_processes(peers: tuple[Peer, Peer], path: str) -> None:
    rx, tx = peers
    before = shm_files()
    reply, sent, done = await transfer(rx, tx, [path])
    assert reply["paths"] == [path] and sent["path"] == path and done["via"] == [path]
    assert done["digest"] == sent["digest"] and done["corrupt"] == 0
    # The connection is reused by the next transfer (one per peer pair).
    _, sent2, done2 = await transfer(rx, tx, [path], total=8 * MB)
    assert done2["digest"] == sent2["digest"]
    status = await tx.status()
    assert status[f"{path}_tx_connections"] == 1
    assert shm_files() == before  # memfd segments and abstract sockets: nothing in /dev/shm


async def test_the_fastest_path_both_allow_is_taken(peers: tuple[Peer, Peer]) -> None:
    rx, tx = peers
    reply, sent, done = await transfer(rx, tx, ["shm", "tcp"], total=4 * MB)
    assert reply["paths"] == ["shm", "tcp"] and sent["path"] == "shm" and done["digest"] == sent["digest"]
    # A sender on another host (another host identity) is offered tcp only.
    tid = uuid.uuid4().hex
    await rx.send(cmd="expect", tid=tid, total=MB, chunk=MB, peer_paths=["shm", "tcp"], peer_host="0" * 32)
    other = await rx.wait("offer")
    assert other["paths"] == ["tcp"] and other["offer"]["shm"] == "" and other["offer"]["tcp_port"]


async def test_the_nats_path_delivers_64mb_bit_exact_across_processes(nats_url: str) -> None:
    args = ("--paths", "nats", "--nats", nats_url)
    rx = await Peer.paths("rx", *args)
    tx = await Peer.paths("tx", *args)
    try:
        subject = f"kvbus.agent.rx.data.{uuid.uuid4().hex}"
        reply, sent, done = await transfer(rx, tx, ["nats"], chunk=4 * MB, subject=subject)
        assert reply["offer"] is None and reply["paths"] == ["nats"]
        assert sent["path"] == "nats" and done["digest"] == sent["digest"] and done["corrupt"] == 0
    finally:
        await tx.stop()
        await rx.stop()


@pytest.mark.parametrize("peers", [("--paths", "shm", "--private")], indirect=True)
async def test_shm_private_mode_copies_out_and_delivers_bit_exact(peers: tuple[Peer, Peer]) -> None:
    rx, tx = peers
    _, sent, done = await transfer(rx, tx, ["shm"], total=16 * MB)
    assert done["digest"] == sent["digest"]


# -- tokens -----------------------------------------------------------------------------------------


def stranger(port: int, frames: list[bytes], timeout: float = 5.0) -> bytes:
    """Connect to the data port, write ``frames``, return whatever the listener sends before it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            for f in frames:
                s.sendall(f)
        except OSError:
            return b""  # closed while we wrote
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        return got


def bind(token: str, tid: str, stream: int = 1) -> bytes:
    payload = bind_payload(token, tid)
    return pack(FrameType.BIND, stream, len(payload)) + payload


def data_frame(stream: int, index: int, data: bytes) -> bytes:
    import xxhash

    return pack(FrameType.DATA, stream, len(data), index=index, digest=xxhash.xxh3_64_intdigest(data)) + data


@pytest.mark.parametrize(
    "peers",
    [
        (
            "--paths",
            "tcp",
        )
    ],
    indirect=True,
)
async def test_a_wrong_or_replayed_token_gets_no_data_and_delivers_nothing(peers: tuple[Peer, Peer]) -> None:
    rx, tx = peers
    assert rx.tcp is not None
    port = rx.tcp[1]
    tid = uuid.uuid4().hex
    reply = await offer(rx, tx, tid, MB, MB, ["tcp"])
    token = reply["offer"]["token"]
    chunk = os.urandom(MB)
    wrong = ("1" if token[0] != "1" else "2") + token[1:]
    # Wrong token, data right behind it; DATA with no BIND at all; a token for another transfer.
    for frames in (
        [bind(wrong, tid), data_frame(1, 0, chunk)],
        [data_frame(1, 0, chunk)],
        [bind(token, uuid.uuid4().hex), data_frame(1, 0, chunk)],
    ):
        assert await asyncio.to_thread(stranger, port, frames) == b""  # closed, not one byte back
    # The stranger burnt nothing: the real sender still binds with the token and delivers.
    await tx.send(cmd="send", tid=tid, total=MB, chunk=MB, seed=3, offer=reply["offer"], paths=reply["paths"])
    sent = await tx.wait("sent", tid)
    done = await rx.wait("done", tid)
    assert done["digest"] == sent["digest"]
    # Replayed after use (transfer still offered, then after it ended): closed, nothing written.
    for _ in range(2):
        assert await asyncio.to_thread(stranger, port, [bind(token, tid), data_frame(1, 0, chunk)]) == b""
        await rx.send(cmd="withdraw", tid=tid)
    # Nothing arrived from the strangers: only the real transfer ever completed.
    assert [e for e in rx.events if "done" in e] == [done]
    assert not [e for e in rx.events if "progress" in e and e["progress"] != tid]
    # And a stranger that connects and says nothing is closed after the bind timeout.
    assert await asyncio.to_thread(stranger, port, [], 10.0) == b""
    assert (await rx.status())["tcp_rx_connections"] == 1  # the real sender's, kept for its next transfer


# -- kill -9 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["tcp", "shm"])
async def test_kill_9_of_the_sender_mid_transfer_leaves_nothing_at_the_receiver(
    peers: tuple[Peer, Peer], path: str
) -> None:
    rx, tx = peers
    before = shm_files()
    tid = uuid.uuid4().hex
    reply = await offer(rx, tx, tid, 64 * MB, MB, [path])
    await tx.send(
        cmd="send", tid=tid, total=64 * MB, chunk=MB, seed=1, offer=reply["offer"], paths=reply["paths"], stall_at=20
    )
    await tx.wait("stalled", tid)
    await rx.wait("progress", tid)
    mid = await rx.status()
    assert mid["memfd_maps"] >= (1 if path == "shm" else 0)
    if path == "tcp":
        assert rx.tcp is not None and tcp_connections(rx.pid, rx.tcp[1]) == 1
    tx.kill9()
    lost = await rx.wait("lost", tid)
    assert lost["path"] == path
    status = await rx.status()
    assert status["memfd_fds"] == 0 and status["memfd_maps"] == 0
    assert status["tcp_rx_connections"] == 0
    if path == "tcp":
        assert rx.tcp is not None and tcp_connections(rx.pid, rx.tcp[1]) == 0
    assert not [e for e in rx.events if e.get("done") == tid]  # never delivered
    assert shm_files() == before


@pytest.mark.parametrize("path", ["tcp", "shm"])
async def test_kill_9_of_the_receiver_mid_transfer_leaves_nothing_at_the_sender(
    peers: tuple[Peer, Peer], path: str
) -> None:
    rx, tx = peers
    before = shm_files()
    tid = uuid.uuid4().hex
    reply = await offer(rx, tx, tid, 64 * MB, MB, [path])
    await tx.send(
        cmd="send",
        tid=tid,
        total=64 * MB,
        chunk=MB,
        seed=2,
        offer=reply["offer"],
        paths=reply["paths"],
        pace_s=0.02,
        wait_lost=True,
    )
    await rx.wait("progress", tid)
    rx.kill9()
    event = await tx.wait("lost", tid)
    assert path in event["error"]
    status = await tx.status()
    assert status["memfd_fds"] == 0 and status["memfd_maps"] == 0  # the segment went with the session
    assert status[f"{path}_tx_connections"] == 0
    if path == "tcp":
        assert rx.tcp is not None and tcp_connections(tx.pid, rx.tcp[1]) == 0
    assert shm_files() == before


# -- TLS --------------------------------------------------------------------------------------------


def agent_pki(folder: Path) -> tuple[Path, Path, Path, Path]:
    """A CA, an agent certificate for 127.0.0.1 usable as server and client, and a foreign CA."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(name: str, key: Any, issuer: tuple[Any, Any] | None) -> Any:
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        signer, issuer_name = issuer or (key, subject)
        b = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
        )
        if issuer is not None:
            b = b.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
            )
            b = b.add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
        return b.sign(signer, hashes.SHA256())

    ca_key, other_key, agent_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = cert("kvbus-data-ca", ca_key, None)
    paths = (folder / "ca.pem", folder / "agent.pem", folder / "agent.key", folder / "other.pem")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert("kvbus-agent", agent_key, (ca_key, ca.subject)).public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        agent_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    paths[3].write_bytes(cert("kvbus-other-ca", other_key, None).public_bytes(serialization.Encoding.PEM))
    return paths


async def test_tls_on_the_tcp_path_delivers_and_refuses_what_it_should(tmp_path: Path) -> None:
    ca, agent, key, other = agent_pki(tmp_path)
    tls = ("--tls-ca", str(ca), "--tls-cert", str(agent), "--tls-key", str(key))
    rx = await Peer.paths("rx", "--paths", "tcp", *tls)
    tx = await Peer.paths("tx", "--paths", "tcp", *tls)
    plain = await Peer.paths("tx", "--paths", "tcp")
    foreign = await Peer.paths(
        "tx", "--paths", "tcp", "--tls-ca", str(other), "--tls-cert", str(agent), "--tls-key", str(key)
    )
    try:
        reply, sent, done = await transfer(rx, tx, ["tcp"], total=16 * MB)
        assert reply["offer"]["tls"] is True and done["digest"] == sent["digest"]
        # A sender without TLS does not even try a TLS listener; one that trusts another CA fails the handshake.
        for who in (plain, foreign):
            tid = uuid.uuid4().hex
            r = await offer(rx, who, tid, MB, MB, ["tcp"])
            await who.send(cmd="send", tid=tid, total=MB, chunk=MB, seed=1, offer=r["offer"], paths=r["paths"])
            assert "tcp" in (await who.wait("unavailable", tid))["error"]
        # A plain-TCP stranger is dropped in the handshake without a byte of ours.
        assert rx.tcp is not None
        assert await asyncio.to_thread(stranger, rx.tcp[1], [bind("0" * 64, "x")]) == b""
    finally:
        for p in (foreign, plain, tx, rx):
            await p.stop()
