"""The examples under examples/ run as a user runs them: a plain script in its own process."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from kvbus.group_scheduler import GroupScheduler

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


async def test_quickstart_sends_a_real_kv_and_continues_from_it(
    nats_url: str, scheduler: GroupScheduler, tmp_path: Path
) -> None:
    """As the README runs it: no URL given, it finds the running stack through its stack file
    (here this session's server, with this process standing in for `kvbus up`)."""
    stack = tmp_path / "stack.json"
    stack.write_text(json.dumps({"nats_url": nats_url, "redis_url": "", "pid": os.getpid()}))
    # The scheduler runs in this process's event loop: wait for the script without blocking it.
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(EXAMPLES / "quickstart.py"),
        "--tokens",
        "8",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "KVBUS_STACK_FILE": str(stack)},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 150)
    assert proc.returncode == 0, err.decode()[-2000:]
    lines = out.decode().strip().splitlines()
    assert lines[0].startswith("sent ") and " bytes as " in lines[0]
    # The writer continued the prompt: the prompt is there and something followed it.
    assert lines[-1].startswith("The three things every kitchen needs are")
    assert len(lines[-1]) > len("The three things every kitchen needs are") + 3
