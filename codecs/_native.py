"""The fused C kernels of the quantising codecs (``_native.c``), built on first use and cached on disk.

The eager torch kernels (`kvbus.codecs._kernels`) make five to eight passes over a layer, each
a torch op with its dispatch and, for the scales, a dozen small ops; on the 2-core development
machine int8 encoded at 0.16x a ``copy_`` of the same bytes. The C kernels read each element
once or twice while it is in the L1 or L2 cache and write its code, with the torch kernels'
arithmetic operation for operation, so the wire bytes are the same (tests/test_kernels.py).

Build: the first call in a process loads ``_native-<key>.so`` from `cache_dir` (a few
milliseconds); if it is not there, a background thread has the C compiler (``$CC``, else
``cc``) build it (about 2 s on the 2-core development machine) while the torch kernels serve, so
a build is never on a transfer's critical path. ``-O3 -march=native``: the key covers the
source, the flags, the compiler and the CPU's flags, so a cache shared between machines never
loads code built for another CPU; no ``-ffast-math``. `prepare` builds and waits (``kvbus
calibrate``, the bench and the tests call it). Without a compiler, or with ``KVBUS_NATIVE=0`` (or
`set_enabled`), the torch kernels run, with one log line saying why (`why_not`).

A layer's call splits its heads and rows over OpenMP threads (`threads`); ctypes releases the
GIL for the call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from importlib import resources
from pathlib import Path

logger = logging.getLogger(__name__)

#: Environment variable: ``0`` (or ``false``/``off``) keeps the torch kernels.
NATIVE_ENV = "KVBUS_NATIVE"
#: Environment variable: where built kernels are cached (default `cache_dir`).
CACHE_ENV = "KVBUS_KERNEL_CACHE"
#: Compiler flags. No -ffast-math (it would allow a reciprocal for the division), no contraction
#: into fused multiply-adds (they round once where the torch kernels round twice).
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c11")
#: Longest a build may take before it counts as failed (seconds; it runs at the lowest priority,
#: so a busy machine stretches it).
BUILD_TIMEOUT_S = 300.0

_I64 = ctypes.c_int64
_P = ctypes.c_void_p
#: The exported functions and their argument types (pointers then sizes).
_SIGNATURES: dict[str, tuple[type, ...]] = {
    "int8_enc_keys_bf16": (_P, _P, _P, _I64, _I64, _I64),
    "int8_enc_rows_bf16": (_P, _P, _P, _I64, _I64),
    "int8_enc_keys_f32": (_P, _P, _P, _I64, _I64, _I64),
    "int8_enc_rows_f32": (_P, _P, _P, _I64, _I64),
    "int8_dec_keys_bf16": (_P, _P, _P, _I64, _I64, _I64),
    "int8_dec_rows_bf16": (_P, _P, _P, _I64, _I64),
    "int4_enc_keys_bf16": (_P, _P, _P, _P, _I64, _I64, _I64, _I64),
    "int4_enc_rows_bf16": (_P, _P, _P, _P, _I64, _I64, _I64),
    "int4_dec_keys_bf16": (_P, _P, _P, _P, _I64, _I64, _I64, _I64),
    "int4_dec_rows_bf16": (_P, _P, _P, _P, _I64, _I64, _I64),
    "int8_enc_layer_bf16": (_P, _P, _P, _P, _P, _P, _I64, _I64, _I64),
    "int8_enc_layer_f32": (_P, _P, _P, _P, _P, _P, _I64, _I64, _I64),
    "int8_dec_layer_bf16": (_P, _P, _P, _P, _P, _P, _I64, _I64, _I64),
    "int4_enc_layer_bf16": (_P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64),
    "int4_dec_layer_bf16": (_P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64),
    "int8_dec_keys_f32": (_P, _P, _P, _I64, _I64, _I64),
    "int8_dec_rows_f32": (_P, _P, _P, _I64, _I64),
    "int4_enc_keys_f32": (_P, _P, _P, _P, _I64, _I64, _I64, _I64),
    "int4_enc_rows_f32": (_P, _P, _P, _P, _I64, _I64, _I64),
    "int4_dec_keys_f32": (_P, _P, _P, _P, _I64, _I64, _I64, _I64),
    "int4_dec_rows_f32": (_P, _P, _P, _P, _I64, _I64, _I64),
    "int8_dec_layer_f32": (_P, _P, _P, _P, _P, _P, _I64, _I64, _I64),
    "int4_enc_layer_f32": (_P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64),
    "int4_dec_layer_f32": (_P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64),
    "int8c_enc_layer_bf16": (_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64),
    "int8c_enc_layer_f32": (_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64),
    "int8c_dec_layer_bf16": (_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64),
    "int8c_dec_layer_f32": (_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64),
}
#: The functions that return a C ``int`` (a mask of the non-finite scales); the others return nothing.
_RETURNS_INT = frozenset(
    {
        "int8_enc_layer_bf16",
        "int8_enc_layer_f32",
        "int8c_enc_layer_bf16",
        "int8c_enc_layer_f32",
        "int4_enc_layer_bf16",
        "int4_enc_layer_f32",
    }
)
#: Widest head dimension (channels of a key row) the kernels take (``CHUNK`` in ``_native.c``).
MAX_CHANNELS = 256

_lock = threading.Lock()
_state: dict[str, object] = {}
"""``lib``: the loaded library, or ``None`` once loading failed (with ``why``)."""


_override: list[bool | None] = [None]
"""What `set_enabled` forced (a one-element list: set without a ``global`` statement)."""


def enabled_by_env() -> bool:
    """Whether the C kernels may run: `set_enabled` if called, else ``KVBUS_NATIVE`` (unset: yes)."""
    if _override[0] is not None:
        return _override[0]
    return os.environ.get(NATIVE_ENV, "").strip().lower() not in ("0", "false", "no", "off")


def set_enabled(enabled: bool | None) -> None:
    """Force the C kernels on or off in this process (``None``: back to ``KVBUS_NATIVE``)."""
    with _lock:
        _override[0] = enabled
        _state.clear()


def cache_dir() -> Path:
    """``$KVBUS_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/kvbus/kernels``, else ``~/.cache/kvbus/kernels``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvbus" / "kernels"


def _source() -> bytes:
    return resources.files("kvbus.codecs").joinpath("_native.c").read_bytes()


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.machine() + platform.processor()


def _compiler() -> str | None:
    cc = os.environ.get("CC", "").strip() or "cc"
    return shutil.which(cc)


def _library_path(cc: str, source: bytes) -> Path:
    key = hashlib.sha256()
    for part in (source, " ".join(CFLAGS).encode(), cc.encode(), _cpu_flags().encode(), sys.platform.encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"_native-{key.hexdigest()[:20]}.so"


def _build(cc: str, source: bytes, target: Path) -> None:
    """Compile ``source`` into ``target`` (atomically: a concurrent builder's file is as good)."""
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        src = Path(tmp) / "_native.c"
        src.write_bytes(source)
        out = Path(tmp) / "_native.so"
        # At the lowest priority: the first transfers run the torch kernels meanwhile, on every
        # core (their OpenMP ops crawl while a compiler holds one: int4's first call took 3.5 s
        # beside a build at normal priority).
        nice = shutil.which("nice")
        prefix = [nice, "-n", "19"] if nice else []
        subprocess.run(
            [*prefix, cc, *CFLAGS, "-o", str(out), str(src)], check=True, capture_output=True, timeout=BUILD_TIMEOUT_S
        )
        os.replace(out, target)


def _unsafe_folder(folder: Path) -> str | None:
    """Why ``folder`` may not hold code this process loads (another user could write into it), or None."""
    try:
        st = folder.stat()
    except FileNotFoundError:
        return None  # made by the build, 0o700
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"{folder} belongs to another user"
    if st.st_mode & 0o022:
        return f"{folder} is writable by its group or others"
    return None


def _plan() -> tuple[str, bytes, Path] | None:
    """``(compiler, source, library path)``, or None (with ``why``) when the kernels are off."""
    if not enabled_by_env():
        _state["why"] = f"{NATIVE_ENV} is off"
        return None
    cc = _compiler()
    if cc is None:
        _state["why"] = "no C compiler (set CC, or install one)"
        return None
    source = _source()
    path = _library_path(cc, source)
    unsafe = _unsafe_folder(path.parent)
    if unsafe is not None:
        _state["why"] = f"the kernel cache is unsafe to load from: {unsafe} (set {CACHE_ENV})"
        return None
    return cc, source, path


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int if name in _RETURNS_INT else None
    return lib


def _settle(path: Path, error: BaseException | None = None) -> None:
    """Record the outcome of a build (``error``) or load ``path`` into ``_state`` (with ``_lock`` held)."""
    lib: ctypes.CDLL | None = None
    if error is None:
        try:
            lib = _open(path)
        except (OSError, AttributeError) as exc:
            error = exc
    if error is not None:
        detail = (
            error.stderr.decode(errors="replace")[-400:] if isinstance(error, subprocess.CalledProcessError) else ""
        )
        _state["why"] = f"building or loading {path} failed: {error} {detail}".strip()
        logger.info("the fused codec kernels are off, using the torch kernels: %s", _state["why"])
    _state["lib"] = lib


def _background_build(plan: tuple[str, bytes, Path], generation: object, done: threading.Event) -> None:
    """Build outside the lock (`library` never waits for it), then load what was built."""
    cc, source, path = plan
    error: BaseException | None = None
    try:
        if not path.exists():
            _build(cc, source, path)
    except (OSError, subprocess.SubprocessError) as exc:
        error = exc
    with _lock:
        if _state.get("generation") is generation and "lib" not in _state:
            _settle(path, error)
    done.set()


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or ``None`` while they are unavailable (see `why_not`). Never waits for a
    build: the first call in a process loads the cached library, or starts building it in a
    background thread and returns None (the torch kernels serve until it is done)."""
    try:
        return _state["lib"]  # type: ignore[return-value]
    except KeyError:  # not loaded yet (or reset by another thread since)
        pass
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        if "built" in _state:
            return None  # a build is under way
        plan = _plan()
        if plan is None:
            logger.info("the fused codec kernels are off, using the torch kernels: %s", _state.get("why"))
            _state["lib"] = None
            return None
        if plan[2].exists():
            _settle(plan[2])
            return _state["lib"]  # type: ignore[return-value]
        generation = _state.setdefault("generation", object())
        done = _state["built"] = threading.Event()
        threading.Thread(
            target=_background_build, args=(plan, generation, done), name="kvbus-kernel-build", daemon=True
        ).start()
        return None


def available() -> bool:
    """Whether the C kernels serve this process now (starts a build in the background if need be)."""
    return library() is not None


def why_not() -> str | None:
    """Why the C kernels are off (``None`` when they are on, not tried yet, or being built)."""
    return None if _state.get("lib") is not None else _state.get("why")  # type: ignore[return-value]


def prepare() -> bool:
    """Build (or load) the kernels now, waiting for it, rather than at the first transfer; returns `available`."""
    if library() is None:
        done = _state.get("built")
        if isinstance(done, threading.Event):
            done.wait(BUILD_TIMEOUT_S + 5)
    return library() is not None


def reset() -> None:
    """Forget the loaded library (or why it failed), so that the next call loads again."""
    with _lock:
        _state.clear()


def threads() -> int:
    """Threads the C kernels split a layer over: torch's intra-op threads (`torch.get_num_threads`).

    They run in torch's own OpenMP runtime (the library's ``libgomp.so.1`` resolves to the one
    torch loaded), on the threads torch's ops use, so a kernel right after a torch op finds them
    awake rather than competing with them for the cores.
    """
    import torch

    return int(torch.get_num_threads())
