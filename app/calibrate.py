"""`kvbus calibrate`: measure every medium on SmolLM2 and save the calibration profile.

For each shipped text window (``kvbus/data/calibration_*.txt``: three passages written for
kvbus and excerpts of two software licences), the first `CONTEXT` tokens are the context and
the next `FOLLOWING` tokens the continuation. The context is prefilled; each medium encodes
its KV (with the sender's runner, as the bus does), decodes it (with the receiver's runner),
and the decoded context is scored teacher-forced on the continuation against the
uncompressed cache (`HFRunner.score`):

- ``kl``: mean next-token KL(uncompressed || decoded) over the continuation (nats);
- ``top1``: fraction of continuation positions whose greedy token agrees;
- ``nll_delta``: mean change of the continuation's NLL per token (nats; > 0 is worse);
- ``rel_error``: ||decoded - original|| / ||original|| over all keys and values, with
  entries a medium dropped (``topk``) counted as zeros; 1.0 for ``summary`` (nothing of the
  original KV arrives);
- ``ratio``: bytes of the ``full`` encoding / bytes of the medium's encoding;
- ``encode_gbps`` / ``decode_gbps``: uncompressed KV bytes per second (best of the repeats;
  ``tokens`` and ``summary`` include the receiver's prefill in decode, ``summary`` the
  sender's generation in encode).

Also the model's prefill throughput over the context and its greedy per-token decode time.
The fidelity factor of each medium is derived as `kvbus.codecs.calibration.fidelity_from`.
"""

from __future__ import annotations

import datetime as _dt
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from kvbus.codecs import Encoded, get_codec
from kvbus.codecs._select import kv_positions
from kvbus.codecs.calibration import (
    PROFILE_VERSION,
    SPLIT_PROBE,
    CalibrationProfile,
    CodecFigures,
    fidelity_from,
    save_profile,
    user_profile_path,
)
from kvbus.codecs.spec import medium_spec
from kvbus.kvcache import KVCache

logger = logging.getLogger(__name__)

#: Context tokens per window.
CONTEXT = 512
#: Continuation tokens scored per window.
FOLLOWING = 64
#: The media measured (canonical specs). ``delta+X`` costs what X costs on the new tokens.
SPECS = (
    "full",
    "int8",
    "int4",
    "int4(64)",
    "topk",
    "topk(0.5)",
    "topk+int8",
    "topk+int4",
    "lowrank",
    "lowrank(128)",
    "tokens",
    "summary",
)
#: Windows and timing repeats: (quick, full).
WINDOWS = (2, 6)
REPEATS = (2, 4)
#: Context lengths the fidelity of each lossy medium is also measured at (full runs): a medium's
#: error can grow or shrink with the context, and the cost model charges the one at the
#: transfer's length (`MediumFigures.fidelity_at`), not the one at `CONTEXT` for every length.
LENGTHS = (128, 256, 512, 1024, 2048)
#: Continuation tokens per window of the per-length measurement (the cost model's default
#: ``output_tokens``: the length of the answer whose agreement the loss term charges).
LENGTH_FOLLOWING = 128
#: Windows per length, at most (fewer where the texts are too short).
LENGTH_WINDOWS = 8
#: The lossy media whose fidelity is also measured behind a recomputed prefix (``split``'s inner
#: media that the selector offers).
SPLIT_MEDIA = ("int8", "int4")


def calibration_texts() -> list[str]:
    """The shipped calibration texts, in name order."""
    folder = resources.files("kvbus.data")
    names = sorted(p.name for p in folder.iterdir() if p.name.startswith("calibration_") and p.name.endswith(".txt"))
    return [(folder / n).read_text(encoding="utf-8") for n in names]


def windows(tokenizer: Any, n: int, length: int = CONTEXT + FOLLOWING) -> list[torch.Tensor]:
    """Up to ``n`` windows of ``length`` token ids ``[1, length]``, round-robin over the texts."""
    streams = [tokenizer(t, return_tensors="pt").input_ids for t in calibration_texts()]
    out: list[torch.Tensor] = []
    offset = 0
    while len(out) < n:
        added = False
        for ids in streams:
            if ids.shape[1] >= offset + length and len(out) < n:
                out.append(ids[:, offset : offset + length])
                added = True
        if not added:
            break
        offset += length
    if not out:
        raise RuntimeError(f"no calibration text has {length} tokens")
    return out


def _best(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, result = math.inf, None
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t)
    return best, result


def _wire(encoded: Encoded) -> Encoded:
    """What a receiver gets: one contiguous payload split back into buffers."""
    return Encoded.from_payload(encoded.codec, dict(encoded.meta), b"".join(encoded.buffers), encoded.sizes)


def rel_error(original: KVCache, decoded: KVCache) -> float:
    """Relative L2 error of ``decoded``'s KV against ``original``'s (dropped entries count as zeros)."""
    if not decoded.has_kv or decoded.n_tokens != original.n_tokens or not original.has_kv:
        return 1.0
    pos = kv_positions(decoded)
    err = norm = 0.0
    for a, b in zip(original.keys + original.values, decoded.keys + decoded.values):
        af = a.double()
        norm += float(af.square().sum())
        full = torch.zeros_like(af)
        full[:, :, pos] = b.double()
        err += float((full - af).square().sum())
    return math.sqrt(err / norm) if norm else 0.0


def compare(ref_logits: torch.Tensor, logits: torch.Tensor, following: torch.Tensor) -> tuple[float, float, float]:
    """``(kl, top1, nll_delta)`` of ``logits`` against ``ref_logits`` on the true continuation."""
    lp = ref_logits.log_softmax(-1)
    lq = logits.log_softmax(-1)
    kl = float((lp.exp() * (lp - lq)).sum(-1).mean())
    top1 = float((lp.argmax(-1) == lq.argmax(-1)).float().mean())
    idx = following.unsqueeze(-1)
    nll_ref = -lp.gather(-1, idx).mean()
    nll = -lq.gather(-1, idx).mean()
    return max(kl, 0.0), top1, float(nll - nll_ref)


def fidelity_by_length(
    runner: Any,
    tokenizer: Any,
    specs: tuple[str, ...],
    *,
    lengths: tuple[int, ...] = LENGTHS,
    n_windows: int = LENGTH_WINDOWS,
    following: int = LENGTH_FOLLOWING,
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict[int, float]]:
    """Each lossy medium's fidelity factor at each context length: `fidelity_from` of the mean
    top-1 and KL over up to ``n_windows`` windows of the texts (``following`` continuation tokens
    each, scored teacher-forced against the uncompressed context of that length).

    ``summary`` is left out (its fidelity is not a property of the KV's precision, and it costs a
    generation per window); lossless media are 1 everywhere and are not listed. A length no text
    window reaches is left out too.
    """
    say = progress or (lambda _line: None)
    lossy = [s for s in specs if not get_codec(s).lossless and medium_spec(s).outer != "summary"]
    top1: dict[tuple[str, int], list[float]] = {}
    kls: dict[tuple[str, int], list[float]] = {}
    for n in lengths:
        try:
            wins = windows(tokenizer, n_windows, n + following)
        except RuntimeError:
            continue
        for ids in wins:
            ctx, cont = ids[:, :n], ids[:, n:]
            kv = runner.prefill(ctx)
            ref = runner.score(kv, cont)
            for spec in lossy:
                codec = get_codec(spec)
                got = codec.decode(_wire(codec.encode(kv, runner=runner)), runner=runner)
                kl, t1, _ = compare(ref, runner.score(got, cont), cont)
                top1.setdefault((spec, n), []).append(t1)
                kls.setdefault((spec, n), []).append(kl)
        say(f"fidelity at {n} tokens over {len(wins)} windows of {following} following tokens")
    out: dict[str, dict[int, float]] = {}
    for (spec, n), t1s in top1.items():
        f = fidelity_from(statistics.fmean(t1s), statistics.fmean(kls[(spec, n)]))
        out.setdefault(get_codec(spec).name, {})[n] = f
    return out


def behind_prefix(
    runner: Any, kv: KVCache, ref: torch.Tensor, following: torch.Tensor, inner: str
) -> tuple[float, float]:
    """``(kl, top1)`` of ``split(SPLIT_PROBE)+inner`` on one window, scored as `measure` scores
    ``inner`` alone (``kv`` its prefilled context, ``ref`` the uncompressed logits on
    ``following``): the receiver recomputes the first tokens exact and takes ``inner`` for the rest."""
    codec = get_codec(f"split({SPLIT_PROBE})+{inner}")
    got = codec.decode(_wire(codec.encode(kv, runner=runner)), runner=runner)
    kl, top1, _ = compare(ref, runner.score(got, following), following)
    return kl, top1


def prefill_by_length(
    runner: Any, tokenizer: Any, *, lengths: tuple[int, ...] = LENGTHS, rounds: int = 3
) -> dict[int, float]:
    """The model's prefill seconds of a context of each length (the best of ``rounds`` rounds,
    lengths interleaved within a round so that a busy spell slows them alike), for the cost
    model's prefill curve (`CalibrationProfile.prefill_shape`). A length no text reaches is left out."""
    ctxs = {}
    for n in lengths:
        try:
            ctxs[n] = windows(tokenizer, 1, n)[0]
        except RuntimeError:
            continue
    best: dict[int, float] = {}
    for _ in range(rounds):
        for n, ids in ctxs.items():
            t0 = time.perf_counter()
            runner.prefill(ids)
            took = time.perf_counter() - t0
            best[n] = min(took, best.get(n, math.inf))
    return best


def measure(
    *,
    quick: bool = False,
    specs: tuple[str, ...] = SPECS,
    runner: Any = None,
    tokenizer: Any = None,
    n_windows: int | None = None,
    prefill_lengths: tuple[int, ...] = LENGTHS,
    progress: Callable[[str], None] | None = None,
) -> CalibrationProfile:
    """Run the calibration and return the profile (nothing is written).

    Args:
        quick: fewer windows and repeats (well under 2 minutes on 2 cores).
        specs: the media to measure.
        runner: the model (default: SmolLM2-135M-Instruct via `load_smollm2`).
        tokenizer: its tokenizer (default: the runner's).
        n_windows: how many text windows (default: 2 quick, 6 full).
        prefill_lengths: the context lengths the prefill is timed at (`prefill_by_length`).
        progress: called with a line of text after each step.
    """
    from kvbus.app.bench import machine_info
    from kvbus.codecs import _native
    from kvbus.codecs._kernels import compile_enabled

    _native.prepare()  # the speeds measured are those of the kernels transfers will run

    say = progress or (lambda _line: None)
    if runner is None:
        from kvbus.app.models import load_smollm2

        runner, tokenizer = load_smollm2()
    tokenizer = tokenizer if tokenizer is not None else runner.tokenizer
    repeats = REPEATS[0 if quick else 1]
    n_windows = n_windows or WINDOWS[0 if quick else 1]
    wins = windows(tokenizer, n_windows)
    runner.prefill(wins[0][:, :16])  # first-call warm-up
    rows: dict[str, dict[str, list[float]]] = {s: {} for s in specs}
    prefill_s: list[float] = []
    decode_s: list[float] = []
    full = get_codec("full")
    split_media = [m for m in SPLIT_MEDIA if m in specs]
    split_rows: dict[str, list[tuple[float, float]]] = {}  # (kl, top1) per window
    for w, ids in enumerate(wins):
        ctx, following = ids[:, :CONTEXT], ids[:, CONTEXT:]
        t, kv = _best(partial(runner.prefill, ctx), 1 if w else 2)
        prefill_s.append(t)
        if w < 2:
            t, new = _best(partial(runner.generate, kv, 16), 1)
            decode_s.append(t / max(1, new.shape[1]))
        ref = runner.score(kv, following)
        for inner in split_media:
            split_rows.setdefault(inner, []).append(behind_prefix(runner, kv, ref, following, inner))
        kv_bytes = sum(x.numel() * x.element_size() for x in kv.keys + kv.values)
        full_bytes = full.encode(kv).nbytes
        for spec in specs:
            codec = get_codec(spec)
            slow = medium_spec(spec).outer in ("summary", "lowrank", "tokens")
            reps = (1 if quick else 2) if slow else repeats
            t_enc, encoded = _best(partial(codec.encode, kv, runner=runner), reps)
            wire = _wire(encoded)
            t_dec, out = _best(partial(codec.decode, wire, runner=runner), reps)
            logits = runner.score(out, following)
            kl, top1, dnll = compare(ref, logits, following)
            row = rows[spec]
            for key, value in (
                ("encode_gbps", kv_bytes / t_enc / 1e9),
                ("decode_gbps", kv_bytes / t_dec / 1e9),
                ("ratio", full_bytes / max(1, encoded.nbytes)),
                ("rel_error", rel_error(kv, out)),
                ("kl", kl),
                ("top1", top1),
                ("nll_delta", dnll),
            ):
                row.setdefault(key, []).append(value)
            say(
                f"window {w + 1}/{len(wins)} {spec:>14}: ratio {full_bytes / max(1, encoded.nbytes):8.2f}  "
                f"KL {kl:.2e}  top1 {top1:.3f}  dNLL {dnll:+.4f}  enc {kv_bytes / t_enc / 1e9:6.2f} GB/s  "
                f"dec {kv_bytes / t_dec / 1e9:6.2f} GB/s"
            )
    figures: dict[str, CodecFigures] = {}
    for spec, row in rows.items():
        codec = get_codec(spec)
        mean = {k: statistics.fmean(v) for k, v in row.items()}
        # throughput: the best window (the machine is shared; noise only ever slows a run down)
        enc, dec = max(row["encode_gbps"]), max(row["decode_gbps"])
        lossless = codec.lossless
        figures[codec.name] = CodecFigures(
            encode_gbps=enc,
            decode_gbps=dec,
            ratio=mean["ratio"],
            rel_error=0.0 if lossless else mean["rel_error"],
            kl=0.0 if lossless else mean["kl"],
            top1=1.0 if lossless else mean["top1"],
            nll_delta=0.0 if lossless else mean["nll_delta"],
            fidelity=fidelity_from(mean["top1"], mean["kl"], lossless=lossless),
        )
    by_tokens = {} if quick else fidelity_by_length(runner, tokenizer, specs, progress=say)
    split_fidelity = {
        get_codec(m).name: fidelity_from(statistics.fmean(t for _, t in row), statistics.fmean(k for k, _ in row))
        for m, row in split_rows.items()
    }
    say("fidelity behind a recomputed prefix: " + ", ".join(f"{m} {f:.4f}" for m, f in split_fidelity.items()))
    prefill_curve = prefill_by_length(runner, tokenizer, lengths=prefill_lengths, rounds=2 if quick else 3)
    say("prefill s by tokens: " + ", ".join(f"{n} {t:.3f}" for n, t in sorted(prefill_curve.items())))
    now = _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()
    return CalibrationProfile(
        version=PROFILE_VERSION,
        model=runner.signature.to_dict(),
        machine=machine_info(),
        created=now,
        codecs=figures,
        prefill_tokens_per_s=CONTEXT / min(prefill_s),
        decode_token_s=min(decode_s),
        context_tokens=CONTEXT,
        details={
            "windows": len(wins),
            "following_tokens": FOLLOWING,
            "repeats": repeats,
            "quick": quick,
            "compile": compile_enabled(),
            "kernels": "c" if _native.available() else "torch",
            "codec_threads": _native.threads(),
            "throughput": "GB/s of uncompressed KV bytes, best window; quality figures: mean over windows",
            "fidelity": "top1 * exp(-kl), clamped to [0.001, 1]; 1 for lossless media",
            "delta": "delta+X costs what X costs on the tokens after the shared prefix",
            "topk": "scored with the sender's real queries (runner given to encode)",
            "prefill_s_by_tokens": "the best of 2 (quick) or 3 rounds of one prefill per length, lengths "
            "interleaved; the cost model fits its prefill curve to it",
            "fidelity_by_tokens": f"full runs: lossy media's fidelity at {list(LENGTHS)} context tokens, "
            f"mean top-1 and KL over up to {LENGTH_WINDOWS} windows of {LENGTH_FOLLOWING} following tokens",
            "split_fidelity": f"split({SPLIT_PROBE})+X's fidelity on the same windows, X in {list(SPLIT_MEDIA)}",
        },
        fidelity_by_tokens=by_tokens,
        split_fidelity=split_fidelity,
        prefill_s_by_tokens=prefill_curve,
    )


def run_calibrate(quick: bool = False, out: str | None = None) -> int:
    """The `kvbus calibrate` command: measure, print a table, save the profile. Returns an exit code."""
    t0 = time.perf_counter()
    print(f"calibrating on SmolLM2-135M-Instruct ({'quick' if quick else 'full'} run)...", flush=True)
    profile = measure(quick=quick, progress=lambda line: print("  " + line, flush=True))
    path = save_profile(profile, Path(out) if out else user_profile_path())
    print(
        f"\n{'medium':>14} {'ratio':>8} {'enc GB/s':>9} {'dec GB/s':>9} {'rel err':>8} {'KL':>9} "
        f"{'top1':>6} {'dNLL':>8} {'fidelity':>8}"
    )
    for spec, f in profile.codecs.items():
        print(
            f"{spec:>14} {f.ratio:8.2f} {f.encode_gbps:9.3f} {f.decode_gbps:9.3f} {f.rel_error:8.4f} "
            f"{f.kl:9.2e} {f.top1:6.3f} {f.nll_delta:+8.4f} {f.fidelity:8.4f}"
        )
    print(
        f"\nprefill {profile.prefill_tokens_per_s:.0f} tokens/s, decode {profile.decode_token_s * 1000:.1f} ms/token "
        f"({profile.context_tokens}-token context)"
    )
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(run_calibrate(quick="--quick" in sys.argv))
