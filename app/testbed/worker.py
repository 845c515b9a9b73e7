"""Worker processes: a bench runs its roles (senders, receivers, agents with models) as separate
processes, on testbed hosts or locally, and drives them by JSON lines over their stdin / stdout.

Protocol (one JSON object per line)::

    -> {"id": 1, "op": "kvbus.app.bench.sched:rx_drain", "args": {...}}
    <- {"id": 1, "ok": true, "result": ...}        or {"id": 1, "ok": false, "error": "..."}
    -> {"cancel": 1}                               cancels a running operation

An operation is ``async def op(ctx: WorkerContext, **args) -> <JSON-able>``, in a module under
``kvbus.app``. Operations run concurrently (each is a task); state that outlives one call lives
in ``ctx.state``, and ``ctx.on_close`` registers clean-up for when the driver closes stdin. The
pipes are the experiment's control channel; the data (NATS traffic) goes over the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvbus.app.testbed.errors import ProcessFailed

logger = logging.getLogger(__name__)

ALLOWED_PREFIX = "kvbus.app."


class WorkerContext:
    """What a worker's operations share: ``state`` and clean-up callbacks."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}
        self._closers: list[Callable[[], Awaitable[None]]] = []

    def on_close(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run ``fn`` when the worker shuts down (last registered first)."""
        self._closers.append(fn)

    async def close(self) -> None:
        """Run the clean-up callbacks."""
        for fn in reversed(self._closers):
            try:
                await fn()
            except Exception:
                logger.exception("worker clean-up failed")
        self._closers.clear()


def resolve(op: str) -> Callable[..., Awaitable[Any]]:
    """The function ``module:function`` names (only under ``kvbus.app``).

    Raises:
        ValueError: not of that form, or outside ``kvbus.app``, or not found.
    """
    module, sep, name = op.partition(":")
    if not sep or not module.startswith(ALLOWED_PREFIX) or not name.isidentifier():
        raise ValueError(f"operation {op!r} must be 'kvbus.app.<module>:<function>'")
    fn = getattr(importlib.import_module(module), name, None)
    if fn is None or not callable(fn):
        raise ValueError(f"no function {name!r} in {module}")
    return fn  # type: ignore[no-any-return]


async def serve() -> None:
    """The worker's main loop: read requests on stdin, write replies on the original stdout."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to the log, not into the protocol
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    ctx = WorkerContext()
    tasks: dict[int, asyncio.Task[None]] = {}

    def reply(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg, default=float) + "\n")

    async def handle(rid: int, op: str, args: dict[str, Any]) -> None:
        try:
            result = await resolve(op)(ctx, **args)
            reply({"id": rid, "ok": True, "result": result})
        except asyncio.CancelledError:
            reply({"id": rid, "ok": False, "error": "cancelled"})
        except Exception as exc:
            logger.exception("operation %s failed", op)
            reply(
                {
                    "id": rid,
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()[-3000:],
                }
            )
        finally:
            tasks.pop(rid, None)

    reply({"ready": True, "pid": os.getpid()})
    try:
        while line := await reader.readline():
            try:
                req = json.loads(line)
            except ValueError:
                reply({"error": f"not JSON: {line[:200]!r}"})
                continue
            if "cancel" in req:
                task = tasks.get(int(req["cancel"]))
                if task is not None:
                    task.cancel()
                continue
            rid = int(req["id"])
            tasks[rid] = asyncio.create_task(handle(rid, str(req["op"]), dict(req.get("args") or {})))
    finally:
        for task in list(tasks.values()):
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await ctx.close()


class Worker:
    """The driver's handle on one worker process (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen[bytes], name: str, log_path: Path | None = None) -> None:
        self.proc = proc
        self.name = name
        self.log_path = log_path
        self._ids = itertools.count(1)
        self._futures: dict[int, asyncio.Future[Any]] = {}
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._write_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"worker-{name}", daemon=True)
        self._reader.start()

    @classmethod
    async def local(cls, name: str, *, folder: Path, env: dict[str, str] | None = None) -> Worker:
        """A worker on this machine, outside any namespace (emulated-link benches)."""
        folder.mkdir(parents=True, exist_ok=True)
        log_path = folder / f"{name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvbus.app.testbed.worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        return await cls(proc, name, log_path).wait_ready()

    @classmethod
    async def on_host(cls, tb: Any, host: str, name: str, *, env: dict[str, str] | None = None) -> Worker:
        """A worker in testbed ``tb``'s namespace of ``host``."""
        proc = tb.python(
            host, "-m", "kvbus.app.testbed.worker", name=name, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        return await cls(proc, name, tb.folder / f"{name}.log").wait_ready()

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:] if self.log_path else ""
        except OSError:
            return ""

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            self._loop.call_soon_threadsafe(self._dispatch, msg)
        self._loop.call_soon_threadsafe(self._gone)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if msg.get("ready"):
            if not self._ready.done():
                self._ready.set_result(msg)
            return
        fut = self._futures.pop(int(msg.get("id", -1)), None)
        if fut is None or fut.done():
            return
        if msg.get("ok"):
            fut.set_result(msg.get("result"))
        else:
            fut.set_exception(ProcessFailed(self.name, "operation", f"{msg.get('error')}\n{msg.get('traceback', '')}"))

    def _gone(self) -> None:
        err = ProcessFailed(self.name, "worker", f"exited ({self.proc.poll()}): {self._log_tail()}")
        if not self._ready.done():
            self._ready.set_exception(err)
        for fut in self._futures.values():
            if not fut.done():
                fut.set_exception(err)
        self._futures.clear()

    async def wait_ready(self, timeout: float = 120.0) -> Worker:
        """Wait until the process says it is ready."""
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except TimeoutError:
            raise ProcessFailed(self.name, "worker", f"not ready after {timeout:.0f} s: {self._log_tail()}") from None
        return self

    def _write(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        data = (json.dumps(msg) + "\n").encode()
        with self._write_lock:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()

    def submit(self, op: str, **args: Any) -> asyncio.Future[Any]:
        """Start ``op`` in the worker; the future has its result (or `ProcessFailed`)."""
        rid = next(self._ids)
        fut: asyncio.Future[Any] = self._loop.create_future()
        if self.proc.poll() is not None:
            fut.set_exception(ProcessFailed(self.name, "worker", f"exited: {self._log_tail()}"))
            return fut
        self._futures[rid] = fut
        fut.add_done_callback(functools.partial(self._on_done, rid=rid))
        self._write({"id": rid, "op": op, "args": args})
        return fut

    def _on_done(self, fut: asyncio.Future[Any], *, rid: int) -> None:
        if fut.cancelled() and self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self._write({"cancel": rid})

    async def call(self, op: str, *, timeout: float | None = None, **args: Any) -> Any:
        """Run ``op`` in the worker and return its result."""
        return await asyncio.wait_for(self.submit(op, **args), timeout)

    async def close(self, timeout: float = 20.0) -> None:
        """Close stdin (the worker cleans up and exits), then wait; kill it if it lingers."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.close()
        try:
            await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout)
        except TimeoutError:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)


def main() -> None:
    """``python -m kvbus.app.testbed.worker``."""
    logging.basicConfig(
        level=os.environ.get("KVBUS_WORKER_LOG", "WARNING"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    asyncio.run(serve())


if __name__ == "__main__":
    main()
