"""Fixtures: real servers on free ports, a group scheduler, connected buses."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest

from kvbus.app.local import NatsServer, RedisServer
from kvbus.bus import Bus, BusConfig
from kvbus.group_scheduler import GroupScheduler, SchedulerConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    """A real nats-server (JetStream on) for the whole test session."""
    server = NatsServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real Redis-protocol server for the whole test session."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
async def scheduler(nats_url: str) -> AsyncIterator[GroupScheduler]:
    """A group scheduler for group ``default`` in this process (its own NATS connection)."""
    sched = await GroupScheduler.connect(nats_url, "default", config=SchedulerConfig(max_active=8))
    try:
        yield sched
    finally:
        await sched.close()


FAST = BusConfig(ack_timeout=0.5, peer_timeout=3.0, request_timeout=2.0, grant_timeout=10.0, partial_timeout=2.0)


@pytest.fixture
def nats_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bus made in the test sends every byte through NATS (tests of the NATS data path:
    faults injected into its chunk messages, forged chunks on its subjects)."""
    monkeypatch.setenv("KVBUS_PATHS_ALLOWED", "nats")


@pytest.fixture
async def bus(nats_url: str, scheduler: GroupScheduler) -> AsyncIterator[Bus]:
    """A bus connection with short timeouts, closed after the test."""
    b = await Bus.connect(nats_url, config=FAST)
    try:
        yield b
    finally:
        await b.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("KVBUS_SLOW"):
        return
    skip = pytest.mark.skip(reason="slow; set KVBUS_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
