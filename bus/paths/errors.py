"""Errors of the data paths. A phase that can go on elsewhere raises a subclass that says so:
`PathUnavailable` before any byte moved (try the next path), `PathBroken` mid-transfer (resume
on another path from the last acknowledged chunk)."""

from __future__ import annotations

from kvbus.errors import KVBusError


class PathError(KVBusError):
    """Root of data-path errors; ``path`` names the path (``shm``, ``tcp``, ``nats``), ``peer`` the far end."""

    def __init__(self, path: str, message: str, *, peer: str = "") -> None:
        self.path = path
        self.peer = peer
        self.detail = message
        where = f" to {peer}" if peer else ""
        super().__init__(f"{path} path{where}: {message}")


class PathUnavailable(PathError):
    """The path cannot carry this transfer (not offered, unreachable, refused); nothing was sent on it."""


class TokenRefused(PathUnavailable):
    """The receiver refused the transfer token (unknown, wrong, already used or expired); ``code`` says which."""

    def __init__(self, path: str, code: str, *, peer: str = "") -> None:
        self.code = code
        super().__init__(path, f"the receiver refused the transfer token ({code})", peer=peer)


class PathBroken(PathError, ConnectionError):
    """The path failed while the transfer was using it (reset, closed, peer died); chunks not
    acknowledged may not have arrived."""


class PathProtocolError(PathError):
    """The far end sent something the path's framing does not allow; the connection is closed."""
