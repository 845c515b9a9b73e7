"""Calibration profiles: measured speed, size and fidelity of every medium, saved and reused.

`kvbus calibrate` (`kvbus.app.calibrate`) measures them on a real model and writes a profile; the
cost model and the codecs load it. Lookup order of `load_profile` without a path:
``$KVBUS_CALIBRATION``, else ``~/.cache/kvbus/calibration.json``, else the profile shipped
with kvbus (``kvbus/data/calibration_default.json``, measured on SmolLM2-135M-Instruct on a
2-core CPU).

Fidelity factor of a lossy medium: ``top1 * exp(-kl)``, clamped to ``[0.001, 1]``, where
``top1`` is the agreement of the greedy next token with the uncompressed cache's and ``kl`` the
mean next-token KL divergence (nats), both averaged over the tokens that follow the context.
``top1`` alone is the chance a greedy step is unchanged; ``exp(-kl)`` further discounts media
that keep the argmax but flatten or shift the distribution (which sampling and later steps
feel). Lossless media have exactly 1.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from kvbus.codecs.errors import CalibrationError

logger = logging.getLogger(__name__)

#: Version of the profile format; a profile of another version is refused.
PROFILE_VERSION = 1
#: Environment variable naming the profile to use.
PROFILE_ENV = "KVBUS_CALIBRATION"
#: Lower bound of a lossy medium's fidelity factor.
MIN_FIDELITY = 1e-3
#: Largest profile file read (bytes).
MAX_PROFILE_BYTES = 4 << 20
#: The prefix share at which a ``split`` medium's fidelity is calibrated
#: (`CalibrationProfile.split_fidelity`): the smallest prefix the cost model prices.
SPLIT_PROBE = 0.05


def fidelity_from(top1: float, kl: float, *, lossless: bool = False) -> float:
    """The fidelity factor of a medium from its measured top-1 agreement and KL (see module doc)."""
    if lossless:
        return 1.0
    if not (math.isfinite(top1) and math.isfinite(kl)):
        return MIN_FIDELITY
    return float(min(1.0, max(MIN_FIDELITY, top1 * math.exp(-max(kl, 0.0)))))


@dataclass(frozen=True, slots=True)
class CodecFigures:
    """What one medium costs and loses, measured on the profile's model and machine."""

    encode_gbps: float
    """Encode throughput, GB/s of uncompressed KV bytes (1e9 bytes)."""
    decode_gbps: float
    """Decode throughput, GB/s of uncompressed KV bytes (``tokens``, ``summary``: with the receiver's prefill)."""
    ratio: float
    """Uncompressed KV bytes / encoded bytes (>= 1 for compressing media)."""
    rel_error: float
    """Relative L2 error of the decoded keys and values (0 for lossless; nan where not comparable)."""
    kl: float
    """Mean next-token KL divergence (nats) from the uncompressed cache's distribution."""
    top1: float
    """Fraction of following positions where the greedy token agrees with the uncompressed cache's."""
    nll_delta: float
    """Mean change in NLL per following token vs the uncompressed cache (nats; > 0 is worse)."""
    fidelity: float
    """Fidelity factor in (0, 1]: ``top1 * exp(-kl)`` clamped (1.0 for lossless)."""


@dataclass(frozen=True, slots=True)
class CalibrationProfile:
    """A calibration run: per-medium figures and the model's own costs."""

    version: int
    """Format version (`PROFILE_VERSION`)."""
    model: dict[str, Any]
    """Signature of the model measured (`ModelSignature.to_dict`)."""
    machine: dict[str, Any]
    """Where it was measured (python, torch, platform, cpus)."""
    created: str
    """When (ISO 8601, UTC)."""
    codecs: dict[str, CodecFigures]
    """Figures per medium, keyed by canonical spec."""
    prefill_tokens_per_s: float
    """The model's prefill throughput over ``context_tokens`` tokens (the cost of ``tokens``)."""
    decode_token_s: float
    """Seconds per generated token (greedy, batch 1, after a ``context_tokens`` context)."""
    context_tokens: int
    """Length of the context windows measured."""
    details: dict[str, Any] = field(default_factory=dict)
    """How it was measured (windows, following tokens, compile mode, ...)."""
    fidelity_by_tokens: dict[str, dict[int, float]] = field(default_factory=dict)
    """Lossy media's fidelity factor per context length (tokens), where it was measured at several
    (``kvbus calibrate``'s full run); a medium not here has only its ``codecs`` fidelity."""

    split_fidelity: dict[str, float] = field(default_factory=dict)
    """The fidelity factor of ``split(SPLIT_PROBE)+X`` per lossy medium X (canonical), where measured:
    X with the context's first tokens recomputed exact. Most of a quantised cache's error is in
    those first tokens, which every later one attends to, so this is far above X's own factor
    (the cost model prices a split's loss with it)."""

    prefill_s_by_tokens: dict[int, float] = field(default_factory=dict)
    """The model's prefill seconds of a context of each length (tokens; best of the timings),
    where calibration timed several lengths; `prefill_shape` fits the cost model's curve to them."""

    def prefill_shape(self) -> tuple[float, float, float] | None:
        """The cost model's prefill curve (`ModelCosts.prefill_shape`) fitted to
        ``prefill_s_by_tokens``, or None (linear in the tokens) with fewer than three lengths."""
        return fit_prefill_shape(self.prefill_s_by_tokens, self.context_tokens)

    def fidelity_curve(self, spec: str) -> tuple[tuple[int, float], ...]:
        """``((tokens, fidelity), ...)`` of a medium, ``spec`` canonical, by length; () if not measured."""
        return tuple(sorted(self.fidelity_by_tokens.get(spec, {}).items()))

    def figures(self, spec: str) -> CodecFigures | None:
        """The figures of a medium, ``spec`` in any form (canonicalised first), or None."""
        hit = self.codecs.get(spec)
        if hit is not None:
            return hit
        try:
            from kvbus.codecs.base import get_codec

            return self.codecs.get(get_codec(spec).name)
        except ValueError:
            return None

    def to_dict(self) -> dict[str, Any]:
        """The profile as JSON-able data."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["codecs"] = {k: asdict(v) for k, v in self.codecs.items()}
        out["fidelity_by_tokens"] = {
            k: {str(n): f for n, f in sorted(v.items())} for k, v in self.fidelity_by_tokens.items()
        }
        out["prefill_s_by_tokens"] = {str(n): t for n, t in sorted(self.prefill_s_by_tokens.items())}
        return out

    @classmethod
    def from_dict(cls, data: object, path: str = "<memory>") -> CalibrationProfile:
        """Validate and build a profile from parsed JSON.

        Raises:
            CalibrationError: a field is missing, of the wrong type, or the version is unknown.
        """
        if not isinstance(data, dict):
            raise CalibrationError(path, f"expected a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if version != PROFILE_VERSION:
            raise CalibrationError(path, f"version {version!r} is not the supported {PROFILE_VERSION}")

        def get(key: str, kind: type | tuple[type, ...]) -> Any:
            if key not in data:
                raise CalibrationError(path, f"field {key!r} is missing")
            value = data[key]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise CalibrationError(path, f"field {key!r} has type {type(value).__name__}")
            return value

        raw_codecs = get("codecs", dict)
        codecs: dict[str, CodecFigures] = {}
        names = [f.name for f in fields(CodecFigures)]
        for spec, figs in raw_codecs.items():
            if not isinstance(figs, dict):
                raise CalibrationError(path, f"codecs[{spec!r}] is not an object")
            values = {}
            for name in names:
                value = figs.get(name)
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise CalibrationError(path, f"codecs[{spec!r}].{name} must be a number, got {value!r}")
                values[name] = float(value)
            if not 0 < values["fidelity"] <= 1:
                raise CalibrationError(path, f"codecs[{spec!r}].fidelity={values['fidelity']} is outside (0, 1]")
            if not values["ratio"] > 0:
                raise CalibrationError(path, f"codecs[{spec!r}].ratio={values['ratio']} is not positive")
            codecs[str(spec)] = CodecFigures(**values)
        by_tokens = _fidelity_by_tokens(data.get("fidelity_by_tokens", {}), path)
        prefill = float(get("prefill_tokens_per_s", (int, float)))
        decode = float(get("decode_token_s", (int, float)))
        if not (prefill > 0 and decode > 0 and math.isfinite(prefill) and math.isfinite(decode)):
            raise CalibrationError(path, "prefill_tokens_per_s and decode_token_s must be positive")
        return cls(
            version=version,
            model=get("model", dict),
            machine=get("machine", dict),
            created=get("created", str),
            codecs=codecs,
            prefill_tokens_per_s=prefill,
            decode_token_s=decode,
            context_tokens=int(get("context_tokens", int)),
            details=dict(data.get("details") or {}),
            fidelity_by_tokens=by_tokens,
            split_fidelity=_split_fidelity(data.get("split_fidelity", {}), path),
            prefill_s_by_tokens=_prefill_by_tokens(data.get("prefill_s_by_tokens", {}), path),
        )


def _split_fidelity(raw: object, path: str) -> dict[str, float]:
    """Validate a profile's optional ``split_fidelity``: {medium: fidelity in (0, 1]}."""
    if not isinstance(raw, dict):
        raise CalibrationError(path, "split_fidelity is not an object")
    out: dict[str, float] = {}
    for spec, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise CalibrationError(path, f"split_fidelity[{spec!r}]={value!r} is outside (0, 1]")
        out[str(spec)] = float(value)
    return out


def _length(key: Any, what: str, path: str) -> int:
    """A context length given as a JSON key: a positive integer of at most 2**24."""
    try:
        n = int(key)
    except (TypeError, ValueError):
        raise CalibrationError(path, f"{what} has a length {key!r} that is not an integer") from None
    if n <= 0 or n > 1 << 24:
        raise CalibrationError(path, f"{what} has a length {n} out of range")
    return n


def _prefill_by_tokens(raw: object, path: str) -> dict[int, float]:
    """Validate a profile's optional ``prefill_s_by_tokens``: {tokens: positive finite seconds}."""
    if not isinstance(raw, dict):
        raise CalibrationError(path, "prefill_s_by_tokens is not an object")
    out: dict[int, float] = {}
    for key, value in raw.items():
        n = _length(key, "prefill_s_by_tokens", path)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise CalibrationError(path, f"prefill_s_by_tokens[{key!r}]={value!r} is not a positive number of seconds")
        out[n] = float(value)
    return out


def fit_prefill_shape(timings: dict[int, float], ref_tokens: int) -> tuple[float, float, float] | None:
    """``(c0, c1, c2)`` with ``t(n) ~ c0 + c1 n + c2 n^2`` over ``timings`` (tokens -> seconds),
    least squares in relative error, every coefficient >= 0 (a term that fits negative is dropped),
    scaled so that ``t(ref_tokens) = 1``: the cost model's `ModelCosts.prefill_shape`. None with
    fewer than three lengths, or when nothing fits."""
    points = sorted((n, t) for n, t in timings.items() if n > 0 and 0 < t < math.inf)
    if len(points) < 3 or ref_tokens <= 0:
        return None
    best: tuple[float, tuple[float, float, float]] | None = None
    for terms in ((0, 1, 2), (1, 2), (0, 1), (1,)):
        # rows scaled by 1/t: each timing's relative error weighs the same
        rows = [[float(n) ** k / t for k in terms] for n, t in points]
        coef = _least_squares(rows, [1.0] * len(points))
        if coef is None or any(c < 0 for c in coef):
            continue
        full = [0.0, 0.0, 0.0]
        for k, c in zip(terms, coef, strict=True):
            full[k] = c
        err = sum((sum(r * c for r, c in zip(row, coef, strict=True)) - 1.0) ** 2 for row in rows)
        if best is None or err < best[0] - 1e-12:
            best = (err, (full[0], full[1], full[2]))
    if best is None:
        return None
    c0, c1, c2 = best[1]
    at_ref = c0 + c1 * ref_tokens + c2 * ref_tokens**2
    if not at_ref > 0:
        return None
    return (c0 / at_ref, c1 / at_ref, c2 / at_ref)


def _least_squares(rows: list[list[float]], rhs: list[float]) -> list[float] | None:
    """The least-squares solution of ``rows @ x = rhs``, None when it is not finite."""
    x = [float(v) for v in np.linalg.lstsq(np.asarray(rows), np.asarray(rhs), rcond=None)[0]]
    return x if all(math.isfinite(v) for v in x) else None


def _fidelity_by_tokens(raw: object, path: str) -> dict[str, dict[int, float]]:
    """Validate a profile's optional ``fidelity_by_tokens``: medium -> {tokens (a positive integer,
    as a JSON key): fidelity in (0, 1]}."""
    if not isinstance(raw, dict):
        raise CalibrationError(path, "fidelity_by_tokens is not an object")
    out: dict[str, dict[int, float]] = {}
    for spec, curve in raw.items():
        if not isinstance(curve, dict):
            raise CalibrationError(path, f"fidelity_by_tokens[{spec!r}] is not an object")
        points: dict[int, float] = {}
        for key, value in curve.items():
            n = _length(key, f"fidelity_by_tokens[{spec!r}]", path)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise CalibrationError(path, f"fidelity_by_tokens[{spec!r}][{key!r}]={value!r} is not in (0, 1]")
            points[n] = float(value)
        out[str(spec)] = points
    return out


def shipped_profile_path() -> Path:
    """The profile shipped with kvbus (``kvbus/data/calibration_default.json``)."""
    import kvbus.data

    return Path(kvbus.data.__file__).resolve().parent / "calibration_default.json"


def user_profile_path() -> Path:
    """Where `kvbus calibrate` writes by default: ``$KVBUS_CALIBRATION``, else ``~/.cache/kvbus/calibration.json``."""
    env = os.environ.get(PROFILE_ENV)
    if env:
        return Path(env).expanduser()
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "kvbus" / "calibration.json"


def default_profile_path() -> Path:
    """The profile `load_profile` reads without a path: the user's if it exists, else the shipped one.

    ``$KVBUS_CALIBRATION`` is returned as is when set, even if the file is missing (loading it
    then fails loudly rather than silently using another profile).
    """
    user = user_profile_path()
    if os.environ.get(PROFILE_ENV) or user.is_file():
        return user
    return shipped_profile_path()


def load_profile(path: str | Path | None = None) -> CalibrationProfile:
    """Read a calibration profile (``path``, else `default_profile_path`).

    Raises:
        CalibrationError: the file is missing, unreadable, not JSON, or not a valid profile.
    """
    p = Path(path).expanduser() if path is not None else default_profile_path()
    try:
        with open(p, "rb") as fh:
            raw = fh.read(MAX_PROFILE_BYTES + 1)
    except OSError as exc:
        raise CalibrationError(str(p), f"cannot read it ({exc.strerror or exc})") from None
    if len(raw) > MAX_PROFILE_BYTES:
        raise CalibrationError(str(p), f"larger than {MAX_PROFILE_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CalibrationError(str(p), f"not valid JSON ({exc})") from None
    return CalibrationProfile.from_dict(data, str(p))


def save_profile(profile: CalibrationProfile, path: str | Path) -> Path:
    """Write ``profile`` as JSON to ``path`` atomically (a temporary file, then a rename)."""
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=2, sort_keys=False, allow_nan=True) + "\n")
    os.replace(tmp, p)
    return p


# -- the profile codecs use ---------------------------------------------------------------------

_lock = threading.Lock()
_active: CalibrationProfile | None = None
_loaded = False


def active_profile() -> CalibrationProfile | None:
    """The profile codecs take their fidelity factors from (loaded once from the default path).

    A profile that cannot be loaded is logged and ignored: codecs then use their class defaults.
    """
    global _active, _loaded
    with _lock:
        if not _loaded:
            _loaded = True
            try:
                _active = load_profile()
            except CalibrationError as exc:
                logger.warning("no usable calibration profile (%s); codecs use their default fidelity factors", exc)
                _active = None
        return _active


def set_active_profile(profile: CalibrationProfile | str | Path | None) -> CalibrationProfile | None:
    """Use ``profile`` (or the profile at a path, or none) for codecs built from now on.

    Raises:
        CalibrationError: a path was given that does not hold a valid profile.
    """
    global _active, _loaded
    loaded = load_profile(profile) if isinstance(profile, (str, Path)) else profile
    with _lock:
        _active, _loaded = loaded, True
    return loaded


def measured_fidelity(spec: str) -> float | None:
    """The active profile's fidelity factor for canonical ``spec``, or None."""
    profile = active_profile()
    if profile is None:
        return None
    figs = profile.codecs.get(spec)
    return figs.fidelity if figs is not None else None
