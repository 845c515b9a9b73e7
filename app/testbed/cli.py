"""`kvbus testbed`: check, up, list, clean."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

from kvbus.app.testbed.errors import TestbedError, TestbedUnavailable


def add_parser(sub: Any) -> None:
    """Add the ``testbed`` verb and its sub-commands to the CLI."""
    tb = sub.add_parser("testbed", help="a real multi-host network on this machine (namespaces, veths, bridges, tc)")
    verbs = tb.add_subparsers(dest="testbed_command", required=True)
    verbs.add_parser("check", help="say whether this machine can build the testbed, and how links are made")
    up = verbs.add_parser("up", help="build a topology, start its servers and schedulers, wait for Ctrl-C")
    up.add_argument("topology", help="a shipped topology (one-rack, two-racks, wan-edge) or a TOML file")
    up.add_argument("--bare", action="store_true", help="only the network: no servers, no schedulers")
    up.add_argument("--seconds", type=float, default=None, help="tear down after this long instead of waiting")
    verbs.add_parser("list", help="testbed runs on this machine (live or left behind)")
    clean = verbs.add_parser(
        "clean",
        help="remove what runs left behind: namespaces, veths, bridges, processes, "
        "folders (runs whose builder is gone; --all also live ones)",
    )
    clean.add_argument("--run", default=None, help="only this run id")
    clean.add_argument("--all", action="store_true", help="also runs whose builder is still running")
    verbs.add_parser("topologies", help="list the shipped topologies")


def run(args: argparse.Namespace) -> int:
    """Run ``kvbus testbed <verb>``; returns the exit code."""
    try:
        return int(_VERBS[args.testbed_command](args))
    except TestbedUnavailable as exc:
        print(f"kvbus testbed: {exc}", file=sys.stderr, flush=True)
        return 3
    except TestbedError as exc:
        print(f"kvbus testbed: {exc}", file=sys.stderr, flush=True)
        return 2


def _check(args: argparse.Namespace) -> int:
    from kvbus.app.testbed.netns import capabilities

    caps = capabilities()
    if not caps.available:
        print(f'not available: {caps.reason}\nbenches use emulated links ("network": "emulated" in their JSON)')
        return 1
    how = {
        "netem": "netem",
        "nfqueue": "an NFQUEUE delay line (this kernel has no netem)",
        None: "nothing: links with delay, jitter or loss cannot be built (install iptables)",
    }[caps.delay]
    print(f"available: namespaces, veth, bridge, htb for bandwidth; delay, jitter and loss by {how}")
    print(json.dumps(caps.as_dict()))
    return 0


def _topologies(args: argparse.Namespace) -> int:
    from kvbus.app.testbed.topology import load, shipped

    for name in shipped():
        topo = load(name)
        print(
            f"{name}: {len(topo.hosts)} hosts, {len(topo.racks)} rack(s), {len(topo.groups)} group(s)\n"
            f"    {topo.description}"
        )
    return 0


def _up(args: argparse.Namespace) -> int:
    from kvbus.app.testbed import shaping
    from kvbus.app.testbed.fabric import Testbed
    from kvbus.app.testbed.services import start_stack
    from kvbus.app.testbed.topology import load

    topo = load(args.topology)
    tb = Testbed(topo)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        tb.build()
        stack = None if args.bare else start_stack(tb)
        tb.start_schedule()
        print(f"testbed {tb.run_id} is up: topology {topo.name}, delay by {tb.delay_backend or 'none needed'}")
        for h in topo.hosts:
            print(
                f"  {h.name:<14} {tb.ip(h.name):<13} rack {h.rack:<10} {shaping.describe(h.link, tb.caps.netem)}"
                f"   (ip netns exec {tb.ns(h.name)} ...)"
            )
        for r in topo.racks:
            if topo.multi_rack:
                print(f"  uplink of {r.name}: {shaping.describe(topo.link('uplink:' + r.name), tb.caps.netem)}")
        if stack is not None:
            print(
                f"  NATS {stack.nats_url}"
                + (f"  Redis {stack.redis_url}" if stack.redis_url else "")
                + f"  processes: {', '.join(stack.processes)}"
            )
        print(f"  logs: {tb.folder}   (Ctrl-C tears it down; `kvbus testbed clean` after a crash)", flush=True)
        deadline = None if args.seconds is None else time.monotonic() + args.seconds
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        tb.teardown()
        print(f"testbed {tb.run_id} torn down", flush=True)
    return 0


def _list(args: argparse.Namespace) -> int:
    from kvbus.app.testbed.runs import list_runs

    runs = list_runs()
    if not runs:
        print("no testbed runs on this machine")
    for r in runs:
        print(
            f"{r.run_id}  {r.topology:<12} {'live' if r.alive else 'stale'}  {len(r.namespaces)} namespaces, "
            f"{r.processes} processes{', folder' if r.folder else ''}"
        )
    return 0


def _clean(args: argparse.Namespace) -> int:
    from kvbus.app.testbed.netns import capabilities
    from kvbus.app.testbed.runs import clean

    if not capabilities().root:
        raise TestbedUnavailable("cleaning needs root, as building did")
    totals = clean(run_id=args.run, everything=args.all)
    print(
        f"removed {totals['runs']} run(s): {totals['namespaces']} namespaces, {totals['processes']} processes, "
        f"{totals['folders']} folders"
        + (f"; kept {totals['kept']} live run(s) (--all removes them too)" if totals["kept"] else "")
    )
    return 0


_VERBS = {"check": _check, "up": _up, "list": _list, "clean": _clean, "topologies": _topologies}
