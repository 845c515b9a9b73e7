"""The kernel parts the testbed is built from, through iproute2 and iptables: namespaces, commands,
and what this machine can do (root, iproute2, netem, an NFQUEUE delay line)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

from kvbus.app.testbed.errors import CommandFailed, TestbedUnavailable

logger = logging.getLogger(__name__)

#: Every namespace the testbed makes starts with this, then the run id: ``kvb-<run>-<host>``.
PREFIX = "kvb-"


def run(argv: list[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run a command; raise `CommandFailed` (with its stderr) when it fails and ``check`` is set."""
    logger.debug("testbed: %s", " ".join(argv))
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError as exc:
        raise CommandFailed(argv, 127, str(exc)) from None
    except subprocess.TimeoutExpired:
        raise CommandFailed(argv, -1, f"timed out after {timeout} s") from None
    if check and proc.returncode != 0:
        raise CommandFailed(argv, proc.returncode, proc.stderr or proc.stdout)
    return proc


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip [-n ns] args...``."""
    return run(["ip", *(["-n", ns] if ns else []), *args], check=check)


def tc(*args: str, ns: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``tc -n ns args...``."""
    return run(["tc", "-n", ns, *args], check=check)


def exec_argv(ns: str, argv: list[str]) -> list[str]:
    """The command line that runs ``argv`` inside namespace ``ns``."""
    return ["ip", "netns", "exec", ns, *argv]


def in_ns(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` inside namespace ``ns`` and wait for it."""
    return run(exec_argv(ns, list(argv)), check=check)


def namespaces() -> list[str]:
    """Names of every network namespace ``ip netns`` knows."""
    proc = ip("netns", "list", check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def pids(ns: str) -> list[int]:
    """Processes whose network namespace is ``ns``."""
    proc = ip("netns", "pids", ns, check=False)
    return [int(x) for x in proc.stdout.split() if x.isdigit()]


_CLONE_NEWNET = 0x40000000


@contextlib.contextmanager
def entered(ns: str) -> Iterator[None]:
    """Run the calling thread in namespace ``ns`` until the block ends: the sockets it opens
    meanwhile live there, and so do the threads and processes it starts (`setns`, as
    ``ip netns exec`` does for a new process). Restored on the way out.

    Raises:
        OSError: the namespace does not exist or this process may not enter it (not root).
    """
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            _setns(target, f"network namespace {ns}")
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(home, "the original network namespace")
    finally:
        os.close(home)


def _setns(fd: int, what: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot enter {what}: {os.strerror(err)}")


def add(ns: str) -> None:
    """Create namespace ``ns`` with its loopback up."""
    ip("netns", "add", ns)
    ip("link", "set", "lo", "up", ns=ns)


def delete(ns: str) -> None:
    """Delete namespace ``ns`` (its interfaces go with it; the peers of its veths too)."""
    ip("netns", "delete", ns, check=False)


def iptables_binary() -> str | None:
    """The iptables that can send packets to NFQUEUE here (the legacy backend), if any."""
    for name in ("iptables-legacy", "iptables"):
        path = shutil.which(name)
        if not path:
            continue
        if name == "iptables":
            version = run([path, "--version"], check=False).stdout
            if "nf_tables" in version:
                continue  # the nft backend needs the kernel's nft queue, often not built
        return path
    return None


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What this machine can build."""

    root: bool
    iproute2: bool
    netns: bool
    htb: bool
    netem: bool
    nfqueue: bool
    """An NFQUEUE delay line works (iptables legacy backend, bridge netfilter, NFQUEUE target)."""
    reason: str = ""
    """Why the testbed is unavailable (empty when it is)."""

    @property
    def available(self) -> bool:
        """True when namespaces, veths, bridges and htb work."""
        return not self.reason

    @property
    def delay(self) -> str | None:
        """How delay, jitter and loss are made: ``netem``, ``nfqueue`` or None (only bandwidth)."""
        return "netem" if self.netem else "nfqueue" if self.nfqueue else None

    def as_dict(self) -> dict[str, object]:
        """For the benches' JSON."""
        return {
            "root": self.root,
            "iproute2": self.iproute2,
            "netns": self.netns,
            "htb": self.htb,
            "netem": self.netem,
            "nfqueue": self.nfqueue,
            "delay": self.delay,
            "reason": self.reason,
        }


@lru_cache(maxsize=1)
def capabilities() -> Capabilities:
    """Probe once (in a scratch namespace) what this machine can do."""
    root = os.geteuid() == 0
    iproute2 = bool(shutil.which("ip") and shutil.which("tc"))
    if not root:
        return Capabilities(
            False,
            iproute2,
            False,
            False,
            False,
            False,
            "it needs root (run as root, or in a container with CAP_NET_ADMIN and CAP_SYS_ADMIN)",
        )
    if not iproute2:
        return Capabilities(
            True, False, False, False, False, False, "iproute2 is not installed (apt-get install iproute2)"
        )
    probe = f"{PREFIX}probe{os.getpid()}"
    try:
        try:
            add(probe)
        except CommandFailed as exc:
            return Capabilities(True, True, False, False, False, False, f"cannot create a network namespace: {exc}")
        try:
            ip("link", "add", "pa", "type", "veth", "peer", "name", "pb", ns=probe)
            ip("link", "add", "br0", "type", "bridge", ns=probe)
            ip("link", "set", "pa", "master", "br0", ns=probe)
        except CommandFailed as exc:
            return Capabilities(True, True, True, False, False, False, f"veth or bridge devices do not work: {exc}")
        htb = tc("qdisc", "add", "dev", "pb", "root", "handle", "1:", "htb", ns=probe, check=False).returncode == 0
        if not htb:
            return Capabilities(
                True, True, True, False, False, False, "the kernel has no htb qdisc (CONFIG_NET_SCH_HTB)"
            )
        netem = tc("qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", ns=probe, check=False).returncode == 0
        nfqueue = False
        binary = iptables_binary()
        if binary:
            sysctl = in_ns(probe, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1", check=False)
            rule = in_ns(
                probe,
                binary,
                "-A",
                "FORWARD",
                "-m",
                "physdev",
                "--physdev-in",
                "pa",
                "-j",
                "NFQUEUE",
                "--queue-num",
                "7",
                "--queue-bypass",
                check=False,
            )
            nfqueue = sysctl.returncode == 0 and rule.returncode == 0
        return Capabilities(True, True, True, True, netem, nfqueue)
    finally:
        delete(probe)


def check(caps: Capabilities, *, delay: bool = False) -> Capabilities:
    """``caps``, or `TestbedUnavailable` saying what is missing and how to get it.

    Args:
        caps: what this machine can do.
        delay: the topology delays, jitters or drops packets, so netem or the NFQUEUE delay
            line must work too.
    """
    if not caps.available:
        raise TestbedUnavailable(caps.reason)
    if delay and caps.delay is None:
        raise TestbedUnavailable(
            "links that delay, jitter or drop packets need netem (CONFIG_NET_SCH_NETEM) or an NFQUEUE delay line "
            "(iptables, legacy backend)",
            "apt-get install iptables",
        )
    return caps


def require(*, delay: bool = False) -> Capabilities:
    """This machine's capabilities, or `TestbedUnavailable` saying what is missing (see `check`)."""
    return check(capabilities(), delay=delay)
