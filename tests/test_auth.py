"""NATS token, nkey, .creds (JWT) and TLS (mutual TLS too) authentication from ``KVBUS_NATS_*``, against real servers.

Each server here is a real `nats-server` started with an ``authorization`` or ``tls`` block; the
certificates are made for the test (a throwaway CA, a server certificate for 127.0.0.1 and a
client certificate) with the ``cryptography`` package when it is installed, else the
``openssl`` command.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys
import pytest

from kvbus.app.local import NatsServer
from kvbus.bus import Bus
from kvbus.config import redact_url
from kvbus.errors import ConfigError, NatsConnectError
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig
from kvbus.net.auth import IDENTITY_OPTIONS, NatsAuth, check_connection, server_info
from tests.conftest import FAST
from tests.kvutil import kv_of_bytes
from tests.peer import SIG

#: Every connection attempt in a test is bounded: a hang fails instead of waiting for pytest's timeout.
BOUND = 15.0


# ---------------------------------------------------------------------------------------------
# Throwaway PKI: a CA, a server certificate for 127.0.0.1, a client certificate, a foreign CA
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    """A CA that signed nothing here: trusting only it must fail."""


def _have_cryptography() -> bool:
    try:
        import cryptography.x509  # noqa: F401
    except ImportError:
        return False
    return True


def make_pki(folder: Path, backend: str | None = None) -> Pki:
    """Certificates in ``folder``, made by ``backend`` ("cryptography" or "openssl"; default: the first available)."""
    backend = backend or ("cryptography" if _have_cryptography() else "openssl")
    folder.mkdir(parents=True, exist_ok=True)
    (_pki_cryptography if backend == "cryptography" else _pki_openssl)(folder)
    return Pki(*(folder / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key", "other.pem")))


def _pki_cryptography(d: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def usage(ca: bool) -> x509.KeyUsage:
        return x509.KeyUsage(
            digital_signature=not ca,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            key_cert_sign=ca,
            crl_sign=ca,
            encipher_only=False,
            decipher_only=False,
        )

    def issue(name: str, key: Any, issuer: tuple[Any, x509.Name] | None, extra: list[x509.ExtensionType]) -> Any:
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        signer, issuer_name = issuer if issuer else (key, subject)
        b = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
            .add_extension(usage(issuer is None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()), critical=False)
        )
        for ext in extra:
            b = b.add_extension(ext, critical=False)
        return b.sign(signer, hashes.SHA256())

    def write(name: str, cert: Any, key: Any | None = None) -> None:
        (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            (d / f"{name}.key").write_bytes(
                key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )

    import ipaddress

    ca_key, other_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(4))
    ca = issue("kvbus-test-ca", ca_key, None, [])
    write("ca", ca)
    write("other", issue("kvbus-other-ca", other_key, None, []))
    san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    write(
        "server",
        issue(
            "127.0.0.1",
            server_key,
            (ca_key, ca.subject),
            [san, x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH])],
        ),
        server_key,
    )
    write(
        "client",
        issue(
            "kvbus-test-client",
            client_key,
            (ca_key, ca.subject),
            [x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH])],
        ),
        client_key,
    )


def _pki_openssl(d: Path) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=30)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for name, cn in (("ca", "kvbus-test-ca"), ("other", "kvbus-other-ca")):
        run(
            "req",
            "-x509",
            *ec,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.pem",
            "-days",
            "1",
            "-subj",
            f"/CN={cn}",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        )
    common = (
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\nbasicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
    )
    (d / "server.ext").write_text(common + "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text(common + "extendedKeyUsage=clientAuth\n")
    for serial, (name, cn) in enumerate((("server", "127.0.0.1"), ("client", "kvbus-test-client")), start=2):
        run("req", "-new", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}")
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-set_serial",
            str(serial),
            "-out",
            f"{name}.pem",
            "-days",
            "1",
            "-extfile",
            f"{name}.ext",
        )


def tls_block(pki: Pki, *, verify: bool) -> str:
    """nats-server ``tls`` block: its certificate; with ``verify`` it requires client certificates from ``pki.ca``."""
    return (
        f'tls {{\n  cert_file: "{pki.server_cert}"\n  key_file: "{pki.server_key}"\n'
        f'  ca_file: "{pki.ca}"\n  verify: {"true" if verify else "false"}\n  timeout: 2\n}}\n'
    )


def new_seed() -> bytes:
    """A fresh nkey user seed (``SU...``)."""
    return bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))


def public_key(seed: bytes) -> str:
    return str(nkeys.from_seed(bytearray(seed)).public_key.decode())


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def issue_jwt(signer: Any, subject: str, name: str, claims: dict[str, Any]) -> str:
    """A NATS JWT (v2) for ``subject`` signed by the nkey pair ``signer`` (operator or account)."""
    body = {
        "jti": "",
        "iat": int(time.time()),
        "iss": signer.public_key.decode(),
        "name": name,
        "sub": subject,
        "nats": {**claims, "version": 2},
    }
    # A unique claim id (nats-server does not recompute it).
    body["jti"] = (
        base64.b32encode(hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()).decode().rstrip("=")
    )
    signed = (
        f"{_b64url(json.dumps({'typ': 'JWT', 'alg': 'ed25519-nkey'}).encode())}.{_b64url(json.dumps(body).encode())}"
    )
    return f"{signed}.{_b64url(signer.sign(signed.encode()))}"


def new_pair(prefix: int) -> tuple[bytes, Any]:
    seed = bytes(nkeys.encode_seed(os.urandom(32), prefix))
    return seed, nkeys.from_seed(bytearray(seed))


def operator_mode(folder: Path) -> tuple[str, Path, Path]:
    """nats-server configuration for operator (JWT) mode with one account allowed JetStream, a
    ``.creds`` file for a user of that account, and one for a user of an account the server does not know."""
    _, operator = new_pair(nkeys.PREFIX_BYTE_OPERATOR)
    (_, account), (_, system), (_, stranger) = (new_pair(nkeys.PREFIX_BYTE_ACCOUNT) for _ in range(3))
    unlimited = {
        k: -1
        for k in (
            "subs",
            "data",
            "payload",
            "imports",
            "exports",
            "conn",
            "leaf",
            "mem_storage",
            "disk_storage",
            "streams",
            "consumer",
        )
    }
    accounts = {
        account.public_key.decode(): issue_jwt(
            operator,
            account.public_key.decode(),
            "kvbus",
            {"type": "account", "limits": {**unlimited, "wildcards": True}},
        ),
        system.public_key.decode(): issue_jwt(operator, system.public_key.decode(), "SYS", {"type": "account"}),
    }

    def creds(name: str, issuer: Any) -> Path:
        seed, user = new_pair(nkeys.PREFIX_BYTE_USER)
        token = issue_jwt(
            issuer,
            user.public_key.decode(),
            name,
            {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1},
        )
        text = (
            f"-----BEGIN NATS USER JWT-----\n{token}\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n"
        )
        return write_secret(folder / f"{name}.creds", text.encode())

    preload = "".join(f'  {pub}: "{jwt}"\n' for pub, jwt in accounts.items())
    conf = (
        f'operator: "{issue_jwt(operator, operator.public_key.decode(), "kvbus-test-op", {"type": "operator"})}"\n'
        f"system_account: {system.public_key.decode()}\nresolver: MEMORY\nresolver_preload: {{\n{preload}}}\n"
    )
    return conf, creds("member", account), creds("stranger", stranger)


def write_secret(path: Path, data: bytes) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


# ---------------------------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------------------------

TOKEN = "tok-" + secrets.token_hex(16)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def token_server() -> Iterator[NatsServer]:
    server = NatsServer(extra_config=f'authorization {{\n  token: "{TOKEN}"\n}}\n').start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def nkey_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, Path]]:
    """A server that knows one nkey user, and the file holding that user's seed."""
    seed = new_seed()
    path = write_secret(tmp_path_factory.mktemp("nkey") / "user.nk", seed + b"\n")
    server = NatsServer(extra_config=f'authorization {{\n  users: [ {{ nkey: "{public_key(seed)}" }} ]\n}}\n').start()
    try:
        yield server, path
    finally:
        server.stop()


@pytest.fixture(scope="module")
def creds_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, Path, Path]]:
    """A server in operator (JWT) mode, a member's ``.creds`` and a stranger's (account unknown to it)."""
    conf, member, stranger = operator_mode(tmp_path_factory.mktemp("jwt"))
    server = NatsServer(extra_config=conf).start()
    try:
        yield server, member, stranger
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tls_server(pki: Pki) -> Iterator[NatsServer]:
    server = NatsServer(extra_config=tls_block(pki, verify=False)).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def mtls_server(pki: Pki) -> Iterator[NatsServer]:
    server = NatsServer(extra_config=tls_block(pki, verify=True)).start()
    try:
        yield server
    finally:
        server.stop()


async def transfer(url: str, options: dict[str, Any], group: str = "default") -> None:
    """A scheduler and two agents, all connected with ``options``; one 3 MB context goes from alice to bob."""
    await asyncio.wait_for(check_connection(url, options), BOUND)
    sched = await GroupScheduler.connect(url, group, config=SchedulerConfig(max_active=8), nats_options=options)
    buses: list[Bus] = []
    try:
        buses = [await Bus.connect(url, config=FAST, **options) for _ in range(2)]
        tx = await buses[0].agent("alice", group=group, signature=SIG)
        rx = await buses[1].agent("bob", group=group, signature=SIG)
        kv = kv_of_bytes(SIG, 3 << 20, seed=7)
        report = await asyncio.wait_for(tx.send("bob", kv, medium="full"), BOUND)
        got = await rx.receive(timeout=BOUND)
        assert got.transfer_id == report.transfer_id and got.kv.equal(kv)
    finally:
        for b in buses:
            await b.close()
        await sched.close()


async def refused(url: str, options: dict[str, Any]) -> NatsConnectError:
    """The error `check_connection` raises for ``options`` (it must raise, and not hang)."""
    with pytest.raises(NatsConnectError) as info:
        await asyncio.wait_for(check_connection(url, options), BOUND)
    return info.value


# ---------------------------------------------------------------------------------------------
# Configuration (no server)
# ---------------------------------------------------------------------------------------------


def test_from_env_reads_the_kvbus_nats_variables(tmp_path: Path) -> None:
    env = {
        "KVBUS_NATS_TOKEN": "t0k",
        "KVBUS_NATS_TLS_CA": "/etc/ca.pem",
        "KVBUS_NATS_TLS_HOSTNAME": "nats.example",
        "KVBUS_NATS_TLS_HANDSHAKE_FIRST": "yes",
        "KVBUS_NATS_INBOX_PREFIX": "_INBOX.sched-g0",
        "KVBUS_NATS_URL": "nats://elsewhere:4222",
    }
    auth = NatsAuth.from_env(env)
    assert (auth.token, auth.tls_ca, auth.tls_hostname, auth.tls_handshake_first, auth.inbox_prefix) == (
        "t0k",
        "/etc/ca.pem",
        "nats.example",
        True,
        "_INBOX.sched-g0",
    )
    assert auth.method == "token" and auth.tls
    assert NatsAuth(token="t0k", inbox_prefix="_INBOX.me").connect_options() == {
        "token": "t0k",
        "inbox_prefix": "_INBOX.me",
    }
    assert NatsAuth.from_env({}) == NatsAuth() and NatsAuth().connect_options() == {}
    assert NatsAuth.from_env({"KVBUS_NATS_USER": "u", "KVBUS_NATS_PASSWORD": "p"}).connect_options() == {
        "user": "u",
        "password": "p",
    }
    with pytest.raises(ConfigError, match="KVBUS_NATS_TLS_HANDSHAKE_FIRST='maybe' is not a valid bool"):
        NatsAuth.from_env({"KVBUS_NATS_TLS_HANDSHAKE_FIRST": "maybe"})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"password": TOKEN}, "KVBUS_NATS_PASSWORD is set but KVBUS_NATS_USER is not"),
        ({"user": "u"}, "KVBUS_NATS_USER is set but KVBUS_NATS_PASSWORD is not"),
        (
            {"token": TOKEN, "nkeys_seed": "/x"},
            "one NATS identity, not several: got KVBUS_NATS_TOKEN and KVBUS_NATS_NKEYS_SEED",
        ),
        ({"user": "u", "password": TOKEN, "creds": "/x"}, "got KVBUS_NATS_USER and KVBUS_NATS_CREDS"),
        ({"tls_cert": "/c.pem"}, "KVBUS_NATS_TLS_CERT is set but KVBUS_NATS_TLS_KEY is not"),
        ({"tls_key": "/c.key"}, "KVBUS_NATS_TLS_KEY is set but KVBUS_NATS_TLS_CERT is not"),
    ],
)
def test_inconsistent_settings_are_refused(fields: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        NatsAuth(**fields)
    assert TOKEN not in str(info.value)


def test_missing_and_malformed_files_are_refused(tmp_path: Path, pki: Pki) -> None:
    missing = str(tmp_path / "nope.pem")
    not_pem = tmp_path / "junk.pem"
    not_pem.write_text("not a certificate\n")
    cases: list[tuple[NatsAuth, str]] = [
        (NatsAuth(tls_ca=missing), "KVBUS_NATS_TLS_CA=.*nope.pem': no such file"),
        (NatsAuth(tls_ca=str(not_pem)), "KVBUS_NATS_TLS_CA=.*is not a PEM file of CA certificates"),
        (NatsAuth(tls_cert=str(pki.client_cert), tls_key=missing), "KVBUS_NATS_TLS_KEY=.*no such file"),
        # The client certificate with the server's key: not a pair.
        (
            NatsAuth(tls_cert=str(pki.client_cert), tls_key=str(pki.server_key)),
            "are not a PEM certificate and its private key",
        ),
        (NatsAuth(nkeys_seed=missing), "KVBUS_NATS_NKEYS_SEED=.*no such file"),
        (NatsAuth(nkeys_seed=str(write_secret(tmp_path / "a.nk", b"hello\n"))), "does not hold an nkey user seed"),
        (NatsAuth(creds=str(not_pem)), "is not a NATS .creds file"),
    ]
    short = new_seed()[:20]  # an 'SU' prefix, but too short to be a key
    cases.append((NatsAuth(nkeys_seed=str(write_secret(tmp_path / "b.nk", short))), "malformed nkey seed"))
    for auth, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            auth.connect_options()
        assert short.decode() not in str(info.value)


def test_repr_and_errors_never_show_secrets() -> None:
    for auth in (NatsAuth(user="kv", password="pw-" + TOKEN), NatsAuth(token=TOKEN)):
        assert TOKEN not in repr(auth) and TOKEN not in str(auth) and "***" in repr(auth)
    assert (
        repr(NatsAuth(user="kv", password="x", tls_ca="/ca.pem"))
        == "NatsAuth(user='kv', password=***, tls_ca='/ca.pem')"
    )
    assert redact_url(f"nats://{TOKEN}@127.0.0.1:4222") == "nats://***@127.0.0.1:4222"
    assert redact_url(f"nats://kv:{TOKEN}@127.0.0.1:4222") == "nats://kv:***@127.0.0.1:4222"


def test_explicit_role_options_take_precedence(pki: Pki) -> None:
    auth = NatsAuth(token=TOKEN, tls_ca=str(pki.ca), tls_hostname="localhost")
    mine = auth.connect_options()
    assert mine["token"] == TOKEN and mine["tls_hostname"] == "localhost" and mine["tls"] is not None
    role = {"user": "sched-g0", "password": "pw", "inbox_prefix": "_INBOX.sched-g0"}
    merged = auth.connect_options(role)
    # The role's identity replaces the environment's as a whole; TLS from the environment stays.
    assert IDENTITY_OPTIONS & merged.keys() == {"user", "password"}
    assert merged["user"] == "sched-g0" and merged["inbox_prefix"] == "_INBOX.sched-g0" and "tls" in merged
    assert auth.connect_options({"tls_hostname": "other"})["tls_hostname"] == "other"


# ---------------------------------------------------------------------------------------------
# Token
# ---------------------------------------------------------------------------------------------


async def test_token_transfer_completes_and_logs_no_token(
    token_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    auth = NatsAuth.from_env({"KVBUS_NATS_TOKEN": TOKEN})
    await transfer(token_server.url, auth.connect_options())
    # A wrong token inside the URL: refused, and the error shows the URL redacted.
    wrong = "wrong-" + secrets.token_hex(8)
    err = await refused(token_server.url.replace("nats://", f"nats://{wrong}@"), {})
    assert "nats://***@127.0.0.1" in str(err) and wrong not in str(err)
    logging.getLogger("kvbus.test").info("auth=%r error=%s", auth, err)
    assert caplog.records, "nothing was logged: the check below would be empty"
    assert TOKEN not in caplog.text and wrong not in caplog.text


@pytest.mark.parametrize("token", ["wrong-token", ""], ids=["wrong", "missing"])
async def test_wrong_or_missing_token_is_a_clear_error(token_server: NatsServer, token: str) -> None:
    err = await refused(token_server.url, NatsAuth(token=token).connect_options())
    assert not err.retryable
    assert "refused the credentials (Authorization Violation)" in str(err)
    assert "KVBUS_NATS_TOKEN" in str(err) and (not token or token not in str(err))


async def test_unreachable_server_is_retryable() -> None:
    from kvbus.app.processes import free_port

    err = await refused(f"nats://127.0.0.1:{free_port()}", NatsAuth(token=TOKEN).connect_options())
    assert err.retryable and TOKEN not in str(err)


async def test_user_password_and_inbox_prefix_run_a_scheduler_under_per_user_permissions() -> None:
    """KVBUS_NATS_USER/PASSWORD/INBOX_PREFIX are all a scheduler needs on a server with the
    per-user permissions of `kvbus.security` (as the Helm chart's pods get them)."""
    from kvbus.security import AgentGrant, permissions_config

    block, creds = permissions_config([AgentGrant("alice", "default"), AgentGrant("bob", "default")], ["default"])
    user, password = creds.schedulers["default"]
    env = {"KVBUS_NATS_USER": user, "KVBUS_NATS_PASSWORD": password, "KVBUS_NATS_INBOX_PREFIX": "_INBOX.sched-default"}
    with NatsServer(extra_config=block) as server:
        options = NatsAuth.from_env(env).connect_options()
        await asyncio.wait_for(check_connection(server.url, options), BOUND)
        sched = await GroupScheduler.connect(server.url, "default", nats_options=options)
        buses: list[Bus] = []
        try:
            buses = [
                await Bus.connect(server.url, config=FAST, secure=True, **creds.agent_options(a))
                for a in ("alice", "bob")
            ]
            tx = await buses[0].agent("alice", signature=SIG)
            rx = await buses[1].agent("bob", signature=SIG)
            kv = kv_of_bytes(SIG, 2 << 20, seed=5)
            await asyncio.wait_for(tx.send("bob", kv, medium="full"), BOUND)
            assert (await rx.receive(timeout=BOUND)).kv.equal(kv)
        finally:
            for b in buses:
                await b.close()
            await sched.close()


# ---------------------------------------------------------------------------------------------
# nkeys: a seed file, and a .creds file (user JWT and seed) for operator mode
# ---------------------------------------------------------------------------------------------


async def test_nkey_seed_file_transfer_completes(nkey_server: tuple[NatsServer, Path]) -> None:
    server, seed_file = nkey_server
    auth = NatsAuth.from_env({"KVBUS_NATS_NKEYS_SEED": str(seed_file)})
    assert auth.connect_options() == {"nkeys_seed": str(seed_file)}
    await transfer(server.url, auth.connect_options())


async def test_unknown_nkey_is_refused(nkey_server: tuple[NatsServer, Path], tmp_path: Path) -> None:
    server, _ = nkey_server
    stranger = write_secret(tmp_path / "stranger.nk", new_seed())
    err = await refused(server.url, NatsAuth(nkeys_seed=str(stranger)).connect_options())
    assert not err.retryable and "Authorization Violation" in str(err)
    assert stranger.read_text() not in str(err)


async def test_creds_file_transfer_completes(creds_server: tuple[NatsServer, Path, Path]) -> None:
    server, member, _ = creds_server
    auth = NatsAuth.from_env({"KVBUS_NATS_CREDS": str(member)})
    assert auth.connect_options() == {"user_credentials": str(member)}
    await transfer(server.url, auth.connect_options())


async def test_creds_of_an_unknown_account_are_refused(creds_server: tuple[NatsServer, Path, Path]) -> None:
    server, _, stranger = creds_server
    err = await refused(server.url, NatsAuth(creds=str(stranger)).connect_options())
    assert not err.retryable and "refused the credentials" in str(err)


# ---------------------------------------------------------------------------------------------
# TLS and mutual TLS
# ---------------------------------------------------------------------------------------------


async def test_tls_with_the_servers_ca_completes_a_transfer(tls_server: NatsServer, pki: Pki) -> None:
    await transfer(tls_server.url, NatsAuth.from_env({"KVBUS_NATS_TLS_CA": str(pki.ca)}).connect_options())


@pytest.mark.parametrize("which", ["other_ca", "system_cas", "wrong_hostname"])
async def test_untrusted_server_certificate_is_a_clear_error(tls_server: NatsServer, pki: Pki, which: str) -> None:
    auth = {
        "other_ca": NatsAuth(tls_ca=str(pki.other_ca)),
        "system_cas": NatsAuth(),
        "wrong_hostname": NatsAuth(tls_ca=str(pki.ca), tls_hostname="nats.example"),
    }[which]
    err = await refused(tls_server.url, auth.connect_options())
    assert not err.retryable
    assert "TLS certificate is not trusted" in str(err) and "KVBUS_NATS_TLS_CA" in str(err)
    if which == "wrong_hostname":
        assert "nats.example" in str(err)


async def test_mutual_tls_with_a_client_certificate_completes_a_transfer(mtls_server: NatsServer, pki: Pki) -> None:
    env = {
        "KVBUS_NATS_TLS_CA": str(pki.ca),
        "KVBUS_NATS_TLS_CERT": str(pki.client_cert),
        "KVBUS_NATS_TLS_KEY": str(pki.client_key),
    }
    await transfer(mtls_server.url, NatsAuth.from_env(env).connect_options())


async def test_mutual_tls_without_a_client_certificate_is_a_clear_error(mtls_server: NatsServer, pki: Pki) -> None:
    err = await refused(mtls_server.url, NatsAuth(tls_ca=str(pki.ca)).connect_options())
    assert not err.retryable and "KVBUS_NATS_TLS_CERT" in str(err)
    # What tells a dropped handshake from a dead server when the client sees only "connection lost".
    assert (await server_info(mtls_server.url, BOUND)).get("tls_verify") is True


@pytest.mark.parametrize("backend", ["cryptography", "openssl"])
async def test_either_certificate_generator_makes_a_working_pki(tmp_path: Path, backend: str) -> None:
    if backend == "cryptography" and not _have_cryptography():
        pytest.skip("cryptography is not installed")
    if backend == "openssl" and not shutil.which("openssl"):
        pytest.skip("no openssl command")
    made = make_pki(tmp_path / backend, backend)
    with NatsServer(extra_config=tls_block(made, verify=True)) as server:
        auth = NatsAuth(tls_ca=str(made.ca), tls_cert=str(made.client_cert), tls_key=str(made.client_key))
        await asyncio.wait_for(check_connection(server.url, auth.connect_options()), BOUND)


# ---------------------------------------------------------------------------------------------
# The command line: KVBUS_NATS_* reaches group-scheduler, coordinator, selftest and top
# ---------------------------------------------------------------------------------------------


def _cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBUS_NATS_") or k == "KVBUS_NATS_SERVER"}
    return {**env, **extra}


def _cli(*argv: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbus.app.cli", *argv], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_cli_commands_use_token_and_tls_from_the_environment(pki: Pki) -> None:
    server = NatsServer(extra_config=f'authorization {{\n  token: "{TOKEN}"\n}}\n' + tls_block(pki, verify=False))
    outputs: list[str] = []
    out = b""
    with server:
        url = server.url
        good = _cli_env(KVBUS_NATS_TOKEN=TOKEN, KVBUS_NATS_TLS_CA=str(pki.ca))
        sched = subprocess.Popen(
            [sys.executable, "-m", "kvbus.app.cli", "-vv", "group-scheduler", "--group", "cli", "--nats-url", url],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=good,
        )
        try:
            assert sched.stdout is not None
            deadline = time.monotonic() + 60
            while b"group scheduler for" not in out and time.monotonic() < deadline and sched.poll() is None:
                out += sched.stdout.readline()
            assert b"group scheduler for 'cli'" in out, out.decode(errors="replace")[-2000:]

            st = _cli("-vv", "selftest", "--nats-url", url, "--group", "cli", "--bytes", str(1 << 20), env=good)
            outputs += [st.stdout, st.stderr]
            assert st.returncode == 0 and "selftest OK" in st.stdout, st.stdout + st.stderr[-2000:]

            tp = _cli("top", "--nats-url", url, "--group", "cli", "--once", env=good)
            outputs += [tp.stdout, tp.stderr]
            assert tp.returncode == 0 and "group cli" in tp.stdout and "no state" not in tp.stdout, (
                tp.stdout + tp.stderr
            )

            # A wrong token: the command stops at once with one clear line, instead of retrying for ever.
            bad = _cli("coordinator", "--nats-url", url, env={**good, "KVBUS_NATS_TOKEN": "wrong-token"}, timeout=30)
            outputs += [bad.stdout, bad.stderr]
            assert bad.returncode == 2 and "kvbus coordinator: cannot connect to NATS" in bad.stderr, bad.stderr
            assert "refused the credentials" in bad.stderr and "Traceback" not in bad.stderr

            # No CA: the server's certificate is not trusted.
            no_ca = _cli("top", "--once", "--nats-url", url, env=_cli_env(KVBUS_NATS_TOKEN=TOKEN), timeout=30)
            outputs += [no_ca.stdout, no_ca.stderr]
            assert no_ca.returncode == 2 and "TLS certificate is not trusted" in no_ca.stderr, no_ca.stderr

            # An inconsistent setting: named, before any connection.
            half = _cli(
                "top",
                "--nats-url",
                url,
                "--once",
                env={**good, "KVBUS_NATS_TLS_CERT": str(pki.client_cert)},
                timeout=30,
            )
            outputs += [half.stdout, half.stderr]
            assert half.returncode == 2 and "KVBUS_NATS_TLS_KEY is not" in half.stderr, half.stderr
        finally:
            sched.terminate()
            try:
                rest, _ = sched.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                sched.kill()
                rest, _ = sched.communicate()
            outputs.append((out + (rest or b"")).decode(errors="replace"))
    text = "\n".join(outputs)
    assert "connecting to NATS at" in text  # -vv logged the connection settings...
    assert TOKEN not in text  # ...and never the token


def test_refused_login_is_retried_for_kvbus_nats_connect_wait() -> None:
    """A scheduler whose user the server does not know yet (its config reload lands later, as in
    the Helm chart when a group is added) keeps trying for KVBUS_NATS_CONNECT_WAIT seconds and
    serves once the server accepts it."""
    server = NatsServer(extra_config='authorization {\n  token: "old-token"\n}\n')
    with server:
        env = _cli_env(KVBUS_NATS_TOKEN="new-token", KVBUS_NATS_CONNECT_WAIT="60")
        sched = subprocess.Popen(
            [sys.executable, "-m", "kvbus.app.cli", "group-scheduler", "--group", "late", "--nats-url", server.url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        try:
            time.sleep(2.0)
            assert sched.poll() is None, "gave up before the wait was over"
            conf = server.workdir / "nats.conf"
            conf.write_text(conf.read_text().replace("old-token", "new-token"))
            assert server.pid is not None
            os.kill(server.pid, signal.SIGHUP)  # what the chart's reloader does: nats-server --signal reload
            assert sched.stdout is not None
            line = sched.stdout.readline()
            assert b"group scheduler for 'late'" in line, line
        finally:
            sched.kill()
            sched.wait()
    # Without the wait it stops at once.
    with NatsServer(extra_config='authorization {\n  token: "old-token"\n}\n') as server:
        bad = _cli(
            "group-scheduler",
            "--group",
            "late",
            "--nats-url",
            server.url,
            env=_cli_env(KVBUS_NATS_TOKEN="new-token"),
            timeout=30,
        )
        assert bad.returncode == 2 and "refused the credentials" in bad.stderr
