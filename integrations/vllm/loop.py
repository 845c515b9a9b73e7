"""An asyncio event loop in a background thread, for code called synchronously (vLLM's hooks).

vLLM calls a connector from its scheduler and model-runner threads and expects the calls to
return; kvbus is asyncio. `LoopThread` runs one loop per process in a daemon thread: `run`
blocks the caller until a coroutine finishes there (with a timeout), `submit` returns a
`concurrent.futures.Future` at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class LoopThread:
    """An event loop running in a daemon thread until `stop`."""

    def __init__(self, name: str = "kvbus-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._started = threading.Event()
        self._thread.start()
        self._started.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            try:
                pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
                for task in pending:
                    task.cancel()
                if pending:
                    self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            finally:
                self.loop.close()

    @property
    def alive(self) -> bool:
        """Whether the thread runs and the loop is open (so `submit` and `run` accept work)."""
        return self._thread.is_alive() and not self.loop.is_closed()

    def in_loop(self) -> bool:
        """Whether the caller runs on this loop's thread (where `run` would deadlock)."""
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; its result arrives in the returned future."""
        if not self.alive:
            coro.close()
            raise RuntimeError("the kvbus event loop is not running")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result.

        Raises:
            TimeoutError: it did not finish within ``timeout`` seconds (it is cancelled).
            RuntimeError: called from the loop's own thread.
        """
        if self.in_loop():
            coro.close()
            raise RuntimeError("LoopThread.run called from its own loop")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"kvbus call did not finish within {timeout} s") from None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop (cancelling what still runs) and join the thread."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
