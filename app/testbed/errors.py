"""Errors of the network testbed (`kvbus testbed`)."""

from __future__ import annotations

from kvbus.errors import KVBusError


class TestbedError(KVBusError):
    """Root of the testbed's errors."""

    __test__ = False  # not a pytest test class, whatever its name


class TestbedUnavailable(TestbedError, RuntimeError):
    """This machine cannot build the testbed (not root, no iproute2, a kernel part missing).

    Attributes:
        reason: what is missing.
        hint: how to get it.
    """

    def __init__(self, reason: str, hint: str = "") -> None:
        self.reason = reason
        self.hint = hint
        super().__init__(f"the network testbed is not available here: {reason}" + (f" ({hint})" if hint else ""))


class TopologyError(TestbedError, ValueError):
    """A topology file is malformed or inconsistent.

    Attributes:
        source: the file (or ``<dict>``) it came from.
        reason: what was wrong, naming the field.
    """

    def __init__(self, source: str, reason: str) -> None:
        self.source = source
        self.reason = reason
        super().__init__(f"topology {source}: {reason}")


class CommandFailed(TestbedError, RuntimeError):
    """A command that builds or changes the testbed (``ip``, ``tc``, ``iptables``) failed.

    Attributes:
        argv: the command.
        returncode: its exit code.
        stderr: what it said.
    """

    def __init__(self, argv: list[str], returncode: int, stderr: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(f"`{' '.join(argv)}` failed ({returncode}): {stderr.strip()[:500]}")


class ProcessFailed(TestbedError, RuntimeError):
    """A process started on a testbed host exited or did not become ready.

    Attributes:
        host: the host it ran on.
        what: what it was (``nats-server``, ``worker`` ...).
        detail: the end of its log.
    """

    def __init__(self, host: str, what: str, detail: str) -> None:
        self.host = host
        self.what = what
        self.detail = detail
        super().__init__(f"{what} on host {host!r} failed: {detail.strip()[-1500:]}")
