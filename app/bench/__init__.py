"""Benchmark suites run by `kvbus bench SUITE --json PATH`."""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Suite name -> module with ``run(*, quick, **options) -> dict``.
SUITES: dict[str, str] = {
    "transport": "kvbus.app.bench.transport",
    "e2e": "kvbus.app.bench.e2e",
    "codecs": "kvbus.app.bench.codecs",
    "select": "kvbus.app.bench.select",
    "cachetier": "kvbus.app.bench.cachetier",
    "sched": "kvbus.app.bench.sched",
    "scale": "kvbus.app.bench.scale",
    "chaos": "kvbus.app.bench.chaos",
    "soak": "kvbus.app.bench.soak",
    "paths": "kvbus.app.bench.paths",
    "vllm": "kvbus.app.bench.vllm",
    "agents": "kvbus.app.bench.agents",
}


def machine_info() -> dict[str, Any]:
    """Python, torch, platform, cores, host name and load average of this machine."""
    import os

    import torch

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "node": platform.node(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


#: What a suite's JSON says under ``config.network`` when the suite does not say more itself:
#: ``none`` (no network: in-process kernels), ``loopback`` (real servers on this machine's
#: loopback, no emulated link), ``emulated`` (links paced by kvbus's `EmulatedLink` or a relay).
NETWORK_DEFAULT: dict[str, str] = {
    "codecs": "none",
    "transport": "loopback",
    "scale": "loopback",
    "chaos": "loopback",
    "soak": "loopback",
    "cachetier": "emulated",
    "select": "emulated",
    "e2e": "emulated",
    "sched": "emulated",
}


def run_suite(
    name: str, *, json_path: str | None = None, quick: bool = False, smoke: bool = False, **options: Any
) -> int:
    """Run suite ``name``, print a table, write ``{"suite", "config", "results"}`` JSON to ``json_path``.

    ``smoke`` runs the smallest version of the suite (seconds, for the test suite: the JSON has
    every key, its figures mean little).
    """
    import importlib
    import time

    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; known suites: {', '.join(sorted(SUITES))}")
    module = importlib.import_module(SUITES[name])
    run: Callable[..., dict[str, Any]] = module.run
    out = run(quick=quick or smoke, smoke=smoke, **options)
    out.setdefault("suite", name)
    config = out.setdefault("config", {})
    config.setdefault("network", NETWORK_DEFAULT.get(name, "loopback"))
    config.update(
        {
            "machine": machine_info(),
            "quick": quick,
            "smoke": smoke,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    )
    text = json.dumps(out, indent=2, default=float)
    if json_path:
        Path(json_path).write_text(text + "\n")
        print(f"wrote {json_path}")
    else:
        print(text)
    return 0
