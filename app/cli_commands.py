"""The `kvbus` command line's long-running verbs: up, group-scheduler, coordinator, selftest, top.

`kvbus.app.cli` builds the parser and dispatches to these; they share the stack file of a
running `kvbus up` and the NATS options from the ``KVBUS_NATS_*`` variables.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvbus.app.processes import process_alive, process_start_time
from kvbus.config import redact_url
from kvbus.errors import NatsConnectError

logger = logging.getLogger("kvbus")


STACK_FILE = Path(os.environ.get("KVBUS_STACK_FILE", Path.home() / ".cache" / "kvbus" / "stack.json"))
CREDENTIALS_FILE = Path(os.environ.get("KVBUS_CREDENTIALS_FILE", Path.home() / ".cache" / "kvbus" / "credentials.json"))


def stack_nats_url() -> str:
    """NATS URL of a running `kvbus up` (from its stack file, ``KVBUS_STACK_FILE``), else the
    default local server: what the CLI's verbs and the examples connect to unless told."""
    data = _read_stack_file()
    if data is not None and _stack_alive(data) and isinstance(data.get("nats_url"), str):
        return str(data["nats_url"])
    return "nats://127.0.0.1:4222"


# -- the stack file: one running `kvbus up` per file ----------------------------------------------
#
# `kvbus up` claims the file before it starts anything (a second one stops with a message naming
# the first), fills it in once its servers are up, and removes it when it stops. A file whose
# process is gone (killed with -9) is taken over. The file holds ``pid`` and ``pid_start`` (so a
# recycled pid is not taken for the stack), ``nats_url``, ``redis_url``, ``groups``, ``secure``
# and ``credentials``; while the stack starts, only the first two and ``"starting": true``.


def _read_stack_file() -> dict[str, Any] | None:
    """The stack file's contents, or None when there is none or it is not a JSON object."""
    try:
        data = json.loads(STACK_FILE.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _stack_alive(data: dict[str, Any]) -> bool:
    """Whether the `kvbus up` a stack file names still runs. (A file without ``pid_start``, as an
    older kvbus or a test standing in for `kvbus up` writes, is checked by its pid alone.)"""
    return process_alive(data.get("pid"), data.get("pid_start"))


@contextlib.contextmanager
def _stack_file_locked() -> Iterator[None]:
    """Hold the lock beside the stack file: two `kvbus up` started at once do not both see it free.
    (The kernel drops the lock of a process that dies holding it.)"""
    STACK_FILE.parent.mkdir(parents=True, exist_ok=True)
    with open(STACK_FILE.with_name(STACK_FILE.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_stack_file(data: dict[str, Any]) -> None:
    """Replace the stack file at once: a reader never sees half of it (and takes it for stale)."""
    tmp = STACK_FILE.with_name(f"{STACK_FILE.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(STACK_FILE)


def _already_running(data: dict[str, Any]) -> str:
    pid = data.get("pid")
    where = f"NATS {redact_url(str(data['nats_url']))}" if data.get("nats_url") else "still starting"
    return (
        f"kvbus up: a kvbus stack is already running (pid {pid}, {where}; recorded in {STACK_FILE}). "
        f"Stop it first (Ctrl-C where it runs, or kill {pid}), or give this one a stack file of its "
        f"own: KVBUS_STACK_FILE=/some/other/stack.json kvbus up"
    )


def _claim_stack_file() -> dict[str, Any]:
    """Make the stack file this process's; returns its identity (``pid``, ``pid_start``).

    Raises:
        SystemExit: another live `kvbus up` holds the file (the message names its pid and URL).
    """
    me = {"pid": os.getpid(), "pid_start": process_start_time(os.getpid())}
    with _stack_file_locked():
        data = _read_stack_file()
        if data is not None and _stack_alive(data):
            raise SystemExit(_already_running(data))
        if STACK_FILE.exists():
            logger.info("taking over %s: the kvbus up it names (pid %s) is gone", STACK_FILE, (data or {}).get("pid"))
        _write_stack_file({**me, "starting": True})
    return me


def _fill_stack_file(me: dict[str, Any], info: dict[str, Any]) -> None:
    """Write what clients read (URLs, groups) into the stack file this process claimed."""
    with _stack_file_locked():
        _write_stack_file({**info, **me})


def _release_stack_file(me: dict[str, Any]) -> None:
    """Remove the stack file if it is still this process's."""
    with _stack_file_locked():
        data = _read_stack_file()
        if data is not None and data.get("pid") == me["pid"] and data.get("pid_start") == me["pid_start"]:
            STACK_FILE.unlink(missing_ok=True)


class _Sigterm:
    """While entered, SIGTERM cancels the task that entered, as `asyncio.run` does on Ctrl-C.

    Why: the `kvbus` command's own SIGTERM handler raises KeyboardInterrupt out of the event loop,
    and `asyncio.run` then cancels every task at once, the NATS clients' reader tasks too; each
    scheduler's and coordinator's lease release then waited out its timeout on a connection that
    no longer read (4.5 s to exit with one group, 8.5 s with three). Cancelling only this task
    lets its cleanup run while the connections still work.
    """

    def __init__(self) -> None:
        self.received = False
        """Whether a SIGTERM came (and cancelled the task)."""
        self._installed = False
        self._previous: Any = None

    def __enter__(self) -> _Sigterm:
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        if task is None:
            return self

        def on_sigterm() -> None:
            logger.info("SIGTERM: stopping")
            self.received = True
            task.cancel()

        self._previous = signal.getsignal(signal.SIGTERM)
        try:
            loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no loop signals here
            return self
        self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._previous)  # the loop's removal left the default


async def _nats_options(url: str) -> dict[str, Any]:
    """`nats.connect` options for ``url``: identity and TLS from the ``KVBUS_NATS_*`` variables.

    Connects once first, so that refused credentials or an untrusted certificate stop the
    command with a clear message (the long-lived clients would retry them for ever). A server
    that does not answer yet is only warned about: the clients keep retrying until it does.

    Raises:
        ConfigError: the ``KVBUS_NATS_*`` settings are inconsistent or name a bad file.
        NatsConnectError: the server refused the credentials or the TLS handshake.
    """
    from kvbus.net.auth import NatsAuth, check_connection

    auth = NatsAuth.from_env()
    options = auth.connect_options()
    logger.info("connecting to NATS at %s with %r", redact_url(url), auth)
    # KVBUS_NATS_CONNECT_WAIT: seconds a refused login is tried again before giving up (the Helm
    # chart sets it: a new group's user reaches the servers by a config reload, which may land
    # after the scheduler pod starts).
    wait = float(os.environ.get("KVBUS_NATS_CONNECT_WAIT", "0") or 0)
    give_up = time.monotonic() + wait
    while True:
        try:
            await check_connection(url, options)
            return options
        except NatsConnectError as exc:
            if exc.retryable:
                logger.warning("%s; retrying until it answers", exc)
                return options
            if time.monotonic() >= give_up:
                raise
            logger.warning(
                "%s; trying again for up to %.0f s (KVBUS_NATS_CONNECT_WAIT)", exc, give_up - time.monotonic()
            )
            await asyncio.sleep(min(2.0, max(0.1, give_up - time.monotonic())))


@contextlib.contextmanager
def _embedded_clusters(args: argparse.Namespace, extra: str) -> Iterator[tuple[str | None, str | None]]:
    """Start the clusters ``--nats-cluster`` / ``--redis-cluster`` ask for; yields (nats_url, redis_url):
    theirs, else the given ``--nats-url`` / ``--redis-url`` (None: `LocalServers` starts one server)."""
    with contextlib.ExitStack() as stack:
        nats_url, redis_url = args.nats_url, args.redis_url
        if args.nats_cluster > 1 and not nats_url:
            from kvbus.app.cluster import NatsCluster

            nats_url = stack.enter_context(NatsCluster(args.nats_cluster, extra_config=extra)).url
        if args.redis_cluster and not redis_url:
            from kvbus.app.valkey_cluster import ValkeyCluster

            redis_url = stack.enter_context(ValkeyCluster(3, 1)).url
        yield nats_url, redis_url


def _pinned(url: str, k: int) -> tuple[str, dict[str, Any]]:
    """The servers of ``url`` rotated so that server ``k`` (mod their number) comes first, and the
    option that keeps that order: group ``k`` prefers its own server of the cluster."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if len(servers) < 2:
        return url, {}
    k %= len(servers)
    return ",".join(servers[k:] + servers[:k]), {"dont_randomize": True}


async def _up(args: argparse.Namespace) -> None:
    """`kvbus up`: claim the stack file, run the stack until Ctrl-C or SIGTERM, release the file.

    Raises:
        SystemExit: another `kvbus up` runs on the same stack file, or the options conflict.
        KeyboardInterrupt: after a SIGTERM, once everything stopped (the command then exits 0, as
            after Ctrl-C).
    """
    me = _claim_stack_file()
    try:
        with _Sigterm() as sigterm:
            try:
                await _run_stack(args, me)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not sigterm.received or task is None:
                    raise
                task.uncancel()
    finally:
        _release_stack_file(me)
    if sigterm.received:
        raise KeyboardInterrupt


async def _run_stack(args: argparse.Namespace, me: dict[str, Any]) -> None:
    from kvbus.app.local import LocalServers
    from kvbus.coordinator import Coordinator
    from kvbus.group_scheduler import GroupScheduler

    groups = ["default"] if args.groups == 1 else [f"g{i}" for i in range(args.groups)]
    extra, creds = "", None
    if args.secure:
        from kvbus.security import AgentGrant, permissions_config, save_credentials

        if args.nats_url:
            raise SystemExit(
                "--secure starts its own nats-server with the generated permissions; "
                "drop --nats-url (or configure your server with kvbus.security.permissions_config)"
            )
        names = [n.strip() for n in args.agents.split(",") if n.strip()]
        grants = [AgentGrant(n, groups[0], broadcasts_from=tuple(m for m in names if m != n)) for n in names]
        extra, creds = permissions_config(grants, groups)
        save_credentials(creds, CREDENTIALS_FILE)
    with (
        _embedded_clusters(args, extra) as (nats_url, redis_url),
        LocalServers(nats_url=nats_url, redis_url=redis_url, nats_extra_config=extra) as servers,
    ):
        # KVBUS_NATS_* (identity, TLS) is for a server given with --nats-url; the embedded one
        # has no authentication, or the --secure users.
        shared = await _nats_options(servers.nats_url) if args.nats_url else {}
        replicas = max(1, args.replicas)
        coords = [
            await Coordinator.connect(servers.nats_url, nats_options=creds.coordinator_options() if creds else shared)
            for _ in range(replicas)
        ]
        # On a cluster, group k's schedulers prefer server k: the groups spread over the servers.
        scheds = [
            await GroupScheduler.connect(
                _pinned(servers.nats_url, k)[0],
                g,
                nats_options={**(creds.scheduler_options(g) if creds else shared), **_pinned(servers.nats_url, k)[1]},
            )
            for k, g in enumerate(groups)
            for _ in range(replicas)
        ]
        _fill_stack_file(
            me,
            {
                "nats_url": servers.nats_url,
                "redis_url": servers.redis_url,
                "groups": groups,
                "secure": bool(creds),
                "credentials": str(CREDENTIALS_FILE) if creds else None,
            },
        )
        secure = (
            (
                f"  secure: {len(creds.agents)} agent users; credentials in {CREDENTIALS_FILE} (0600); "
                f"connect with Bus.connect(url, secure=True, **creds.agent_options(name))\n"
            )
            if creds
            else "  not secure (no --secure): any NATS client can read any agent's KV and fake its deliveries\n"
        )
        print(
            f"kvbus is up\n  NATS:   {redact_url(servers.nats_url)}\n  Redis:  {redact_url(servers.redis_url)}\n"
            f"  groups: {', '.join(groups)} ({replicas} scheduler replica(s) each; {replicas} coordinator "
            f"replica(s))\n{secure}`kvbus top` shows it live. Ctrl-C stops everything.",
            flush=True,
        )
        try:
            await asyncio.Event().wait()
        finally:
            # Side by side: each close bounds its own steps, and one waiting out a lease release
            # or a drain must not add its wait to the others' (exit time is the slowest, not the sum).
            logger.info("stopping: closing %d scheduler(s), then %d coordinator(s)", len(scheds), len(coords))
            await asyncio.gather(*(s.close() for s in scheds))
            await asyncio.gather(*(c.close() for c in coords))
            logger.info("stopping: services closed; stopping the servers")


async def _group_scheduler(args: argparse.Namespace) -> None:
    from kvbus.group_scheduler import GroupScheduler, SchedulerConfig

    overrides: dict[str, object] = {} if args.bandwidth is None else {"bandwidth_bps": args.bandwidth}
    if args.policy is not None:
        overrides["policy"] = args.policy
    config = SchedulerConfig.from_env(**overrides)
    sched = await GroupScheduler.connect(
        args.nats_url, args.group, config=config, nats_options=await _nats_options(args.nats_url)
    )
    print(f"group scheduler for {args.group!r} on {redact_url(args.nats_url)} ({config.policy} policy)", flush=True)
    await sched.run_forever()


async def _selftest(url: str, group: str, nbytes: int) -> int:
    from kvbus.app.selftest import agents_from_env, selftest

    # `helm test` runs its two agents as their own users (KVBUS_SELFTEST_SENDER, _RECEIVER).
    agents = agents_from_env()
    return await selftest(
        url, group, nbytes, nats_options=await _nats_options(agents[0][1] if agents else url), agents=agents
    )


async def _top(url: str, args: argparse.Namespace) -> None:
    from kvbus.app.top import top

    await top(url, groups=args.group, interval=args.interval, once=args.once, nats_options=await _nats_options(url))


async def _coordinator(args: argparse.Namespace) -> None:
    from kvbus.coordinator import Coordinator

    coord = await Coordinator.connect(args.nats_url, nats_options=await _nats_options(args.nats_url))
    print(f"coordinator on {redact_url(args.nats_url)}", flush=True)
    await coord.run_forever()
