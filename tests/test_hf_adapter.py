"""`KVCache` <-> `transformers` caches, and generation continued from transferred caches."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch

from kvbus.app.models import SMOLLM2_NAME, load_smollm2, random_model, smollm2_path
from kvbus.codecs import Encoded, get_codec
from kvbus.codecs.runner import HFRunner, output_cache
from kvbus.errors import GenerationError, SignatureMismatch
from kvbus.kvcache import KVCache

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def runner() -> HFRunner:
    return random_model(n_layers=2, n_kv_heads=2, head_dim=16, n_heads=4, vocab_size=256, seed=7)


@pytest.fixture(scope="module")
def prompts() -> torch.Tensor:
    return torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))


def transfer(kv: KVCache, codec: str, runner: HFRunner | None = None) -> KVCache:
    """``kv`` encoded, sent as one payload with msgpack'd metadata, and decoded."""
    encoded = get_codec(codec).encode(kv)
    meta = msgpack.unpackb(msgpack.packb(encoded.meta))
    received = Encoded.from_payload(codec, meta, b"".join(encoded.buffers), encoded.sizes)
    return get_codec(codec).decode(received, runner=runner)


def plain_greedy(runner: HFRunner, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Uninterrupted greedy generation by `transformers` itself (the new tokens only)."""
    with torch.inference_mode():
        out = runner.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[:, ids.shape[1] :]


def test_signature_of_random_model(runner: HFRunner) -> None:
    sig = runner.signature
    assert (sig.n_layers, sig.n_kv_heads, sig.head_dim, sig.vocab_size, sig.dtype) == (2, 2, 16, 256, "float32")
    assert sig.model.startswith("random-llama")
    other = random_model(n_layers=2, n_kv_heads=2, head_dim=16, n_heads=4, vocab_size=256, seed=8)
    assert not other.signature.compatible_with(sig)  # other weights: caches must not be shared


def test_from_hf_and_to_hf_round_trip_a_dynamic_cache(runner: HFRunner, prompts: torch.Tensor) -> None:
    config = runner.model.config
    with torch.inference_mode():
        cache = output_cache(runner.model(input_ids=prompts, use_cache=True))
    kv = KVCache.from_hf(cache, prompts, config, model=runner.name)
    assert kv.signature == runner.signature
    assert kv.n_layers == 2 and kv.seq_len == kv.n_tokens == prompts.shape[1]
    assert all(k is layer.keys for k, layer in zip(kv.keys, cache.layers))  # shared, not copied
    back = kv.to_hf(config)
    assert back.get_seq_length() == prompts.shape[1] and len(back.layers) == len(cache.layers)
    for ours, theirs in zip(back.layers, cache.layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    assert KVCache.from_hf(back, prompts, config, model=runner.name).equal(kv)


def test_prefill_gives_the_models_cache(runner: HFRunner, prompts: torch.Tensor) -> None:
    kv = runner.prefill(prompts)
    kv.validate(runner.signature)
    assert torch.equal(kv.tokens, prompts) and kv.seq_len == prompts.shape[1]
    assert not runner.prefill(prompts[:, :0]).has_kv


@pytest.mark.parametrize("covered", ["all", "prefix", "none"])
def test_generation_reuses_any_part_of_the_kv(runner: HFRunner, prompts: torch.Tensor, covered: str) -> None:
    kv = runner.prefill(prompts)
    if covered == "prefix":
        kv = KVCache(
            tokens=kv.tokens,
            signature=kv.signature,
            keys=[k[:, :, :9] for k in kv.keys],
            values=[v[:, :, :9] for v in kv.values],
        )
    elif covered == "none":
        kv = kv.token_only()
    assert torch.equal(runner.generate(kv, NEW_TOKENS), plain_greedy(runner, prompts, NEW_TOKENS))


@pytest.mark.parametrize("codec", ["full", "tokens"])
def test_generation_after_transfer_equals_plain_generation(runner: HFRunner, prompts: torch.Tensor, codec: str) -> None:
    kv = runner.prefill(prompts)
    received = transfer(kv, codec, runner=runner)
    assert received.has_kv and received.equal(kv)
    assert torch.equal(runner.generate(received, NEW_TOKENS), plain_greedy(runner, prompts, NEW_TOKENS))


def test_generation_after_int8_transfer_stays_close(runner: HFRunner, prompts: torch.Tensor) -> None:
    kv = runner.prefill(prompts)
    received = transfer(kv, "int8")
    assert received.fidelity == pytest.approx(get_codec("int8").fidelity)
    # the next-token distribution barely moves: the first greedy token agrees
    assert torch.equal(runner.generate(received, 1), plain_greedy(runner, prompts, 1))


def test_generation_refuses_bad_contexts(runner: HFRunner, prompts: torch.Tensor) -> None:
    kv = runner.prefill(prompts)
    with pytest.raises(GenerationError):
        runner.generate(kv.token_only().slice(0, 0), 3)
    with pytest.raises(GenerationError):
        runner.generate(kv, -1)
    other = random_model(n_layers=2, n_kv_heads=2, head_dim=16, n_heads=4, vocab_size=256, seed=8)
    with pytest.raises(SignatureMismatch):
        other.generate(kv, 3)
    assert runner.generate(kv, 0).shape == (2, 0)


def test_smollm2_continues_from_a_full_transfer() -> None:
    assert smollm2_path().is_file()
    start = time.perf_counter()
    runner, tokenizer = load_smollm2()
    print(f"load_smollm2: {time.perf_counter() - start:.1f} s")
    assert runner.signature.model == SMOLLM2_NAME and runner.signature.n_layers == 30
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, return_tensors="pt").input_ids
    kv = runner.prefill(ids)
    received = transfer(kv, "full")
    assert received.equal(kv)
    eos = tokenizer.eos_token_id
    local = runner.generate(kv.token_only(), NEW_TOKENS, eos_token_id=eos)
    remote = runner.generate(received, NEW_TOKENS, eos_token_id=eos)
    assert torch.equal(remote, local)
    with torch.inference_mode():
        reference = runner.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
        )[:, ids.shape[1] :]
    assert torch.equal(remote, reference[:, : remote.shape[1]])
    assert "Paris" in tokenizer.decode(remote[0])
