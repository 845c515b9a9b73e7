"""Shared pieces of the vLLM connector tests: prompts from shipped text, a second (different) model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kvbus.app.bench.vllm import text_prompt
from kvbus.app.models import model_folder

#: Name the SmolLM2 engines give their model in the kvbus signature (as `kvbus.app.models` does).
SMOLLM2 = "SmolLM2-135M-Instruct"


def prompt(n: int, offset: int) -> list[int]:
    """``n`` tokens of the shipped text starting at ``offset`` (the bench's prompts)."""
    return text_prompt(n, offset)


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
