"""Hidden tests for canary-rollback: fresh checkpoints and prompts every run, a random corrupted
layer, another seed, a checkpoint of the wrong shape, one with a NaN, answers cut short, answers
of different lengths, empty answers, and hot == cold after.

The candidate runs first in every test; the reference answers are computed by a separate
engine. The random seed is in every message, so a failure can be replayed.
"""
import random
import shutil

import pytest

from course_lib.testing import assert_hot_equals_cold
from course_lib.weights.checkpoint import CheckpointReader
from versions import (Engine, corrupted_copy, expected_answers, kernel_weights, make_random, misshapen,
                      random_layer_name, same_weights, with_nan)
from conftest import hidden_seed  # the judge's plugin: a fixed seed, so a grade repeats

SEED = hidden_seed()
RNG = random.Random(SEED)
WHY = f"(random seed {SEED})"
PROMPTS = ["".join(RNG.choice("abcdefghij ,.") for _ in range(RNG.randint(4, 30))) for _ in range(5)]
N = RNG.randint(8, 14)


def test_first_divergence_on_random_lists(candidate):
    for _ in range(200):
        a = [RNG.randrange(5) for _ in range(RNG.randint(0, 6))]
        b = list(a) if RNG.random() < 0.3 else [RNG.randrange(5) for _ in range(RNG.randint(0, 6))]
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if want is None and len(a) != len(b):
            want = min(len(a), len(b))
        got = candidate.first_divergence(list(a), list(b))
        assert got == want, f"first_divergence({a}, {b}) should be {want}, got {got!r} {WHY}"


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    root = tmp_path_factory.mktemp("versions")
    old = make_random(root / "old", "tiny", seed=RNG.randrange(10_000))
    new = make_random(root / "new", "tiny", seed=RNG.randrange(10_000, 20_000))
    other = make_random(root / "other", "tiny", seed=RNG.randrange(20_000, 30_000))
    expected = expected_answers(new, PROMPTS, N)
    for k in range(5):  # a corruption that changes no answer would prove nothing
        bad = corrupted_copy(new, root / f"bad{k}", random_layer_name(new, RNG), RNG.randrange(1 << 30))
        if expected_answers(bad, PROMPTS, N) != expected:
            break
    # NaN in a random projection of a layer after the first: the engine has written a layer when it
    # finds the NaN, and the kept snapshot takes it back.
    late = [n for n in CheckpointReader(new).metadata() if n.startswith("model.layers.") and not n.startswith(
        "model.layers.0.") and n.endswith("proj.weight")]
    nan = with_nan(new, root / "nan", RNG.choice(sorted(late)), RNG.randrange(1 << 30))
    return {"old": old, "new": new, "other": other, "bad": bad, "wrong_shape": misshapen(root / "shape"),
            "nan": nan, "expected": expected}


def served(versions, tmp_path):
    path = shutil.copytree(versions["old"], tmp_path / "served")
    engine = Engine(path)
    shutil.rmtree(path)
    return engine


@pytest.mark.parametrize("which", ["bad", "other"])
def test_a_wrong_version_is_rolled_back_to_exactly_the_old_one(candidate, versions, tmp_path, which):
    engine = served(versions, tmp_path)
    before = kernel_weights(engine)
    decision = candidate.guarded_update(engine, versions[which], PROMPTS, versions["expected"], "v2", 1.0)
    what = "a random layer corrupted" if which == "bad" else "another seed"
    assert decision == "rolled_back", f"a version with {what} is rolled back, got {decision!r} {WHY}"
    assert same_weights(before, kernel_weights(engine)), f"the weights are bitwise the old ones {WHY}"
    assert engine.weight_version == "default" and not engine.paused, f"old label, generating again {WHY}"
    assert_hot_equals_cold(engine, versions["old"], PROMPTS[:2])


def test_the_right_version_is_promoted_and_served(candidate, versions, tmp_path):
    engine = served(versions, tmp_path)
    decision = candidate.guarded_update(engine, versions["new"], PROMPTS, versions["expected"], "v7", 1.0)
    assert decision == "promoted", f"the right version is promoted, got {decision!r} {WHY}"
    assert engine.weight_version == "v7" and not engine.paused, f"serving 'v7', generating {WHY}"
    assert_hot_equals_cold(engine, versions["new"], PROMPTS[:2])


def test_answers_cut_short_do_not_count_as_agreeing(candidate, versions, tmp_path):
    # Expected answers two tokens longer than the new version produces at that length: none agree.
    engine = served(versions, tmp_path)
    longer = [e + [RNG.randrange(512), RNG.randrange(512)] for e in expected_answers(versions["new"], PROMPTS, N)]
    prefix_only = [e[:N] for e in longer]
    assert prefix_only == versions["expected"]
    decision = candidate.guarded_update(engine, versions["new"], PROMPTS, longer, "v2", 0.5)
    # With max_new_tokens = len(expected), the engine produces N + 2 tokens; the last two are random
    # in `longer`, so almost surely every answer diverges at N or N + 1.
    assert decision == "rolled_back", f"answers that differ in their last tokens do not agree {WHY}"


def test_a_threshold_below_one_tolerates_some_divergence(candidate, versions, tmp_path):
    engine = served(versions, tmp_path)
    mixed = list(versions["expected"])
    mixed[0] = [(t + 1) % 512 for t in mixed[0]]  # one of five answers cannot agree
    decision = candidate.guarded_update(engine, versions["new"], PROMPTS, mixed, "v2", 0.8)
    assert decision == "promoted", f"4 of 5 answers agree and min_agreement is 0.8: promoted, got {decision!r} {WHY}"
    engine = served(versions, tmp_path / "again")
    decision = candidate.guarded_update(engine, versions["new"], PROMPTS, mixed, "v2", 0.81)
    assert decision == "rolled_back", f"4 of 5 answers agree and min_agreement is 0.81: rolled back {WHY}"


def test_a_checkpoint_of_the_wrong_shape_is_rejected(candidate, versions, tmp_path):
    engine = served(versions, tmp_path)
    before = kernel_weights(engine)
    decision = candidate.guarded_update(engine, versions["wrong_shape"], PROMPTS, versions["expected"], "v2", 1.0)
    assert decision == "rejected", f"a checkpoint the engine refuses is 'rejected', got {decision!r} {WHY}"
    assert same_weights(before, kernel_weights(engine)) and engine.weight_version == "default", \
        f"nothing changed {WHY}"
    assert not engine.paused, f"the engine is generating again after the refusal {WHY}"


def test_empty_answers_in_the_comparison(candidate):
    # An empty answer agrees only with an empty one: nothing generated is not "no divergence".
    token = RNG.randrange(512)
    for expected, got, want in [([], [], None), ([], [token], 0), ([token], [], 0)]:
        result = candidate.first_divergence(list(expected), list(got))
        assert result == want, f"first_divergence({expected}, {got}) should be {want}, got {result!r} {WHY}"


def test_answers_of_different_lengths_are_each_generated_to_their_own_length(candidate, versions, tmp_path):
    # Each prompt's answer has its own length, the first the shortest: one length for every
    # request (the first's, or the longest) makes the right version look wrong.
    lengths = sorted(RNG.sample(range(3, 16), len(PROMPTS)))
    lengths = lengths[:1] + RNG.sample(lengths[1:], len(lengths) - 1)
    expected = expected_answers(versions["new"], PROMPTS, lengths)
    engine = served(versions, tmp_path)
    decision = candidate.guarded_update(engine, versions["new"], PROMPTS, expected, "v3", 1.0)
    assert decision == "promoted", (
        f"the right version, with expected answers of {lengths} tokens (each generated to its own "
        f"length), is promoted, got {decision!r} {WHY}")
    assert engine.weight_version == "v3" and not engine.paused, f"serving 'v3', generating {WHY}"


def test_a_checkpoint_with_a_nan_is_rejected_and_the_engine_keeps_serving(candidate, versions, tmp_path):
    engine = served(versions, tmp_path)
    before = kernel_weights(engine)
    try:
        decision = candidate.guarded_update(engine, versions["nan"], PROMPTS, versions["expected"], "v2", 1.0)
    except Exception as exc:  # noqa: BLE001 - what escapes is the failure being described
        pytest.fail(f"a checkpoint with a NaN is refused by the engine (ValueError) and reported 'rejected'; "
                    f"instead {type(exc).__name__} escaped ({str(exc)[:160]}) and the engine is "
                    f"{'still paused' if engine.paused else 'not paused'} {WHY}")
    assert decision == "rejected", f"a checkpoint with a NaN is 'rejected', got {decision!r} {WHY}"
    assert not engine.paused, f"the engine is generating again after the refusal {WHY}"
    assert same_weights(before, kernel_weights(engine)) and engine.weight_version == "default", \
        f"the old weights and label serve after the refusal {WHY}"
    assert_hot_equals_cold(engine, versions["old"], PROMPTS[:2])
