"""Public tests for layerwise-memory: the 'small' preset (float32), against the engine itself.

Your file arrives as the ``candidate`` fixture; ``measure.py`` reads the truth from a
real checkpoint and a real engine.
"""
import pytest

from course_lib.weights.checkpoint import preset
from measure import describe, groups_on_disk, measured_peak, write_pair


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    config = preset("small")
    return config, write_pair(tmp_path_factory.mktemp("small"), config)


def test_reload_groups_small(candidate, small):
    config, (old, _) = small
    got, want = candidate.reload_groups(config), groups_on_disk(old)
    assert isinstance(got, dict), f"reload_groups returns a dict, got {type(got).__name__}"
    assert set(got) == set(want), f"the groups are {sorted(want)}; you returned {sorted(got)}"
    wrong = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert not wrong, f"bytes per group ({describe(config)}): (yours, on disk) = {wrong}"


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_peak_small(candidate, small, quantization):
    config, (old, new) = small
    guess, measured = candidate.peak_held_bytes(config, quantization), measured_peak(old, new, quantization)
    assert guess == measured, f"quantization {quantization!r}, {describe(config)}: you predicted {guess!r}, the engine held {measured}"


def test_peak_with_a_large_vocabulary(candidate, tmp_path):
    config = preset("tiny", vocab_size=8192)
    old, new = write_pair(tmp_path, config)
    guess, measured = candidate.peak_held_bytes(config, None), measured_peak(old, new, None)
    assert guess == measured, f"{describe(config)}: you predicted {guess!r}, the engine held {measured}"


def test_reload_groups_with_tied_embeddings(candidate, tmp_path):
    config = preset("tiny", tie_word_embeddings=True)
    old, _ = write_pair(tmp_path, config)
    got, want = candidate.reload_groups(config), groups_on_disk(old)
    assert isinstance(got, dict) and set(got) == set(want), \
        f"{describe(config)}: a tied checkpoint has no lm_head.weight; the groups are {sorted(want)}, you returned {sorted(got)}"


def test_peak_int8_with_a_bfloat16_checkpoint(candidate, tmp_path):
    config = preset("small", torch_dtype="bfloat16")
    old, new = write_pair(tmp_path, config)
    guess, measured = candidate.peak_held_bytes(config, "int8"), measured_peak(old, new, "int8")
    assert guess == measured, f"quantization 'int8', {describe(config)}: you predicted {guess!r}, the engine held {measured}"
