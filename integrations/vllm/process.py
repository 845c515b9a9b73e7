"""A vLLM engine in its own OS process, driven over a pipe (for examples, benchmarks and tests).

vLLM on CPU starts its engine with ``spawn``, so each `EngineProcess` is a fresh interpreter:
it sets its own environment (``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_CPU_OMP_THREADS_BIND`` ...),
writes its log (vLLM's and the connector's) to a file of its own, builds one ``vllm.LLM`` and
then serves `generate` calls until `close`. Several calls share one engine load (about 40 s for
SmolLM2 on 2 cores).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from typing import Any

#: Seconds an engine may take to start.
START_TIMEOUT_S = 600.0


def _child(conn: Any, env: dict[str, str], log_path: str | None, llm_kwargs: dict[str, Any]) -> None:
    # A process group of its own: `EngineProcess.close` ends vLLM's engine-core and worker
    # processes with it, whatever state the engine is in.
    os.setpgrp()
    os.environ.update(env)
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(**llm_kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            break
        if cmd == "close":
            break
        try:
            if cmd == "generate":
                params = SamplingParams(
                    temperature=0.0,
                    max_tokens=int(args["max_tokens"]),
                    extra_args={"kv_transfer_params": args["kv_transfer_params"]}
                    if args.get("kv_transfer_params")
                    else None,
                )
                salts = args.get("cache_salt")
                if salts is None or isinstance(salts, str):
                    salts = [salts] * len(args["prompts"])
                prompts = [
                    {"prompt_token_ids": list(p), **({"cache_salt": salt} if salt else {})}
                    for p, salt in zip(args["prompts"], salts)
                ]
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - t0
                conn.send(
                    (
                        "ok",
                        [
                            {
                                "token_ids": list(o.outputs[0].token_ids),
                                "text": o.outputs[0].text,
                                "num_cached_tokens": int(o.num_cached_tokens or 0),
                                "kv_transfer_params": o.kv_transfer_params,
                                "seconds": seconds,
                                "ttft": getattr(o.metrics, "first_token_latency", None),
                            }
                            for o in outs
                        ],
                    )
                )
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class EngineError(RuntimeError):
    """The engine process failed to start or to answer."""


class EngineProcess:
    """One ``vllm.LLM`` in a child process (use as a context manager or call `close`)."""

    def __init__(self, *, env: dict[str, str] | None = None, log_path: str | None = None, **llm_kwargs: Any) -> None:
        self.env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        self.log_path = log_path
        self.llm_kwargs = llm_kwargs
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child, self.env, log_path, llm_kwargs), daemon=False)
        self._child_conn = child

    def launch(self) -> EngineProcess:
        """Start the process without waiting for its engine (see `wait_ready`)."""
        self._proc.start()
        self._child_conn.close()
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> EngineProcess:
        """Wait until the engine launched by `launch` is up."""
        status, detail = self._recv(timeout)
        if status != "ready":
            self.close()
            raise EngineError(f"the vLLM engine did not start: {detail} (log: {self.log_path})")
        return self

    def start(self, timeout: float = START_TIMEOUT_S) -> EngineProcess:
        """Start the process and wait until its engine is up."""
        return self.launch().wait_ready(timeout)

    def _recv(self, timeout: float) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.5):
            if not self._proc.is_alive():
                raise EngineError(f"the engine process exited with code {self._proc.exitcode} (log: {self.log_path})")
            if time.monotonic() > deadline:
                raise EngineError(f"the engine did not answer within {timeout:.0f} s (log: {self.log_path})")
        status, detail = self._conn.recv()
        return str(status), detail

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_tokens: int = 16,
        kv_transfer_params: dict | None = None,
        cache_salt: str | list[str] | None = None,
        timeout: float = 600.0,
    ) -> list[dict[str, Any]]:
        """Greedy completions of token-id prompts: per prompt ``token_ids``, ``text``,
        ``num_cached_tokens``, ``kv_transfer_params``, the call's ``seconds`` and ``ttft`` (time to
        first token, when the engine keeps request stats: ``disable_log_stats=False``).

        ``cache_salt`` (one for every prompt, or one per prompt) is vLLM's prompt field of that
        name: its prefix cache reuses blocks only between requests of the same salt.
        """
        if isinstance(cache_salt, list) and len(cache_salt) != len(prompts):
            raise ValueError(f"cache_salt has {len(cache_salt)} salts for {len(prompts)} prompts")
        self._conn.send(
            (
                "generate",
                {
                    "prompts": prompts,
                    "max_tokens": max_tokens,
                    "kv_transfer_params": kv_transfer_params,
                    "cache_salt": cache_salt,
                },
            )
        )
        status, detail = self._recv(timeout)
        if status != "ok":
            raise EngineError(str(detail))
        return list(detail)

    def close(self, timeout: float = 60.0) -> None:
        """Stop the engine and the process."""
        if self._proc.is_alive():
            try:
                self._conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout)
        pid = self._proc.pid
        if pid is not None:
            # Whatever is left of the engine (its child processes included) is in the group.
            for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(pid, sig)
                except (ProcessLookupError, PermissionError):
                    break
                self._proc.join(wait)
                if not _group_alive(pid):
                    break
        self._conn.close()

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
