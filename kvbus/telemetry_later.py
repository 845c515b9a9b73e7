"""Telemetry off a transfer's critical path: work done `later`, and spans made later (`LazySpan`).

A transfer's messages go out first; its spans and metrics are made once the event loop is free
(``loop.call_soon``: after the NATS client's flusher has written what this step published), all
that piled up meanwhile in one go. Nothing is lost: every timestamp is taken when the thing
happens, `drain` runs at exit and from `kvbus.telemetry.shutdown`.

A `LazySpan` stands for a span whose context nothing needs at once (no ``traceparent`` of it goes
on the wire): the real span is started `later` with the start time taken now, and what is done
to the proxy meanwhile (attributes, events, status, end) is replayed on it in order.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry.trace import INVALID_SPAN, INVALID_SPAN_CONTEXT, Span, SpanContext, Status, StatusCode
from opentelemetry.util import types

logger = logging.getLogger(__name__)

_PENDING: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
_SCHEDULED: list[asyncio.AbstractEventLoop | None] = [None]
"""The event loop a drain is scheduled on (None: none is)."""
_DRAINING = threading.RLock()


def later(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` once the running event loop is free, after what is already waiting
    (in order); without a running loop, at once."""
    _PENDING.append((fn, args))
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        drain()
        return
    if _SCHEDULED[0] is not loop:  # (a loop that closed before its drain ran does not hold it up)
        _SCHEDULED[0] = loop
        loop.call_soon(drain)


def drain() -> None:
    """Run everything `later` holds now (what it adds meanwhile too), in order."""
    with _DRAINING:
        _SCHEDULED[0] = None
        while _PENDING:
            fn, args = _PENDING.popleft()
            try:
                fn(*args)
            except Exception:
                logger.exception("telemetry callback %s failed", getattr(fn, "__qualname__", fn))


class LazySpan(Span):
    """A span started `later` by ``make(start_ns)``; calls on it meanwhile are replayed, in order.

    Its context is not known until then (`get_span_context` is invalid before): use it for spans
    no message carries, and as the parent of other lazy spans only (they are made after it).
    """

    def __init__(self, make: Callable[[int], Span]) -> None:
        self._real: Span = INVALID_SPAN
        later(self._make, make, time.time_ns())

    def _make(self, make: Callable[[int], Span], start_ns: int) -> None:
        self._real = make(start_ns)

    @property
    def real(self) -> Span:
        """The span itself (`INVALID_SPAN` until it is made)."""
        return self._real

    def _replay(self, method: str, *args: Any) -> None:
        later(self._apply, method, args)

    def _apply(self, method: str, args: tuple[Any, ...]) -> None:
        getattr(self._real, method)(*args)

    def end(self, end_time: int | None = None) -> None:
        """End it (at this time)."""
        self._replay("end", end_time if end_time is not None else time.time_ns())

    def get_span_context(self) -> SpanContext:
        """The real span's context (invalid before it is made)."""
        return self._real.get_span_context() if self._real is not INVALID_SPAN else INVALID_SPAN_CONTEXT

    def set_attributes(self, attributes: Mapping[str, types.AnyValue]) -> None:
        """Set attributes on it."""
        self._replay("set_attributes", dict(attributes))

    def set_attribute(self, key: str, value: types.AnyValue) -> None:
        """Set an attribute on it."""
        self._replay("set_attribute", key, value)

    def add_event(self, name: str, attributes: types.Attributes = None, timestamp: int | None = None) -> None:
        """Add an event (at this time)."""
        self._replay("add_event", name, attributes, timestamp if timestamp is not None else time.time_ns())

    def add_link(self, context: SpanContext, attributes: types.Attributes = None) -> None:
        """Add a link."""
        self._replay("add_link", context, attributes)

    def update_name(self, name: str) -> None:
        """Rename it."""
        self._replay("update_name", name)

    def is_recording(self) -> bool:
        """True until it is made (its sampling is decided then), then the real span's answer."""
        return self._real.is_recording() if self._real is not INVALID_SPAN else True

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        """Set its status."""
        self._replay("set_status", status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: types.Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        """Record an exception (at this time)."""
        self._replay(
            "record_exception", exception, attributes, timestamp if timestamp is not None else time.time_ns(), escaped
        )
