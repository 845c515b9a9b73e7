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
}


def machine_info() -> dict[str, Any]:
    import os

    import torch

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }


def run_suite(name: str, *, json_path: str | None = None, quick: bool = False, **options: Any) -> int:
    """Run suite ``name``, print a table, write ``{"suite", "config", "results"}`` JSON to ``json_path``."""
    import importlib

    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; known suites: {', '.join(sorted(SUITES))}")
    module = importlib.import_module(SUITES[name])
    run: Callable[..., dict[str, Any]] = module.run
    out = run(quick=quick, **options)
    out.setdefault("suite", name)
    out.setdefault("config", {}).update({"machine": machine_info(), "quick": quick})
    text = json.dumps(out, indent=2, default=float)
    if json_path:
        Path(json_path).write_text(text + "\n")
        print(f"wrote {json_path}")
    else:
        print(text)
    return 0
