"""Shared pieces of the vLLM connector tests: prompts from shipped text, a second (different)
model, an engine process with the connector."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from kvbus.app.bench.vllm import text_prompt
from kvbus.app.models import model_folder

if TYPE_CHECKING:
    from kvbus.integrations.vllm.process import EngineProcess

#: Name the SmolLM2 engines give their model in the kvbus signature (as `kvbus.app.models` does).
SMOLLM2 = "SmolLM2-135M-Instruct"


def prompt(n: int, offset: int) -> list[int]:
    """``n`` tokens of the shipped text starting at ``offset`` (the bench's prompts)."""
    return text_prompt(n, offset)


def engine(
    name: str,
    folder: Path,
    log: Path,
    *,
    nats_url: str,
    model_name: str,
    cpu: str = "0",
    block: int = 32,
    max_model_len: int = 2048,
    max_num_seqs: int = 4,
    **extra: object,
) -> EngineProcess:
    """An engine process (not launched) of the model in ``folder`` with kvbus's connector as agent
    ``name``: float32, eager, vLLM's own prefix caching off, pinned to core ``cpu``, its log in
    ``log``. ``extra``: `connector_config` settings. The tests look at the loads themselves, so
    the pull gate (which declines a pull its engine predicts slower than prefilling, from what it
    measured before) is off unless ``extra`` turns it on; tests/test_vllm_worth.py tests it."""
    from kvbus.integrations.vllm import connector_config
    from kvbus.integrations.vllm.process import EngineProcess

    extra.setdefault("pull_gate", False)
    return EngineProcess(
        env={"VLLM_CPU_OMP_THREADS_BIND": cpu},
        log_path=str(log),
        model=str(folder),
        dtype="float32",
        max_model_len=max_model_len,
        enforce_eager=True,
        block_size=block,
        enable_prefix_caching=False,
        max_num_seqs=max_num_seqs,
        kv_transfer_config=connector_config(name, nats_url=nats_url, model_name=model_name, **extra),
    )


def other_model_folder(root: Path) -> Path:
    """A small random Llama with SmolLM2's vocabulary and tokenizer, as a folder vLLM loads."""
    from safetensors.torch import save_file

    from kvbus.app.models import random_model

    folder = root / "random-llama-49152"
    if (folder / "model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    runner = random_model(
        n_layers=2, n_kv_heads=1, head_dim=64, n_heads=2, vocab_size=49152, seed=3, max_positions=4096
    )
    model = runner.model
    config = model.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config))
    save_file(
        {k: v.detach().contiguous() for k, v in model.state_dict().items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    src = model_folder()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, folder / name)
    return folder
