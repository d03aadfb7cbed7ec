"""Hidden tests for layerwise-memory: random shapes, dtypes, tied or untied embeddings and
all three quantizations, each against a real checkpoint and a real engine. The candidate
answers before anything is measured."""
import random

import pytest

from course_lib.weights.checkpoint import preset
from measure import describe, groups_on_disk, measured_peak, write_pair
from conftest import hidden_seed  # the judge's plugin: a fixed seed, so a grade repeats

SEED = hidden_seed()
RNG = random.Random(SEED)
WHY = f"(random seed {SEED})"


def random_config():
    heads = RNG.choice([2, 4, 8])
    return preset("tiny", vocab_size=RNG.choice([300, 512, 3000, 9000]), hidden_size=RNG.choice([32, 64, 96]),
                  intermediate_size=RNG.choice([48, 160, 320]), num_attention_heads=heads,
                  num_key_value_heads=RNG.choice([k for k in (1, 2, 4) if heads % k == 0]),
                  head_dim=RNG.choice([8, 16, 32]), num_hidden_layers=RNG.randint(1, 4),
                  tie_word_embeddings=RNG.random() < 0.5, torch_dtype=RNG.choice(["float32", "bfloat16", "float16"]))


@pytest.mark.parametrize("round_", range(3))
def test_reload_groups_random(candidate, tmp_path, round_):
    config = random_config()
    got = candidate.reload_groups(config)
    old, _ = write_pair(tmp_path, config, seeds=(RNG.randrange(10_000), RNG.randrange(10_000)))
    want = groups_on_disk(old)
    assert isinstance(got, dict) and set(got) == set(want), \
        f"{describe(config)}: the groups are {sorted(want)}; you returned {sorted(got) if isinstance(got, dict) else got!r} {WHY}"
    wrong = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert not wrong, f"{describe(config)}: bytes per group, (yours, on disk) = {wrong} {WHY}"


@pytest.mark.parametrize("quantization", [None, "int8", "fp8"])
@pytest.mark.parametrize("round_", range(2))
def test_peak_random(candidate, tmp_path, quantization, round_):
    config = random_config()
    guess = candidate.peak_held_bytes(config, quantization)
    old, new = write_pair(tmp_path, config, seeds=(RNG.randrange(10_000), RNG.randrange(10_000)))
    measured = measured_peak(old, new, quantization)
    assert isinstance(guess, int) and not isinstance(guess, bool), f"peak_held_bytes returns an int, got {guess!r}"
    assert guess == measured, \
        f"quantization {quantization!r}, {describe(config)}: you predicted {guess}, the engine held {measured} {WHY}"
