"""How kvbus authenticates to NATS and encrypts the connection, from ``KVBUS_NATS_*`` variables.

`NatsAuth` holds one client identity (user and password, a token, an nkey seed file or a
``.creds`` file) and the TLS settings, and turns them into `nats.connect` keyword options:

    auth = NatsAuth.from_env()            # KVBUS_NATS_TOKEN, KVBUS_NATS_TLS_CA, ...
    bus = await Bus.connect(url, **auth.connect_options())

============================  ==================================================================
variable                      meaning
============================  ==================================================================
KVBUS_NATS_USER               user name (with KVBUS_NATS_PASSWORD)
KVBUS_NATS_PASSWORD           that user's password
KVBUS_NATS_TOKEN              an authorization token
KVBUS_NATS_NKEYS_SEED         path of a file holding an nkey user seed (``SU...``)
KVBUS_NATS_CREDS              path of a ``.creds`` file (user JWT and nkey seed, decentralized auth)
KVBUS_NATS_TLS_CA             PEM file of the CA(s) that signed the server's certificate
                              (default: the system's trusted CAs)
KVBUS_NATS_TLS_CERT           client certificate (PEM) for mutual TLS, with KVBUS_NATS_TLS_KEY
KVBUS_NATS_TLS_KEY            that certificate's private key (PEM)
KVBUS_NATS_TLS_HOSTNAME       name to check the server's certificate against, when it differs
                              from the host in the URL
KVBUS_NATS_TLS_HANDSHAKE_FIRST  ``true``: start TLS before the server's INFO (servers configured
                              with ``handshake_first``)
KVBUS_NATS_INBOX_PREFIX       prefix of the client's reply subjects, for per-user permissions that
                              allow one inbox per user (``_INBOX.sched-g0``)
============================  ==================================================================

Credentials in the URL (``nats://user:password@host``, ``nats://token@host``) still work as
nats.py reads them; options from this class take precedence over them. TLS is used when the
server requires it (its ``tls`` block); the settings here say which certificates to trust and
which to present. `repr` and every error message leave passwords, tokens and seeds out.

`check_connection` connects once without retrying, so that a refused credential or an untrusted
certificate is reported at once instead of being retried for ever by a long-lived client.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats

from kvbus.config import from_env, redact_url
from kvbus.errors import ConfigError, NatsConnectError
from kvbus.net.servers import server_urls

#: ``KVBUS_NATS_<FIELD>`` variables.
ENV_SECTION = "NATS"
#: Seconds `check_connection` waits for the server.
CHECK_TIMEOUT = 5.0

#: `nats.connect` options that carry a client identity. Per-role options that set any of them
#: (`kvbus.security.Credentials`) replace the identity from the environment as a whole.
IDENTITY_OPTIONS = frozenset(
    {"user", "password", "token", "nkeys_seed", "nkeys_seed_str", "user_credentials", "signature_cb", "user_jwt_cb"}
)
#: Fields never shown by `repr`.
SECRET_FIELDS = frozenset({"password", "token"})

_AUTH_HINT = (
    "check KVBUS_NATS_USER/KVBUS_NATS_PASSWORD, KVBUS_NATS_TOKEN, KVBUS_NATS_NKEYS_SEED or "
    "KVBUS_NATS_CREDS (or the credentials in the URL) against the server's authorization block"
)
_VERIFY_HINT = (
    "set KVBUS_NATS_TLS_CA to the CA that signed the server's certificate "
    "(and KVBUS_NATS_TLS_HOSTNAME if the certificate names another host than the URL)"
)
_HANDSHAKE_HINT = (
    "if the server verifies clients (mutual TLS), set KVBUS_NATS_TLS_CERT and KVBUS_NATS_TLS_KEY "
    "to a certificate signed by a CA it trusts"
)


def _var(name: str) -> str:
    return f"KVBUS_{ENV_SECTION}_{name.upper()}"


@dataclass(frozen=True, slots=True)
class NatsAuth:
    """One NATS client identity and the TLS settings, validated when built.

    Raises:
        ConfigError: more than one identity is set, a password without its user (or the
            reverse), or a client certificate without its key (or the reverse).
    """

    user: str = ""
    """User name; needs `password`."""
    password: str = ""
    """The user's password. Never shown by `repr`."""
    token: str = ""
    """Authorization token (the server's ``authorization { token: ... }``). Never shown by `repr`."""
    nkeys_seed: str = ""
    """Path of a file holding an nkey user seed (``SU...``); the server lists the public key (``U...``)."""
    creds: str = ""
    """Path of a ``.creds`` file (user JWT and nkey seed) for operator/account (JWT) authentication."""
    tls_ca: str = ""
    """PEM file of the CAs that may sign the server's certificate; empty: the system's trusted CAs."""
    tls_cert: str = ""
    """Client certificate (PEM) presented for mutual TLS; needs `tls_key`."""
    tls_key: str = ""
    """Private key (PEM) of `tls_cert`."""
    tls_hostname: str = ""
    """Name the server's certificate must carry, when it is not the host in the URL."""
    tls_handshake_first: bool = False
    """Start TLS before the server's INFO (for servers configured with ``handshake_first``)."""
    inbox_prefix: str = ""
    """Prefix of this client's reply subjects (e.g. ``_INBOX.sched-g0``), for servers whose per-user
    permissions let each user subscribe to its own inbox only (`kvbus.security`); empty: nats.py's ``_INBOX``."""

    def __post_init__(self) -> None:
        if self.password and not self.user:
            raise ConfigError(f"{_var('password')} is set but {_var('user')} is not: a password needs its user")
        if self.user and not self.password:
            raise ConfigError(f"{_var('user')} is set but {_var('password')} is not: a user needs its password")
        chosen = [
            name
            for name, on in (
                ("user", self.user),
                ("token", self.token),
                ("nkeys_seed", self.nkeys_seed),
                ("creds", self.creds),
            )
            if on
        ]
        if len(chosen) > 1:
            raise ConfigError("set one NATS identity, not several: got " + " and ".join(_var(n) for n in chosen))
        if self.tls_cert and not self.tls_key:
            raise ConfigError(
                f"{_var('tls_cert')} is set but {_var('tls_key')} is not: mutual TLS needs the "
                "client certificate and its private key"
            )
        if self.tls_key and not self.tls_cert:
            raise ConfigError(
                f"{_var('tls_key')} is set but {_var('tls_cert')} is not: mutual TLS needs the "
                "client certificate and its private key"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> NatsAuth:
        """Defaults, then ``KVBUS_NATS_*`` variables, then ``overrides``.

        Raises:
            ConfigError: as for the constructor, or a variable does not parse.
        """
        return from_env(cls, ENV_SECTION, dict(environ) if environ is not None else None, **overrides)

    @property
    def method(self) -> str:
        """Which identity is configured: ``user``, ``token``, ``nkey``, ``creds`` or ``none``."""
        if self.user:
            return "user"
        if self.token:
            return "token"
        if self.nkeys_seed:
            return "nkey"
        if self.creds:
            return "creds"
        return "none"

    @property
    def tls(self) -> bool:
        """True when a CA, a client certificate or a TLS option is configured."""
        return bool(self.tls_ca or self.tls_cert or self.tls_hostname or self.tls_handshake_first)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client's TLS context (server verification, and its certificate for mutual TLS).

        None when neither a CA nor a client certificate is configured: nats.py then verifies a
        server that requires TLS against the system's trusted CAs.

        Raises:
            ConfigError: a file is missing, unreadable or not what it should be.
        """
        if not (self.tls_ca or self.tls_cert):
            return None
        ca = _readable_file(self.tls_ca, "tls_ca") if self.tls_ca else None
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"{_var('tls_ca')}={self.tls_ca!r} is not a PEM file of CA certificates ({_ssl_reason(exc)})"
            ) from None
        if self.tls_cert:
            cert = _readable_file(self.tls_cert, "tls_cert")
            key = _readable_file(self.tls_key, "tls_key")
            try:
                ctx.load_cert_chain(cert, key)
            except (ssl.SSLError, OSError) as exc:
                raise ConfigError(
                    f"{_var('tls_cert')}={self.tls_cert!r} and {_var('tls_key')}={self.tls_key!r} "
                    f"are not a PEM certificate and its private key ({_ssl_reason(exc)})"
                ) from None
        return ctx

    def connect_options(self, role_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """`nats.connect` keyword options for this identity and TLS, under ``role_options``.

        Args:
            role_options: explicit options for one role (e.g. the user and password that
                ``kvbus up --secure`` generated for a scheduler). They win: if they carry an
                identity (`IDENTITY_OPTIONS`), the identity configured here is left out; the TLS
                settings here still apply unless they set TLS options themselves.

        Raises:
            ConfigError: a configured file is missing, unreadable or malformed, or nkey
                authentication is asked for without the ``nkeys`` package.
        """
        role = dict(role_options or {})
        opts: dict[str, Any] = {}
        ctx = self.ssl_context()
        if ctx is not None:
            opts["tls"] = ctx
        if self.tls_hostname:
            opts["tls_hostname"] = self.tls_hostname
        if self.tls_handshake_first:
            opts["tls_handshake_first"] = True
        if self.inbox_prefix:
            opts["inbox_prefix"] = self.inbox_prefix
        if not IDENTITY_OPTIONS & role.keys():
            opts.update(self._identity_options())
        opts.update(role)
        return opts

    def _identity_options(self) -> dict[str, Any]:
        if self.user:
            return {"user": self.user, "password": self.password}
        if self.token:
            return {"token": self.token}
        if self.nkeys_seed:
            return {"nkeys_seed": _check_seed_file(self.nkeys_seed)}
        if self.creds:
            return {"user_credentials": _check_creds_file(self.creds)}
        return {}

    def __repr__(self) -> str:
        # Only the fields that are set; secrets as *** (logs, tracebacks, debuggers).
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value:
                shown.append(f"{f.name}=***" if f.name in SECRET_FIELDS else f"{f.name}={value!r}")
        return f"NatsAuth({', '.join(shown)})"


async def check_connection(
    url: str, options: Mapping[str, Any] | None = None, *, timeout: float = CHECK_TIMEOUT
) -> None:
    """Connect to ``url`` with ``options`` and disconnect, without the long-lived clients' retries.

    Long-lived kvbus clients reconnect for ever, so a refused credential would make them retry
    silently; call this first to turn it into an error a person can act on.

    Raises:
        NatsConnectError: the server refused the credentials or the TLS handshake failed
            (``retryable`` False), or it did not answer (``retryable`` True).
    """
    seen: list[Exception] = []

    async def record(exc: Exception) -> None:
        # Kept to explain a failure below (nats.py's default callback would log a traceback).
        seen.append(exc)

    # max_reconnect_attempts=0 would mean "retry for ever" to nats.py's server selection; 1 with a
    # short wait tries each server twice, then gives up with NoServersError.
    opts = {
        **(options or {}),
        "allow_reconnect": False,
        "max_reconnect_attempts": 1,
        "reconnect_time_wait": 0.05,
        "connect_timeout": timeout,
        "error_cb": record,
    }
    try:
        nc = await asyncio.wait_for(nats.connect(server_urls(url), **opts), 3 * timeout)
    except Exception as exc:  # noqa: BLE001 - every failure is explained below
        cause = seen[-1] if isinstance(exc, nats.errors.NoServersError) and seen else exc
        error = explain_connect_error(url, cause)
        if error.retryable and (await server_info(url, timeout)).get("tls_verify"):
            # A server that verifies client certificates drops the connection in the handshake,
            # which the client sees as a plain "connection lost".
            error = NatsConnectError(
                error.url,
                "the server closed the connection in the TLS handshake and it verifies client certificates",
                _HANDSHAKE_HINT,
                retryable=False,
            )
        raise error from None
    await nc.close()


async def server_info(url: str, timeout: float) -> dict[str, Any]:
    """The INFO that the (first) server in ``url`` sends in clear text on connect; {} if none.

    It says what the server requires (``auth_required``, ``tls_required``, ``tls_verify``) without
    authenticating, which explains failures the client only sees as a dropped connection.
    """
    parts = urlsplit(url.split(",")[0].strip())
    if parts.scheme not in ("nats", "tls") or not parts.hostname:
        return {}
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, parts.port or 4222), timeout)
        try:
            line = await asyncio.wait_for(reader.readline(), timeout)
        finally:
            writer.close()
        return dict(json.loads(line[5:])) if line.startswith(b"INFO ") else {}
    except (OSError, TimeoutError, ValueError):
        return {}


def explain_connect_error(url: str, exc: BaseException) -> NatsConnectError:
    """A `NatsConnectError` saying what ``exc`` (raised by `nats.connect`) means and what to check."""
    where = redact_url(url)
    text = str(exc)
    if isinstance(exc, nats.errors.Error) and ("authorization" in text.lower() or "authentication" in text.lower()):
        detail = text.removeprefix("nats: ").strip("'")
        reason = f"the server refused the credentials ({detail})"
        return NatsConnectError(where, reason, _AUTH_HINT, retryable=False)
    if isinstance(exc, ssl.SSLCertVerificationError):
        reason = f"the server's TLS certificate is not trusted ({exc.verify_message or _ssl_reason(exc)})"
        return NatsConnectError(where, reason, _VERIFY_HINT, retryable=False)
    if isinstance(exc, ssl.SSLError):
        return NatsConnectError(
            where, f"the TLS handshake failed ({_ssl_reason(exc)})", _HANDSHAKE_HINT, retryable=False
        )
    reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return NatsConnectError(where, reason, "is a NATS server running at this address, and reachable?", retryable=True)


def _ssl_reason(exc: BaseException) -> str:
    return str(getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc)


def _readable_file(path: str, field_name: str) -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{_var(field_name)}={path!r}: no such file")
    try:
        with p.open("rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"{_var(field_name)}={path!r} cannot be read ({exc.strerror})") from None
    return str(p)


def _check_seed_file(path: str) -> str:
    """``path`` once it holds a valid nkey user seed; the seed itself is never shown."""
    p = _readable_file(path, "nkeys_seed")
    try:
        import nkeys
    except ImportError:
        raise ConfigError(f"{_var('nkeys_seed')} needs the nkeys package: pip install nkeys") from None
    seed = bytearray(Path(p).read_bytes().strip())
    try:
        if not seed.startswith(b"SU"):
            raise ConfigError(
                f"{_var('nkeys_seed')}={path!r} does not hold an nkey user seed "
                "(one line starting with 'SU', as `nk -gen user` writes)"
            )
        try:
            nkeys.from_seed(seed).wipe()
        except (nkeys.NkeysError, ValueError):
            raise ConfigError(
                f"{_var('nkeys_seed')}={path!r} holds a malformed nkey seed (bad encoding or length)"
            ) from None
    finally:
        seed[:] = bytes(len(seed))
    return p


def _check_creds_file(path: str) -> str:
    """``path`` once it looks like a NATS ``.creds`` file (a user JWT and an nkey seed)."""
    p = _readable_file(path, "creds")
    try:
        import nkeys  # noqa: F401 - nats.py signs with it
    except ImportError:
        raise ConfigError(f"{_var('creds')} needs the nkeys package: pip install nkeys") from None
    text = Path(p).read_text(errors="replace")
    if "BEGIN NATS USER JWT" not in text or "BEGIN USER NKEY SEED" not in text:
        raise ConfigError(
            f"{_var('creds')}={path!r} is not a NATS .creds file "
            "(expected a 'BEGIN NATS USER JWT' and a 'BEGIN USER NKEY SEED' block)"
        )
    return p
