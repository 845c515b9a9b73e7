"""`kvbus selftest`: one real transfer through a running deployment (used by `helm test`)."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from typing import Any

import torch

from kvbus.bus import Bus
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

SIG = ModelSignature("kvbus-selftest", n_layers=4, n_kv_heads=2, head_dim=64, dtype="float32", vocab_size=1000)


async def selftest(nats_url: str, group: str, nbytes: int = 4 << 20, timeout: float = 60.0, *,
                   nats_options: dict[str, Any] | None = None) -> int:
    """Send a random context from one agent to another in ``group``; 0 when it arrives bit-exact.

    ``nats_options`` go to `nats.connect` (credentials, TLS).
    """
    n = max(1, nbytes // SIG.kv_bytes_per_token())
    g = torch.Generator().manual_seed(0)
    shape = (1, SIG.n_kv_heads, n, SIG.head_dim)
    kv = KVCache(torch.randint(0, SIG.vocab_size, (1, n), generator=g), SIG,
                 [torch.randn(shape, generator=g) for _ in range(SIG.n_layers)],
                 [torch.randn(shape, generator=g) for _ in range(SIG.n_layers)])
    tag = uuid.uuid4().hex[:8]
    bus = await Bus.connect(nats_url, **(nats_options or {}))
    try:
        tx = await bus.agent(f"selftest-tx-{tag}", group=group, signature=SIG)
        rx = await bus.agent(f"selftest-rx-{tag}", group=group, signature=SIG)
        t0 = time.perf_counter()
        report = await asyncio.wait_for(tx.send(rx.name, kv, medium="full"), timeout)
        delivery = await rx.receive(timeout=timeout)
        ok = delivery.kv.equal(kv)
        print(f"selftest {'OK' if ok else 'FAILED'}: {report.nbytes} bytes via group {group} in "
              f"{(time.perf_counter() - t0) * 1000:.0f} ms ({report.chunks} chunks, medium {report.medium})",
              flush=True)
        return 0 if ok else 1
    except Exception as exc:  # noqa: BLE001 - report any failure as the test's result
        print(f"selftest FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        await bus.close()
