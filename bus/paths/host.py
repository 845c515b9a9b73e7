"""Host identity: whether two processes share a kernel (and so can share memory).

The identity hashes ``/etc/machine-id`` (may be the same in every container built from one
image) with the kernel's boot id (``/proc/sys/kernel/random/boot_id``, the same for every
process and container of one boot of one machine, different anywhere else). Equal identities
only make ``shm`` worth trying: the Unix socket connection itself proves the shared kernel.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket

MACHINE_ID = "/etc/machine-id"
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


#: Overrides the identity (e.g. a Kubernetes pod's uid: its containers share memory and the
#: abstract socket namespace, other pods on the node do not).
HOST_ID_ENV = "KVBUS_HOST_ID"


@functools.cache
def host_identity() -> str:
    """This host's identity: 32 lowercase hex characters (from ``KVBUS_HOST_ID`` when set)."""
    given = os.environ.get(HOST_ID_ENV, "").strip()
    if given:
        return hashlib.blake2b(given.encode(), digest_size=16).hexdigest()
    parts = [_read(MACHINE_ID), _read(BOOT_ID)]
    if not any(parts):
        parts = [socket.gethostname(), str(os.getpid())]  # nothing to compare with: unique to this process
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()
