"""The static checks CI runs: ruff (lint and format), import contracts and mypy.

    python scripts/check.py            # all of them; exit code 1 if any fails
    python scripts/check.py mypy       # one of: ruff, format, imports, mypy

mypy and import-linter read a package tree from disk, but kvbus is one import name over a folder
per part (`package-dir` in pyproject.toml). So both run on a staged tree, `build/check/kvbus`,
made of hard links to the real files (cheap, and edits show at once), and their findings are
reported with the real paths.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGE = ROOT / "build" / "check"
#: import-linter has no ``python -m`` entry; its console script may sit apart from the interpreter.
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def stage() -> Path:
    """Mirror the package-dir mapping of pyproject.toml into build/check (hard links)."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(STAGE, ignore_errors=True)
    for package, folder in sorted(mapping.items(), key=lambda kv: kv[0].count(".")):
        target = STAGE.joinpath(*package.split("."))
        for src in (ROOT / folder).rglob("*"):
            if "__pycache__" in src.parts or src.suffix not in (".py", ".pyi", ".typed"):
                continue
            dst = target / src.relative_to(ROOT / folder)
            if dst.exists():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, dst)
    return STAGE


def unstage(text: str) -> str:
    """Findings on staged paths, pointed back at the real files."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(mapping.items(), key=lambda kv: -kv[0].count(".")):
        text = text.replace("build/check/" + package.replace(".", "/") + "/", folder.rstrip("/") + "/")
    return text


def run(argv: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None) -> int:
    """Run one check, print what it says (with real paths), return its exit code."""
    print("$", " ".join(argv), flush=True)
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    out = proc.stdout + proc.stderr
    if cwd == STAGE:  # findings name paths relative to the stage (kvbus/...)
        out = re.sub(r"(?m)^kvbus/", "build/check/kvbus/", out)
    out = unstage(out)
    if out.strip():
        print(out.rstrip())
    return proc.returncode


def main(argv: list[str]) -> int:
    """Run the checks named in ``argv`` (all when empty)."""
    wanted = argv or ["ruff", "format", "imports", "mypy"]
    py = sys.executable
    failed = []
    if "ruff" in wanted and run([py, "-m", "ruff", "check", "."]):
        failed.append("ruff")
    if "format" in wanted and run([py, "-m", "ruff", "format", "--check", "."]):
        failed.append("format")
    if {"imports", "mypy"} & set(wanted):
        stage()
        env = {**os.environ, "PYTHONPATH": str(STAGE)}
        if "imports" in wanted and run(
            [py, "-c", LINT_IMPORTS, "--no-logo", str(ROOT / "pyproject.toml")], cwd=STAGE, env=env
        ):
            failed.append("imports")
        # mypy runs inside the stage, where `kvbus` is the staged tree and nothing else of the
        # checkout is in sight (run from the root on build/check/kvbus, mypy 2.4.1 stops with an
        # internal error in redis' annotations); its cache (build/mypy-cache) survives rebuilds.
        mypy = [
            py,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(STAGE.parent / "mypy-cache"),
        ]
        if "mypy" in wanted and run([*mypy, "kvbus"], cwd=STAGE, env=env):
            failed.append("mypy")
    print("checks failed: " + ", ".join(failed) if failed else "checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
