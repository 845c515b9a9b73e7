"""`kvbus bench agents` counts each workflow's saves and deliveries from the connectors' events:
one published after the workflow's last request returned belongs to that workflow, not the next
(the smoke run once saw a text arm "save" a block that the kvbus arm before it had stored)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from kvbus.app.bench.agents_team import settle
from kvbus.integrations.vllm.protocol import Event


@dataclass
class Events:
    """What `KVBusControl` offers `settle`: the events collected so far, appended by another thread."""

    events: list[Event] = field(default_factory=list)


def test_settle_waits_for_events_published_after_the_requests_returned() -> None:
    ctl = Events([Event(agent="a", kind="save")])

    def late() -> None:  # a connector storing the last save of the workflow, then another
        for delay in (0.2, 0.3):
            time.sleep(delay)
            ctl.events.append(Event(agent="a", kind="save", request_id="late"))

    t = threading.Thread(target=late)
    t.start()
    try:
        assert settle(ctl, quiet_s=0.4, timeout=5.0) == 3
    finally:
        t.join()


def test_settle_gives_up_at_its_timeout_on_a_stream_that_never_stops() -> None:
    ctl = Events()
    stop = threading.Event()

    def chatter() -> None:
        while not stop.is_set():
            ctl.events.append(Event(agent="a", kind="receive"))
            time.sleep(0.02)

    t = threading.Thread(target=chatter)
    t.start()
    try:
        # It returns (a hang would be this test's timeout) with what it had seen by then.
        assert 0 < settle(ctl, quiet_s=0.5, timeout=0.6) <= len(ctl.events)
    finally:
        stop.set()
        t.join()
