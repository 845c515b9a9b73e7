"""Traffic shaping of one direction of a link with ``tc``: htb for the rate, netem (when the kernel
has it) for delay, jitter and loss, a drop-tail pfifo as the queue otherwise.

Each direction of a link is the egress queue of one veth end: a host's upload is its ``eth0``,
its download the switch port facing it. Without netem, delay, jitter and loss are the NFQUEUE
delay line's business (`kvbus.app.testbed.delayline`) and this module only sets the rate.
"""

from __future__ import annotations

import logging

from kvbus.app.testbed import netns
from kvbus.app.testbed.topology import LinkSpec

logger = logging.getLogger(__name__)

#: htb class and leaf handles.
ROOT, CLASS, LEAF = "1:", "1:1", "10:"


def _rate(link: LinkSpec) -> str:
    return f"{int(link.rate_mbit * 1e6)}bit"


def _burst(link: LinkSpec, mtu: int) -> str:
    # Half a millisecond at the rate, and never less than two frames: enough for the kernel's
    # timers at high rates, small enough not to let a visible burst through at low ones.
    return f"{max(2 * (mtu + 14), int(link.rate_bytes_per_s * 0.0005))}b"


def _netem_args(link: LinkSpec) -> list[str]:
    args = ["limit", str(link.queue_packets)]
    if link.delay_ms > 0 or link.jitter_ms > 0:
        args += ["delay", f"{link.delay_ms}ms"]
        if link.jitter_ms > 0:
            args += [f"{link.jitter_ms}ms"]
    if link.loss_pct > 0:
        args += ["loss", f"{link.loss_pct}%"]
    return args


def _leaf(link: LinkSpec, netem: bool) -> list[str]:
    if netem and link.impaired:
        return ["netem", *_netem_args(link)]
    return ["pfifo", "limit", str(link.queue_packets)]


def apply(ns: str, dev: str, link: LinkSpec, *, netem: bool, mtu: int = 1500, previous: LinkSpec | None = None) -> str:
    """Shape the egress of ``dev`` in namespace ``ns`` to ``link``; returns what was set up.

    With ``previous`` (the link as it is now) the change is made in place where it can be
    (``tc class change``, ``tc qdisc change``), so queued packets are not thrown away.

    Args:
        netem: the kernel has netem; otherwise only the rate and the queue are set here.
    """
    impaired = netem and link.impaired
    if previous is not None and previous.shaped and link.shaped:
        netns.tc(
            "class",
            "change",
            "dev",
            dev,
            "parent",
            ROOT,
            "classid",
            CLASS,
            "htb",
            "rate",
            _rate(link),
            "ceil",
            _rate(link),
            "burst",
            _burst(link, mtu),
            "cburst",
            _burst(link, mtu),
            "quantum",
            "6056",
            ns=ns,
        )
        was_netem = netem and previous.impaired
        if was_netem == impaired:
            netns.tc("qdisc", "change", "dev", dev, "parent", CLASS, "handle", LEAF, *_leaf(link, netem), ns=ns)
        else:
            netns.tc("qdisc", "replace", "dev", dev, "parent", CLASS, "handle", LEAF, *_leaf(link, netem), ns=ns)
        return describe(link, netem)
    if previous is not None and not previous.shaped and not link.shaped and (netem and previous.impaired) and impaired:
        netns.tc("qdisc", "change", "dev", dev, "root", "netem", *_netem_args(link), ns=ns)
        return describe(link, netem)
    netns.tc("qdisc", "del", "dev", dev, "root", ns=ns, check=False)
    if link.shaped:
        netns.tc("qdisc", "add", "dev", dev, "root", "handle", ROOT, "htb", "default", "1", ns=ns)
        netns.tc(
            "class",
            "add",
            "dev",
            dev,
            "parent",
            ROOT,
            "classid",
            CLASS,
            "htb",
            "rate",
            _rate(link),
            "ceil",
            _rate(link),
            "burst",
            _burst(link, mtu),
            "cburst",
            _burst(link, mtu),
            "quantum",
            "6056",
            ns=ns,
        )
        netns.tc("qdisc", "add", "dev", dev, "parent", CLASS, "handle", LEAF, *_leaf(link, netem), ns=ns)
    elif impaired:
        netns.tc("qdisc", "add", "dev", dev, "root", "netem", *_netem_args(link), ns=ns)
    return describe(link, netem)


def describe(link: LinkSpec, netem: bool) -> str:
    """One line saying how a direction is shaped (for logs and ``kvbus testbed up``)."""
    parts = []
    if link.shaped:
        parts.append(f"htb {link.rate_mbit:g} Mbit/s")
    if link.impaired:
        how = "netem" if netem else "delay line"
        bits = (
            [f"{link.delay_ms:g} ms"]
            + ([f"+-{link.jitter_ms:g} ms"] if link.jitter_ms else [])
            + ([f"{link.loss_pct:g} % loss"] if link.loss_pct else [])
        )
        parts.append(f"{how} {' '.join(bits)}")
    return ", ".join(parts) or "not shaped"
