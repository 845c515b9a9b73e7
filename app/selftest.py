"""`kvbus selftest`: one real transfer through a running deployment (used by `helm test`)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from collections.abc import Mapping
from typing import Any

import torch

from kvbus.bus import Bus
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

SIG = ModelSignature("kvbus-selftest", n_layers=4, n_kv_heads=2, head_dim=64, dtype="float32", vocab_size=1000)


#: The environment of `helm test`: each agent's name, and <VAR>_URL (with its credentials) and
#: <VAR>_INBOX_PREFIX, when every agent logs in as its own user (kvbus.security's scheme).
AGENT_VARS = ("KVBUS_SELFTEST_SENDER", "KVBUS_SELFTEST_RECEIVER")


def agents_from_env(environ: Mapping[str, str] | None = None) -> list[tuple[str, str, dict[str, Any]]] | None:
    """The sender's and receiver's (name, url, nats options) from `AGENT_VARS`, or None."""
    env = os.environ if environ is None else environ
    if AGENT_VARS[0] not in env:
        return None
    return [(env[v], env[f"{v}_URL"], {"inbox_prefix": env[f"{v}_INBOX_PREFIX"]}) for v in AGENT_VARS]


async def selftest(
    nats_url: str,
    group: str,
    nbytes: int = 4 << 20,
    timeout: float = 60.0,
    *,
    nats_options: dict[str, Any] | None = None,
    agents: list[tuple[str, str, dict[str, Any]]] | None = None,
) -> int:
    """Send a random context from one agent to another in ``group``; 0 when it arrives bit-exact.

    ``nats_options`` go to `nats.connect` (credentials, TLS). ``agents``: the sender's and the
    receiver's (name, url, options) when each logs in as its own user, on its own secure bus;
    default: two agents with random names on one connection to ``nats_url``.
    """
    n = max(1, nbytes // SIG.kv_bytes_per_token())
    g = torch.Generator().manual_seed(0)
    shape = (1, SIG.n_kv_heads, n, SIG.head_dim)
    kv = KVCache(
        torch.randint(0, SIG.vocab_size, (1, n), generator=g),
        SIG,
        [torch.randn(shape, generator=g) for _ in range(SIG.n_layers)],
        [torch.randn(shape, generator=g) for _ in range(SIG.n_layers)],
    )
    buses: list[Bus] = []
    try:
        if agents:
            for _, url, options in agents:
                buses.append(await Bus.connect(url, secure=True, **{**(nats_options or {}), **options}))
            names = [name for name, _, _ in agents]
        else:
            tag = uuid.uuid4().hex[:8]
            buses = [await Bus.connect(nats_url, **(nats_options or {}))] * 2
            names = [f"selftest-tx-{tag}", f"selftest-rx-{tag}"]
        tx = await buses[0].agent(names[0], group=group, signature=SIG)
        rx = await buses[1].agent(names[1], group=group, signature=SIG)
        t0 = time.perf_counter()
        report = await asyncio.wait_for(tx.send(rx.name, kv, medium="full"), timeout)
        delivery = await rx.receive(timeout=timeout)
        ok = delivery.kv.equal(kv)
        print(
            f"selftest {'OK' if ok else 'FAILED'}: {report.nbytes} bytes via group {group} in "
            f"{(time.perf_counter() - t0) * 1000:.0f} ms ({report.chunks} chunks, medium {report.medium})",
            flush=True,
        )
        return 0 if ok else 1
    except Exception as exc:  # noqa: BLE001 - report any failure as the test's result
        print(f"selftest FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for bus in dict.fromkeys(buses):
            await bus.close()


def check_bucket_replicas(monitor_url: str, expected: int, *, timeout: float = 60.0) -> int:
    """0 when every kvbus KV bucket (stream ``KV_kvbus_*``) the NATS monitoring endpoint at
    ``monitor_url`` lists has ``expected`` replicas, a leader and no peer offline; else 1.

    (How current each follower is only the stream's leader knows: the server that answers lists
    its peers as it sees them, so that is shown, not required.)

    Asked again until ``timeout`` (a bucket just upgraded catches up first). Prints what it found.
    """
    import json
    import urllib.request

    url = monitor_url.rstrip("/") + "/jsz?accounts=true&streams=true&config=true"
    deadline = time.monotonic() + timeout
    found: dict[str, tuple[int, str | None, bool]] = {}
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                jsz = json.loads(resp.read())
            found = {}
            for account in jsz.get("account_details") or []:
                for stream in account.get("stream_detail") or []:
                    name = str(stream.get("name", ""))
                    if not name.startswith("KV_kvbus_"):
                        continue
                    cluster = stream.get("cluster") or {}
                    peers = cluster.get("replicas") or []
                    replicas = int((stream.get("config") or {}).get("num_replicas") or 1 + len(peers))
                    offline = sum(1 for p in peers if p.get("offline"))
                    complete = not cluster or (len(peers) + 1 == replicas and not offline)
                    found[name[3:]] = (replicas, cluster.get("leader") or ("-" if not cluster else None), complete)
            ok = bool(found) and all(r == expected and leader and full for r, leader, full in found.values())
        except (OSError, ValueError) as exc:
            ok, found = False, {}
            print(f"selftest: NATS monitoring at {monitor_url} did not answer: {exc}", file=sys.stderr, flush=True)
        if ok or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    for name, (replicas, leader, complete) in sorted(found.items()):
        peers = "every peer online" if complete else "a peer missing or offline"
        print(f"bucket {name}: {replicas} replica(s), leader {leader}, {peers}", flush=True)
    if not ok:
        print(
            f"selftest FAILED: kvbus buckets should have {expected} replica(s), a leader, every peer online",
            file=sys.stderr,
        )
        return 1
    print(f"selftest OK: {len(found)} bucket(s) with {expected} replica(s)", flush=True)
    return 0
