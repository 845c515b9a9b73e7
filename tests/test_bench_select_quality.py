"""What `kvbus bench select` judges with (app/bench/select_quality.py): a medium's fidelity is the
mean over several windows of held-out text, not one. On one window of 128 following tokens a single
flipped token was a fidelity loss of 1/128: 68 ms of penalty at this machine's decode speed, more
than a whole `full` transfer at 10 Gbit/s. Real SmolLM2; no timing."""

from __future__ import annotations

import pytest

from kvbus.app.bench.select_quality import FOLLOWING, Quality


@pytest.fixture(scope="module")
def quality() -> Quality:
    from kvbus.app.models import load_smollm2

    runner, tokenizer = load_smollm2()
    return Quality(runner, tokenizer, windows=3)


def test_fidelity_is_averaged_over_windows_of_held_out_text(quality: Quality) -> None:
    n = 64
    windows = quality._windows(n)
    assert len(windows) == 3
    assert windows[0][0] is quality.context(n)  # the first window is the context the cells send
    followings = [w[1] for w in windows]
    assert all(f.shape[-1] == FOLLOWING for f in followings)
    assert len({tuple(f[0, :8].tolist()) for f in followings}) == 3  # each scored on its own tokens
    got = quality.of("int8", n)
    assert got["windows"] == 3 and 0.9 < got["fidelity"] <= 1.0
    kv, following, ref = windows[1]
    one = quality.score(quality.of_window("int8", kv), n, ref=ref, following=following)
    assert 0.9 < one["fidelity"] <= 1.0
    assert quality.of("full", n) == {"top1": 1.0, "kl": 0.0, "fidelity": 1.0, "windows": 1}
