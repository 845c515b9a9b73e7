"""Generation continued from decoded caches: identical after lossless media, sane after sparse and summary media."""

from __future__ import annotations

import msgpack
import pytest
import torch

from kvbus.app.models import random_model
from kvbus.codecs import Encoded, ModelSummarizer, SummaryCodec, get_codec
from kvbus.codecs.errors import SummaryUnavailable
from kvbus.codecs.runner import HFRunner
from kvbus.codecs.topk import attention_scores
from kvbus.errors import GenerationError
from kvbus.kvcache import KVCache

NEW = 10


@pytest.fixture(scope="module")
def runner() -> HFRunner:
    return random_model(n_layers=2, n_kv_heads=2, head_dim=16, n_heads=4, vocab_size=256, seed=11)


@pytest.fixture(scope="module")
def prompts() -> torch.Tensor:
    return torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(5))


def transfer(
    kv: KVCache,
    spec: str,
    *,
    base: KVCache | None = None,
    runner: HFRunner | None = None,
    sender: HFRunner | None = None,
) -> KVCache:
    codec = get_codec(spec)
    encoded = codec.encode(kv, base=None if base is None else base.token_only(), runner=sender)
    meta = msgpack.unpackb(msgpack.packb(encoded.meta))
    received = Encoded.from_payload(encoded.codec, meta, b"".join(encoded.buffers), encoded.sizes)
    return get_codec(encoded.codec).decode(received, base=base, runner=runner)


@pytest.mark.parametrize("spec", ["full", "tokens", "delta+full", "delta+tokens"])
def test_lossless_media_continue_with_identical_tokens(runner: HFRunner, prompts: torch.Tensor, spec: str) -> None:
    kv = runner.prefill(prompts)
    local = runner.generate(kv, NEW)
    base = runner.prefill(prompts[:, :25]) if spec.startswith("delta") else None
    received = transfer(kv, spec, base=base, runner=runner)
    assert torch.equal(received.tokens, prompts) and received.fidelity == 1.0
    assert torch.equal(runner.generate(received, NEW), local)


def test_sparse_positions_continue_at_the_true_positions(runner: HFRunner, prompts: torch.Tensor) -> None:
    kv = runner.prefill(prompts)
    explicit = KVCache(
        tokens=kv.tokens, signature=kv.signature, keys=kv.keys, values=kv.values, positions=torch.arange(kv.seq_len)
    )
    assert torch.equal(runner.generate(explicit, NEW), runner.generate(kv, NEW))
    # dropping entries changes the context the model sees, but never the positions of what is left
    sparse = transfer(kv, "topk(0.5)", sender=runner)
    assert sparse.positions is not None and sparse.seq_len == 20 and int(sparse.positions[-1]) == 39
    out = runner.generate(sparse, NEW)
    assert out.shape == (2, NEW)
    ref = runner.score(kv, out)
    got = runner.score(sparse, out)
    assert got.shape == ref.shape
    keep_all = transfer(kv, "topk(1.0)", sender=runner)
    assert torch.allclose(runner.score(keep_all, out), ref, atol=1e-4)


def test_generation_refuses_bad_positions(runner: HFRunner, prompts: torch.Tensor) -> None:
    kv = runner.prefill(prompts)
    for bad in (torch.arange(40).flip(0), torch.arange(40) + 5):
        with pytest.raises(GenerationError, match="positions"):
            runner.generate(
                KVCache(tokens=kv.tokens, signature=kv.signature, keys=kv.keys, values=kv.values, positions=bad), 2
            )


def test_score_agrees_with_greedy_generation(runner: HFRunner, prompts: torch.Tensor) -> None:
    kv = runner.prefill(prompts)
    new = runner.generate(kv, NEW)
    assert torch.equal(runner.score(kv, new).argmax(-1), new)
    assert torch.equal(runner.score(kv.token_only(), new).argmax(-1), new)


def test_topk_scores_with_real_queries_when_the_sender_runner_is_given(runner: HFRunner, prompts: torch.Tensor) -> None:
    kv = runner.prefill(prompts)
    mass = runner.attention_mass(kv, 8)
    assert mass is not None and mass.shape == (40,)
    # each layer's heads put `window` units of attention mass on the entries
    assert float(mass.sum()) == pytest.approx(8 * kv.n_layers, rel=1e-4)
    assert float(attention_scores(kv, 8, 1).sum()) == pytest.approx(8 * kv.n_layers, rel=1e-4)
    enc = get_codec("topk").encode(kv, runner=runner)
    assert enc.meta["topk"]["score"] == "queries"
    assert get_codec("topk").encode(kv).meta["topk"]["score"] == "keys"


def test_summary_by_the_senders_model_is_prefilled_by_the_receiver(runner: HFRunner, prompts: torch.Tensor) -> None:
    kv = runner.prefill(prompts[:1])
    codec = SummaryCodec(
        summarizer=ModelSummarizer(instruction_ids=torch.tensor([1, 2, 3]), prefix_ids=torch.tensor([4, 5])), tokens=12
    )
    enc = codec.encode(kv, runner=runner)
    assert enc.codec == "summary(12)"
    out = get_codec(enc.codec).decode(enc, runner=runner)
    assert out.has_kv and out.n_tokens <= 12 and out.tokens[0, :2].tolist() == [4, 5]
    expected = runner.generate(
        KVCache(
            tokens=torch.cat([kv.tokens, torch.tensor([[1, 2, 3]])], 1),
            signature=kv.signature,
            keys=kv.keys,
            values=kv.values,
        ),
        10,
    )
    assert torch.equal(out.tokens[:, 2:], expected)
    assert out.fidelity == pytest.approx(get_codec("summary").fidelity)
    assert runner.generate(out, 3).shape == (1, 3)


def test_summary_with_instruction_ids_but_no_prefix_ids_needs_a_tokenizer(
    runner: HFRunner, prompts: torch.Tensor
) -> None:
    # The runner has no tokenizer: the prefix text cannot be tokenised, which is a clear
    # SummaryUnavailable (it was an AttributeError on None).
    assert runner.tokenizer is None
    codec = SummaryCodec(summarizer=ModelSummarizer(instruction_ids=torch.tensor([1, 2, 3])), tokens=12)
    with pytest.raises(SummaryUnavailable, match="tokenizer"):
        codec.encode(runner.prefill(prompts[:1]), runner=runner)
