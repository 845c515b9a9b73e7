"""`kvbus bench codecs`: encode / decode throughput of every medium against a plain copy.

Caches: Llama-3-8B-shaped (32 layers, 8 KV heads, head dim 128, bf16) at 512 and 4096 tokens
(``--quick`` skips 4096), and SmolLM2-135M-shaped (30 layers, 3 KV heads, head dim 64, fp32) at
512 tokens. The keys and values are random normals with a few outlier key channels (as real
keys have), so the quantisers see realistic ranges.

Per medium and cache: ``encode_gbps`` / ``decode_gbps`` (uncompressed KV bytes per second),
``ratio`` (``full`` bytes / medium bytes), ``rel_error`` (||decoded - original|| / ||original||,
dropped entries counted as zeros), and ``encode_vs_copy`` / ``decode_vs_copy``: the time of
``dst.copy_(src)`` of the same KV tensors into reused buffers divided by the medium's time,
measured in the same run, alternating with it (median of the runs). A medium whose encoded
buffers alias the cache's tensors (``full``), or whose decoded tensors view the received
payload, copies no byte: its ratio is reported as `ZERO_COPY_RATIO` (``zero_copy_encode`` /
``zero_copy_decode`` true), and the timed ratio (which only measures the Python bookkeeping)
as ``*_vs_copy_timed``.

The quantising codecs run the fused C kernels (`kvbus.codecs._native`, built before the suite
starts) where they apply (bfloat16 and float32 caches), spreading layers over two threads; the
suite also measures ``int8`` and ``int4`` with the torch kernels in the same run
(``results.other_kernels``, mode ``torch``: eager, or compiled with ``KVBUS_COMPILE=1``), and
says which kernels the default was (``config.kernels``: ``c``, or ``torch-eager`` /
``torch-compiled`` when the C kernels are off, with ``config.c_kernels_off`` saying why).
``results.<codec>`` (top level) are the figures on the Llama-shaped 512-token cache in the
process's default mode; ``results.by_cache`` has every cache. ``results.first_call_s``: per medium of
`FIRST_CALL_SPECS`, the first ``encode`` + ``decode`` of the Llama-shaped 512-token cache in a
fresh subprocess (in the process's default kernel mode, the built kernels in their cache),
imports and cache construction excluded; ``results.first_call_cold_s`` the same with an empty
kernel cache (the build then runs in the background and the torch kernels serve the call).
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from kvbus.codecs import Encoded, _kernels, _native, get_codec
from kvbus.codecs._select import kv_positions
from kvbus.codecs.spec import medium_spec
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature

LLAMA3_8B = ModelSignature(
    "llama-3-8b-shape",
    n_layers=32,
    n_kv_heads=8,
    head_dim=128,
    dtype="bfloat16",
    vocab_size=128256,
    rope_theta=500000.0,
)
SMOLLM2 = ModelSignature(
    "smollm2-135m-shape", n_layers=30, n_kv_heads=3, head_dim=64, dtype="float32", vocab_size=49152, rope_theta=100000.0
)
#: Media benchmarked (``delta+int8`` against a base holding 7/8 of the context).
SPECS = ("full", "int8", "int4", "topk", "topk+int8", "lowrank", "delta+int8", "tokens")
#: Reported when a medium's time is too small to measure against the copy (no pass over the data).
ZERO_COPY_RATIO = 1000.0


def make_kv(signature: ModelSignature, n_tokens: int, seed: int = 0) -> KVCache:
    """Random KV with outlier key channels, in the signature's dtype."""
    g = torch.Generator().manual_seed(seed)
    shape = (1, signature.n_kv_heads, n_tokens, signature.head_dim)
    dtype = signature.torch_dtype
    outliers = torch.ones(signature.head_dim)
    outliers[torch.randperm(signature.head_dim, generator=g)[:4]] = 8.0
    keys = [(torch.randn(shape, generator=g) * outliers).to(dtype) for _ in range(signature.n_layers)]
    values = [torch.randn(shape, generator=g).to(dtype) for _ in range(signature.n_layers)]
    tokens = torch.randint(0, signature.vocab_size, (1, n_tokens), generator=g)
    return KVCache(tokens, signature, keys, values)


def _wire(encoded: Encoded) -> Encoded:
    return Encoded.from_payload(encoded.codec, dict(encoded.meta), b"".join(encoded.buffers), encoded.sizes)


def rel_error(original: KVCache, decoded: KVCache) -> float:
    """||decoded - original|| / ||original|| over all KV (entries a medium dropped count as zeros)."""
    if not decoded.has_kv:
        return math.nan
    pos = kv_positions(decoded)
    err = norm = 0.0
    for a, b in zip(original.keys + original.values, decoded.keys + decoded.values):
        af = a.float()
        norm += float(af.square().sum())
        full = torch.zeros_like(af)
        full[:, :, pos] = b.float()
        err += float((full - af).square().sum())
    return math.sqrt(err / norm) if norm else 0.0


def _aliases(encoded: Encoded, kv: KVCache) -> bool:
    """True when every KV tensor's bytes go on the wire as they are (the encoded buffers alias them)."""
    from kvbus.codecs._tensors import buffer_address

    addresses = {buffer_address(b) for b in encoded.buffers if b.nbytes}
    return bool(kv.keys) and all(t.data_ptr() in addresses for t in kv.keys + kv.values)


def _aliases_payload(decoded: KVCache, wire: Encoded) -> bool:
    """True when every decoded KV tensor views the received payload (no byte copied)."""
    from kvbus.codecs._tensors import buffer_address

    payload = memoryview(wire.keepalive[0])
    start = buffer_address(payload)
    return bool(decoded.keys) and all(
        start <= t.data_ptr() < start + payload.nbytes for t in decoded.keys + decoded.values
    )


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def bench_cache(kv: KVCache, specs: tuple[str, ...], runs: int) -> dict[str, dict[str, Any]]:
    """Every medium on one cache: throughputs and ratios against ``copy_`` in the same run."""
    tensors = kv.keys + kv.values
    kv_bytes = sum(t.numel() * t.element_size() for t in tensors)
    dst = [torch.empty_like(t) for t in tensors]

    def copy() -> None:
        for d, s in zip(dst, tensors):
            d.copy_(s)

    full_bytes = get_codec("full").encode(kv).nbytes
    base = kv.slice(0, kv.n_tokens * 7 // 8).token_only()
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        codec = get_codec(spec)
        delta = medium_spec(spec).delta
        enc_args: dict[str, Any] = {"base": base} if delta else {}
        dec_base = kv.slice(0, kv.n_tokens * 7 // 8) if delta else None
        encoded = codec.encode(kv, **enc_args)  # warm-up (and the first-call costs of a kernel)
        wire = _wire(encoded)
        decoded = codec.decode(wire, base=dec_base)
        encode = functools.partial(codec.encode, kv, **enc_args)
        decode = functools.partial(codec.decode, wire, base=dec_base)
        copies, encs, decs = [], [], []
        for _ in range(runs):
            copies.append(_timed(copy)[0])
            encs.append(_timed(encode)[0])
            copies.append(_timed(copy)[0])
            decs.append(_timed(decode)[0])
        t_copy, t_enc, t_dec = statistics.median(copies), statistics.median(encs), statistics.median(decs)

        zero_enc = _aliases(encoded, kv)
        zero_dec = _aliases_payload(decoded, wire)

        def vs_copy(t: float, zero: bool, t_copy: float = t_copy) -> float:
            return ZERO_COPY_RATIO if zero or t * ZERO_COPY_RATIO <= t_copy else round(t_copy / t, 3)

        out[codec.name] = {
            "encode_gbps": round(kv_bytes / t_enc / 1e9, 3),
            "decode_gbps": round(kv_bytes / t_dec / 1e9, 3),
            "ratio": round(full_bytes / max(1, encoded.nbytes), 3),
            "rel_error": round(rel_error(kv, decoded), 5) if decoded.has_kv else None,
            "encode_vs_copy": vs_copy(t_enc, zero_enc),
            "decode_vs_copy": vs_copy(t_dec, zero_dec),
            "encode_vs_copy_timed": round(t_copy / t_enc, 3),
            "decode_vs_copy_timed": round(t_copy / t_dec, 3),
            "zero_copy_encode": zero_enc,
            "zero_copy_decode": zero_dec,
            "copy_gbps": round(kv_bytes / t_copy / 1e9, 3),
            "bytes": encoded.nbytes,
            "runs": runs,
        }
        print(
            f"  {codec.name:>12}: enc {out[codec.name]['encode_gbps']:7.2f} GB/s ({out[codec.name]['encode_vs_copy']}"
            f" x copy)  dec {out[codec.name]['decode_gbps']:7.2f} GB/s ({out[codec.name]['decode_vs_copy']} x copy)"
            f"  ratio {out[codec.name]['ratio']:7.2f}  copy {out[codec.name]['copy_gbps']:.1f} GB/s",
            flush=True,
        )
    return out


class _SkipOther(Exception):
    """Internal: a smoke run leaves out the other kernel mode."""


#: Media whose first call ``results.first_call_s`` times (the kernels a transfer may meet cold).
FIRST_CALL_SPECS = ("int8", "int4", "topk", "lowrank")

_FIRST_CALL = """
import json, sys, time
from kvbus.app.bench.codecs import LLAMA3_8B, _wire, make_kv
from kvbus.codecs import get_codec
kv = make_kv(LLAMA3_8B, int(sys.argv[2]))
t0 = time.perf_counter()
codec = get_codec(sys.argv[1])
codec.decode(_wire(codec.encode(kv)))
print(json.dumps(time.perf_counter() - t0), flush=True)
from kvbus.codecs import _native
_native.prepare()  # a build the call started finishes before the process ends (no orphaned compiler)
"""


def first_call_s(spec: str, n_tokens: int, kernel_cache: str | None = None) -> float:
    """Seconds of the first ``encode`` + ``decode`` of ``spec`` in a fresh interpreter.

    The Llama-shaped cache of ``n_tokens``; the interpreter's start, the imports and the cache's
    construction are outside the timing, so it is what a cold agent pays on its first transfer.
    ``kernel_cache``: the C kernels' cache folder (`kvbus.codecs._native.CACHE_ENV`; default
    the process's).
    """
    env = dict(os.environ)
    if kernel_cache is not None:
        env[_native.CACHE_ENV] = kernel_cache
    out = subprocess.run(
        [sys.executable, "-c", _FIRST_CALL, spec, str(n_tokens)], check=True, capture_output=True, text=True, env=env
    )
    return float(json.loads(out.stdout.strip().splitlines()[0]))


def _kernel_mode() -> str:
    if _native.available():
        return "c"
    return "torch-compiled" if _kernels.compile_enabled() else "torch-eager"


def run(*, quick: bool = False, smoke: bool = False, **options: Any) -> dict[str, Any]:
    """Run the suite; returns ``{"suite": "codecs", "config": {...}, "results": {...}}``.

    ``smoke``: the same keys from 64-token caches, one run each, without the other kernel mode
    (compiling takes seconds); its figures mean nothing.
    """
    n512 = 64 if smoke else 512
    caches = {"llama3-8b-512": (LLAMA3_8B, n512), "smollm2-512": (SMOLLM2, n512)}
    if not quick:
        caches["llama3-8b-4096"] = (LLAMA3_8B, 4096)
    runs = 1 if smoke else 3 if quick else 7
    _native.prepare()  # built (or loaded) now, not during the first measurement
    mode = _kernel_mode()
    by_cache: dict[str, Any] = {}
    other: dict[str, Any] = {}
    try:
        for label, (sig, n) in caches.items():
            kv = make_kv(sig, n)
            print(f"{label} ({kv.nbytes / 1e6:.0f} MB), kernels {mode}:", flush=True)
            by_cache[label] = bench_cache(kv, SPECS, runs if n <= 512 else max(2, runs // 2))
        # the quantisers with the torch kernels, on the Llama 512 cache, in the same run
        if smoke or mode != "c":
            raise _SkipOther()
        _native.set_enabled(False)
        kv = make_kv(LLAMA3_8B, 512)
        t0 = time.perf_counter()
        for spec in ("int8", "int4"):
            codec = get_codec(spec)
            codec.decode(_wire(codec.encode(kv)))
        warm = time.perf_counter() - t0
        torch_mode = "torch-compiled" if _kernels.compile_enabled() else "torch-eager"
        print(f"llama3-8b-512, kernels {torch_mode} (first calls took {warm:.1f} s):", flush=True)
        other = {
            "mode": torch_mode,
            "first_call_s": round(warm, 1),
            "llama3-8b-512": bench_cache(kv, ("int8", "int4"), runs),
        }
    except _SkipOther:
        other = {"mode": "torch", "skipped": "smoke run" if smoke else f"the default already is {mode}"}
    finally:
        _native.set_enabled(None)
    top = by_cache["llama3-8b-512"]
    first_call = {spec: round(first_call_s(spec, n512), 3) for spec in FIRST_CALL_SPECS}
    print(f"first calls in a fresh process (s): {first_call}", flush=True)
    cold = {}
    for spec in FIRST_CALL_SPECS[:2]:  # an empty cache each: every one pays (or dodges) the build
        with tempfile.TemporaryDirectory(prefix="kvbus-kernels-", ignore_cleanup_errors=True) as empty:
            cold[spec] = round(first_call_s(spec, n512, kernel_cache=empty), 3)
    print(f"first calls with an empty kernel cache (s): {cold}", flush=True)
    return {
        "suite": "codecs",
        "config": {
            "network": "none",
            "caches": {
                k: {
                    "model": s.model,
                    "layers": s.n_layers,
                    "kv_heads": s.n_kv_heads,
                    "head_dim": s.head_dim,
                    "dtype": s.dtype,
                    "tokens": n,
                }
                for k, (s, n) in caches.items()
            },
            "runs": runs,
            "kernels": mode,
            "c_kernels_off": _native.why_not(),
            "codec_threads": _native.threads(),
            "timing": "median of alternating runs; *_vs_copy = copy_ time / medium time, same run",
            "specs": list(SPECS),
        },
        "results": {
            **top,
            "by_cache": by_cache,
            "other_kernels": other,
            "first_call_s": first_call,
            "first_call_cold_s": cold,
        },
    }
