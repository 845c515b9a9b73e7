"""The package root: its names are imported on first use, so a light part loads no heavy one."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvbus


def _run(code: str) -> str:
    """Run ``code`` in a fresh interpreter (nothing of this session imported) and return its output."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_importing_the_root_and_the_codecs_loads_no_bus_nats_or_redis() -> None:
    loaded = _run(
        """
        import sys
        import kvbus, kvbus.codecs, kvbus.protocol
        heavy = ("nats", "redis", "kvbus.bus", "kvbus.net", "kvbus.group_scheduler", "kvbus.coordinator",
                 "kvbus.cachetier", "kvbus.app", "kvbus.integrations")
        print(",".join(m for m in heavy if m in sys.modules))
        """
    )
    assert loaded == ""


def test_a_name_loads_its_part_on_first_use() -> None:
    loaded = _run(
        """
        import sys
        from kvbus import KVCache
        before = "kvbus.bus" in sys.modules
        from kvbus import Bus
        print(before, "kvbus.bus" in sys.modules, Bus.__module__)
        """
    )
    assert loaded == "False True kvbus.bus.client"


def _type_checking_imports() -> dict[str, str]:
    """The names the root's ``TYPE_CHECKING`` block imports (what type checkers see), and from where."""
    tree = ast.parse(Path(kvbus.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    return {
        alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


def test_every_public_name_is_what_type_checkers_see() -> None:
    seen = _type_checking_imports()
    assert set(seen) == set(kvbus.__all__) - {"__version__"}
    for name, module in seen.items():
        assert getattr(kvbus, name) is getattr(importlib.import_module(module), name), name
    assert set(kvbus.__all__) <= set(dir(kvbus))


def test_from_kvbus_import_every_name_and_the_version() -> None:
    names = _run(
        """
        import kvbus
        from kvbus import *
        print(len([n for n in kvbus.__all__ if n in globals()]), len(kvbus.__all__), kvbus.__version__)
        """
    )
    count, total, version = names.split()
    assert count == total and version == kvbus.__version__


def test_an_unknown_name_is_an_attribute_error_and_submodules_still_import() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        kvbus.no_such_name  # type: ignore[attr-defined]  # noqa: B018
    from kvbus import telemetry  # a submodule, not a name of the root

    assert telemetry.__name__ == "kvbus.telemetry"
