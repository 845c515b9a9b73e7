"""The network testbed: topology files, a real 3-host network from namespaces, veths, a bridge and
tc, a shaped link measured with a plain socket, a bit-exact kvbus transfer between namespaces, and
`kvbus testbed clean` after the builder was killed with SIGKILL.

The network tests need root and iproute2 (they say so when skipped)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvbus.app.testbed import netns, runs
from kvbus.app.testbed.benchnet import choose_network
from kvbus.app.testbed.errors import TestbedUnavailable, TopologyError
from kvbus.app.testbed.topology import from_dict, load, shipped

CAPS = netns.capabilities()


def _missing(*, delay: bool) -> str:
    """What this machine lacks for a testbed (with links that delay, when ``delay``); empty if nothing."""
    try:
        netns.check(CAPS, delay=delay)
    except TestbedUnavailable as exc:
        return str(exc)
    return ""


needs_testbed = pytest.mark.skipif(bool(_missing(delay=False)), reason=_missing(delay=False))
#: For topologies whose links delay, jitter or drop packets: netem or the NFQUEUE delay line too.
needs_delay_line = pytest.mark.skipif(bool(_missing(delay=True)), reason=_missing(delay=True))

THREE_HOSTS = {
    "name": "three",
    "racks": [{"name": "r"}],
    "hosts": [
        {"name": "nats"},
        {"name": "a", "link": {"rate_mbit": 1000}},
        {"name": "b", "link": {"rate_mbit": 40, "delay_ms": 5}},
    ],
    "services": {"nats": "nats"},
    "groups": [{"name": "g", "scheduler": "nats", "hosts": ["a", "b"]}],
}


# -- topology files (no root needed) ----------------------------------------------------------------


def test_the_shipped_topologies_load() -> None:
    assert {"one-rack", "two-racks", "wan-edge"} <= set(shipped())
    two = load("two-racks")
    assert two.multi_rack and two.rack("remote").uplink is not None
    assert two.rack("remote").uplink.rate_mbit == 20 and two.rack("remote").uplink.delay_ms == 10
    assert {g.name for g in two.groups} == {"plan", "remote"}
    wan = load("wan-edge")
    assert wan.schedule and wan.schedule_repeat_s == 60
    assert [s.at_s for s in wan.schedule] == sorted(s.at_s for s in wan.schedule)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"hosts": [{"name": "a", "rack": "nowhere"}]}, "names rack 'nowhere'"),
        ({"hosts": [{"name": "a", "link": {"rate_mbit": -1}}]}, "rate_mbit must be a number >= 0"),
        ({"hosts": [{"name": "a", "link": {"speed": 1}}]}, "unknown field"),
        ({"hosts": [{"name": "a"}, {"name": "a"}]}, "used twice"),
        ({"hosts": [{"name": "A b"}]}, "must be a name"),
        ({"services": {"nats": "ghost"}}, "names host 'ghost'"),
        ({"schedule": [{"at_s": 1, "link": "host:ghost", "rate_mbit": 1}]}, "host:<host> or uplink:<rack>"),
        ({"schedule": [{"at_s": 1, "link": "host:a"}]}, "changes nothing"),
        ({"hosts": [{"name": "a", "link": {"loss_pct": 150}}]}, "at most 100"),
        ({"colour": "blue"}, "unknown key"),
    ],
)
def test_a_bad_topology_is_refused_with_a_reason(change: dict, needle: str) -> None:
    data = {"name": "bad", "racks": [{"name": "r"}], "hosts": [{"name": "a"}], "services": {"nats": "a"}, **change}
    with pytest.raises(TopologyError, match=needle):
        from_dict(data)


def test_a_topology_file_that_is_not_toml(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("name = \n")
    with pytest.raises(TopologyError, match="not valid TOML"):
        load(path)
    with pytest.raises(TopologyError, match="no such shipped topology"):
        load("no-such-topology")


# -- which network a bench or the demo takes (capabilities simulated; nothing is uninstalled) --------

NO_ROOT = netns.Capabilities(False, True, False, False, False, False, "it needs root (run as root, ...)")
ROOT_NO_DELAY = netns.Capabilities(True, True, True, True, netem=False, nfqueue=False)
FULL = netns.Capabilities(True, True, True, True, netem=True, nfqueue=False)
DELAY_LINE = netns.Capabilities(True, True, True, True, netem=False, nfqueue=True)


def test_auto_without_root_takes_emulated_links_and_says_why() -> None:
    mode, why = choose_network("auto", load("two-racks"), caps=NO_ROOT)
    assert mode == "emulated"
    assert "needs root" in why and "\n" not in why


def test_auto_as_root_without_netem_or_iptables_takes_emulated_links_for_a_delayed_topology() -> None:
    """The fresh-machine case of issue 29: root, ip and tc, no netem, no iptables; two-racks has a
    10 ms uplink. Before, auto took the testbed and the build raised TestbedUnavailable."""
    two = load("two-racks")
    assert two.needs_delay
    mode, why = choose_network("auto", two, caps=ROOT_NO_DELAY)
    assert mode == "emulated"
    assert "netem" in why and "apt-get install iptables" in why


def test_auto_as_root_without_a_delay_line_still_takes_the_testbed_when_no_link_delays() -> None:
    flat = from_dict(
        {**THREE_HOSTS, "hosts": [{"name": "nats"}, {"name": "a"}, {"name": "b", "link": {"rate_mbit": 40}}]}
    )
    assert not flat.needs_delay
    assert choose_network("auto", flat, caps=ROOT_NO_DELAY)[0] == "netns"


@pytest.mark.parametrize("caps", [FULL, DELAY_LINE], ids=["netem", "nfqueue"])
def test_auto_with_the_full_testbed_takes_it(caps: netns.Capabilities) -> None:
    mode, why = choose_network("auto", load("two-racks"), caps=caps)
    assert mode == "netns" and (caps.delay or "") in why


@pytest.mark.parametrize("caps", [NO_ROOT, ROOT_NO_DELAY], ids=["no-root", "no-delay-line"])
def test_an_explicit_netns_fails_loudly_where_the_topology_cannot_be_built(caps: netns.Capabilities) -> None:
    with pytest.raises(TestbedUnavailable):
        choose_network("netns", load("two-racks"), caps=caps)


def test_a_link_that_delays_only_in_the_schedule_needs_a_delay_line() -> None:
    topo = from_dict({**THREE_HOSTS, "schedule": [{"at_s": 1, "link": "host:a", "delay_ms": 3}]})
    topo = topo.with_link("host:b", delay_ms=0)
    assert topo.may_impair("host:a") and not topo.may_impair("host:b") and topo.needs_delay


# -- the network ------------------------------------------------------------------------------------


def _in(tb: object, host: str, code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        netns.exec_argv(tb.ns(host), [sys.executable, "-c", textwrap.dedent(code)]),  # type: ignore[attr-defined]
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@needs_delay_line
def test_build_and_tear_down_three_hosts() -> None:
    from kvbus.app.testbed.fabric import Testbed

    tb = Testbed(from_dict(THREE_HOSTS))
    with tb:
        spaces = set(netns.namespaces())
        assert {tb.ns("nats"), tb.ns("a"), tb.ns("b"), tb.switch_ns} <= spaces
        # The root namespace got nothing: every device lives in the run's namespaces.
        root_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert "p0@" not in root_links and "brc" not in root_links
        # Every host reaches every other over the bridge (TCP connect, a real handshake).
        server = tb.python(
            "nats",
            "-c",
            "import socket,time\ns=socket.socket();s.bind(('0.0.0.0',7001));s.listen(8)\n"
            "print('listening',flush=True)\nwhile True: s.accept()[0].close()",
            name="listener",
        )
        tb.wait_for_log(server, "listener", "listening", host="nats", timeout=30)
        for host in ("a", "b"):
            got = _in(tb, host, f"import socket; socket.create_connection(('{tb.ip('nats')}', 7001), 10); print('ok')")
            assert got.stdout.strip() == "ok", got.stderr
        # b's link has 5 ms of delay each way: a round trip to it cannot be shorter than 10 ms.
        echo = tb.python(
            "b",
            "-c",
            "import socket\ns=socket.socket();s.bind(('0.0.0.0',7002));s.listen(1)\n"
            "print('listening',flush=True)\nc=s.accept()[0]\nwhile d:=c.recv(1): c.sendall(d)",
            name="echo",
        )
        tb.wait_for_log(echo, "echo", "listening", host="b", timeout=30)
        got = _in(
            tb,
            "a",
            f"""
            import socket, time
            s = socket.create_connection(('{tb.ip("b")}', 7002), 10)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            best = 1e9
            for _ in range(5):
                t = time.perf_counter(); s.sendall(b'x'); s.recv(1); best = min(best, time.perf_counter() - t)
            print(best)""",
        )
        assert float(got.stdout) >= 0.010, got.stderr
        folder = tb.folder
        assert (folder / "state.json").exists()
    assert not {n for n in netns.namespaces() if n.startswith(runs.namespace_prefix(tb.run_id))}
    assert not folder.exists()


@needs_testbed
def test_a_shaped_link_measured_with_a_plain_socket() -> None:
    """40 Mbit/s into host b: a TCP stream from a, timed at b after slow start, within 15 %."""
    from kvbus.app.testbed.fabric import Testbed

    topo = from_dict(
        {**THREE_HOSTS, "hosts": [{"name": "nats"}, {"name": "a"}, {"name": "b", "link": {"rate_mbit": 40}}]}
    )
    with Testbed(topo) as tb:
        sink = tb.python(
            "b",
            "-c",
            textwrap.dedent("""
            import socket, time
            s = socket.socket(); s.bind(('0.0.0.0', 7003)); s.listen(1); print('listening', flush=True)
            c = s.accept()[0]; marks = []; n = 0
            while d := c.recv(1 << 20):
                n += len(d); marks.append((time.monotonic(), n))
            t0 = next(t for t, k in marks if t >= marks[0][0] + 0.5)
            n0 = next(k for t, k in marks if t >= t0)
            print('rate', (marks[-1][1] - n0) * 8 / (marks[-1][0] - t0) / 1e6, flush=True)
            """),
            name="sink",
        )
        tb.wait_for_log(sink, "sink", "listening", host="b", timeout=30)
        _in(
            tb,
            "a",
            f"""
            import socket, time
            s = socket.create_connection(('{tb.ip("b")}', 7003), 10); buf = bytes(1 << 20)
            end = time.monotonic() + 3.5
            while time.monotonic() < end: s.sendall(buf)
            s.close()""",
        )
        sink.wait(30)
        rate = float(tb.log("sink").split("rate")[1])
    # TCP goodput is the link rate less the headers (about 4 % at a 1500-byte MTU).
    assert abs(rate - 40) / 40 <= 0.15, rate


@needs_delay_line
async def test_two_agents_in_two_namespaces_through_nats_in_a_third() -> None:
    from kvbus.app.testbed.fabric import Testbed
    from kvbus.app.testbed.services import start_nats, start_scheduler
    from kvbus.app.testbed.worker import Worker

    with Testbed(from_dict(THREE_HOSTS)) as tb:
        url = start_nats(tb)
        start_scheduler(tb, "g", url)
        a, b = await asyncio.gather(Worker.on_host(tb, "a", "worker-a"), Worker.on_host(tb, "b", "worker-b"))
        try:
            await a.call("kvbus.app.testbed.ops:agent", url=url, name="sender", group="g")
            await b.call("kvbus.app.testbed.ops:agent", url=url, name="receiver", group="g")
            for seed, nbytes in ((1, 20_000), (2, 6 << 20)):  # inline, and streamed in chunks
                got = b.submit("kvbus.app.testbed.ops:receive_digest", receiver="receiver", timeout=120)
                sent = await a.call(
                    "kvbus.app.testbed.ops:send_random", sender="sender", to="receiver", nbytes=nbytes, seed=seed
                )
                arrived = await got
                assert arrived["src"] == "sender"
                assert arrived["digest"] == sent["digest"]
            assert sent["chunks"] > 1
            # Two hosts: the streamed payload went on the direct tcp path between their namespaces (each
            # process is told its host's identity and address), not on shm across the shared /dev/shm,
            # and not back on NATS because the address offered was the machine's, outside the testbed.
            assert sent["path"] == "tcp", sent
        finally:
            await a.close()
            await b.close()
        if tb.delay_backend == "nfqueue":
            stats = tb.delayline_stats()
            assert stats is not None and stats["accepted"] > 0  # the transfers crossed the delay line


@needs_delay_line
def test_links_change_on_schedule() -> None:
    """The schedule's steps reach the kernel's queues in order (htb's rate on both ends of the link)."""
    from kvbus.app.testbed.fabric import Testbed

    topo = from_dict(
        {
            **THREE_HOSTS,
            "schedule": [
                {"at_s": 0.2, "link": "host:b", "rate_mbit": 10},
                {"at_s": 0.6, "link": "host:b", "rate_mbit": 25, "delay_ms": 0},
            ],
        }
    )
    with Testbed(topo) as tb:
        assert tb.links["host:b"].rate_mbit == 40
        seen = []
        tb.start_schedule()
        for _ in range(200):
            rate = tb.links["host:b"].rate_mbit
            if not seen or seen[-1] != rate:
                seen.append(rate)
            if rate == 25:
                break
            time.sleep(0.02)
        tb.stop_schedule()
        # In the schedule's order (a loaded machine may poll past the first step).
        assert seen in ([40, 10, 25], [40, 25], [10, 25]), seen
        for ns, dev in ((tb.ns("b"), "eth0"), (tb.switch_ns, f"p{2}")):
            shown = subprocess.run(["tc", "-n", ns, "class", "show", "dev", dev], capture_output=True, text=True).stdout
            assert "rate 25Mbit" in shown, shown
        assert tb.links["host:b"].delay_ms == 0


@needs_delay_line
def test_clean_removes_everything_after_the_builder_was_killed(tmp_path: Path) -> None:
    path = tmp_path / "three.toml"
    path.write_text(
        textwrap.dedent("""
        name = "three"
        [[racks]]
        name = "r"
        [[hosts]]
        name = "nats"
        [[hosts]]
        name = "a"
        link = { rate_mbit = 100, delay_ms = 2 }
        [[hosts]]
        name = "b"
        [services]
        nats = "nats"
        [[groups]]
        name = "g"
        scheduler = "nats"
        hosts = ["a", "b"]
        """)
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    builder = subprocess.Popen(
        [sys.executable, "-m", "kvbus.app.cli", "testbed", "up", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert builder.stdout is not None
    first = ""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and builder.poll() is None:
        first = builder.stdout.readline()
        if "is up" in first:
            break
    assert "is up" in first, first
    run_id = first.split()[1]
    prefix = runs.namespace_prefix(run_id)
    spaces = [n for n in netns.namespaces() if n.startswith(prefix)]
    left = sorted({p for n in spaces for p in netns.pids(n)})
    assert len(spaces) == 4 and left  # nats-server and the scheduler run inside
    os.kill(builder.pid, signal.SIGKILL)
    builder.wait()
    # Nothing went away by itself.
    assert [n for n in netns.namespaces() if n.startswith(prefix)] == spaces
    assert (runs.base_dir() / run_id).exists()
    stale = [r for r in runs.list_runs() if r.run_id == run_id]
    assert stale and not stale[0].alive
    out = subprocess.run(
        [sys.executable, "-m", "kvbus.app.cli", "testbed", "clean"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert not [n for n in netns.namespaces() if n.startswith(prefix)]
    assert all(runs.process_start(p) is None for p in left)
    assert not (runs.base_dir() / run_id).exists()
    assert all(r.run_id != run_id for r in runs.list_runs())


@needs_testbed
def test_clean_leaves_alone_a_run_it_has_no_folder_for() -> None:
    """A run of another base folder (another test session's or user's ``TMPDIR``) is not known to
    be stale: `clean` keeps it (a concurrent session's bench lost its workers to another's
    `clean`), and removes it only when named or with ``everything``."""
    import secrets

    run_id = secrets.token_hex(4)
    ns = runs.namespace_prefix(run_id) + "elsewhere"
    netns.add(ns)
    try:
        assert not (runs.base_dir() / run_id).exists()
        kept = runs.clean()
        assert ns in netns.namespaces() and kept["kept"] >= 1
        removed = runs.clean(run_id=run_id)
        assert removed["runs"] == 1 and ns not in netns.namespaces()
    finally:
        if ns in netns.namespaces():
            netns.delete(ns)


def test_check_says_why_without_root() -> None:
    """As an unprivileged user `kvbus testbed check` says the testbed needs root (exit 1)."""
    if os.geteuid() != 0:
        out = subprocess.run(
            [sys.executable, "-m", "kvbus.app.cli", "testbed", "check"], capture_output=True, text=True, timeout=60
        )
    else:
        probe = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                sys.executable,
                "-c",
                "import kvbus.app.testbed.netns",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if probe.returncode != 0:
            pytest.skip("this interpreter cannot be run by an unprivileged user here")
        out = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                sys.executable,
                "-m",
                "kvbus.app.cli",
                "testbed",
                "check",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "HOME": "/tmp"},
        )
    assert out.returncode == 1
    assert "needs root" in out.stdout and "emulated" in out.stdout
    data = json.dumps(CAPS.as_dict())
    assert "delay" in data


@needs_testbed
def test_entered_moves_this_thread_into_a_namespace_and_back() -> None:
    import socket
    import uuid

    ns = f"{netns.PREFIX}t{uuid.uuid4().hex[:8]}-probe"
    netns.add(ns)
    try:
        outside = {name for _, name in socket.if_nameindex()}
        with netns.entered(ns):
            assert {name for _, name in socket.if_nameindex()} == {"lo"}  # a fresh namespace: loopback only
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))  # its own loopback, up
        assert {name for _, name in socket.if_nameindex()} == outside
        with pytest.raises(OSError), netns.entered(f"{netns.PREFIX}no-such-namespace"):
            pass
    finally:
        netns.delete(ns)
