"""NATS server lists: every kvbus process may be given all the servers of a cluster.

A server list is a comma-separated string (``nats://a:4222,nats://b:4222``, what ``--nats-url``
and ``KVBUS_NATS_URL`` take) or a sequence of URLs. The client connects to one of them and, when
that server dies, reconnects to a survivor (nats-py also learns the cluster's other servers from
the server's INFO). By default the list is shuffled (clients spread over the servers); a process
that prefers a server (a group scheduler pinned near its agents) lists it first and connects with
``dont_randomize`` (``KVBUS_NATS_PIN=1``).

Failure detection: a dead server closes its sockets and the client notices at once; a stopped or
partitioned one does not, so a client given several servers pings every
``KVBUS_NATS_PING_INTERVAL`` seconds (default 2) and gives up on its server after
``KVBUS_NATS_MAX_PINGS_OUT`` unanswered pings (default 3). A client given one server keeps
nats-py's slower defaults (a ping every 2 minutes) unless those variables are set.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from kvbus.errors import ConfigError

__all__ = ["reconnect_options", "server_urls"]


def server_urls(url: str | Sequence[str]) -> list[str]:
    """The servers in ``url``: a comma-separated string or a sequence of URLs, blanks dropped.

    Raises:
        ConfigError: no server at all.
    """
    parts = url.split(",") if isinstance(url, str) else [p for u in url for p in str(u).split(",")]
    servers = [p.strip() for p in parts if p.strip()]
    if not servers:
        raise ConfigError("no NATS server URL given")
    return servers


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise ConfigError(f"{name}={raw!r} must be positive")
    return value


def reconnect_options(servers: Sequence[str]) -> dict[str, Any]:
    """`nats.connect` options for failing over between ``servers``: reconnect for ever, ping often
    enough to notice a stopped server, keep the given order when ``KVBUS_NATS_PIN`` is set."""
    opts: dict[str, Any] = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.5}
    several = len(servers) > 1
    if several or os.environ.get("KVBUS_NATS_PING_INTERVAL"):
        opts["ping_interval"] = _env_float("KVBUS_NATS_PING_INTERVAL", 2.0)
    if several or os.environ.get("KVBUS_NATS_MAX_PINGS_OUT"):
        opts["max_outstanding_pings"] = int(_env_float("KVBUS_NATS_MAX_PINGS_OUT", 3))
    if several:
        opts["connect_timeout"] = 2
    if several and os.environ.get("KVBUS_NATS_PIN", "").lower() in ("1", "true", "yes"):
        opts["dont_randomize"] = True
    return opts
