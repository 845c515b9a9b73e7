"""Encode throughput of the quantising codecs (to compare checkouts: the NaN/inf check must cost nothing).

Usage: ``.venv/bin/python scripts/measure_encode.py [--mb 64] [--runs 7]``; run it against another
checkout with ``PYTHONPATH`` pointing at its ``kvbus``. Prints the median encode time and GB/s of
``int8``, ``int4`` and ``lowrank`` over a Llama-3-8B-shaped bf16 cache of about ``--mb`` MB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--media", default="int8,int4,lowrank")
    args = parser.parse_args()

    from kvbus.codecs import get_codec
    from kvbus.kvcache import KVCache
    from kvbus.signature import ModelSignature

    torch.set_num_threads(1)
    sig = ModelSignature("enc-model", n_layers=32, n_kv_heads=8, head_dim=128, dtype="bfloat16", vocab_size=32000)
    n = (args.mb << 20) // sig.kv_bytes_per_token()
    g = torch.Generator().manual_seed(0)
    shape = (1, sig.n_kv_heads, n, sig.head_dim)
    kv = KVCache(
        torch.randint(0, 32000, (1, n), generator=g),
        sig,
        [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(sig.n_layers)],
        [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(sig.n_layers)],
    )
    out = {}
    for medium in args.media.split(","):
        codec = get_codec(medium)
        codec.encode(kv)  # warm up
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            codec.encode(kv)
            times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        out[medium] = {"encode_ms_median": round(median * 1000, 1), "gbps": round(kv.nbytes / 1e9 / median, 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
