"""Public tests for canary-rollback: hand-checked divergences, and one bad and one good version.

The file under test arrives as the ``candidate`` fixture (the judge loads it). Every
engine starts from a copy of the old checkpoint that is deleted before the candidate runs,
so the old weights can only come back from the snapshot.
"""
import shutil

import pytest

from versions import Engine, corrupted_copy, expected_answers, kernel_weights, make_random, same_weights

PROMPTS = ["the canary asks", "a second fixed request", "three", "and a fourth one"]
N = 10


@pytest.mark.parametrize("expected, got, want", [
    ([1, 2, 3], [1, 2, 3], None),
    ([1, 2, 3], [1, 9, 3], 1),
    ([1, 2, 3], [1, 2], 2),
    ([1, 2], [1, 2, 7], 2),
    ([5], [], 0),
    ([], [], None),
])
def test_first_divergence(candidate, expected, got, want):
    assert candidate.first_divergence(expected, got) == want, \
        f"first_divergence({expected}, {got}) should be {want}, got {candidate.first_divergence(expected, got)!r}"


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    root = tmp_path_factory.mktemp("versions")
    old, new = make_random(root / "old", "tiny", seed=11), make_random(root / "new", "tiny", seed=12)
    return {"old": old, "new": new, "bad": corrupted_copy(new, root / "bad"),
            "expected": expected_answers(new, PROMPTS, N)}


def engine_without_its_checkpoint(versions, tmp_path):
    served_from = shutil.copytree(versions["old"], tmp_path / "served")
    engine = Engine(served_from)
    shutil.rmtree(served_from)  # a rollback must not need it
    return engine


def test_a_corrupted_layer_is_rolled_back(candidate, versions, tmp_path):
    engine = engine_without_its_checkpoint(versions, tmp_path)
    before = kernel_weights(engine)
    decision = candidate.guarded_update(engine, versions["bad"], PROMPTS, versions["expected"], "v2", 1.0)
    assert decision == "rolled_back", f"a version with one corrupted layer is rolled back, got {decision!r}"
    assert same_weights(before, kernel_weights(engine)), "after the rollback the weights are bitwise the old ones"
    assert engine.weight_version == "default", f"the old version label is back, got {engine.weight_version!r}"
    assert not engine.paused, "the engine is generating again after the rollback"


def test_the_right_version_is_promoted(candidate, versions, tmp_path):
    engine = engine_without_its_checkpoint(versions, tmp_path)
    decision = candidate.guarded_update(engine, versions["new"], PROMPTS, versions["expected"], "v2", 1.0)
    assert decision == "promoted", f"the version that gives the expected answers is promoted, got {decision!r}"
    assert engine.weight_version == "v2" and not engine.paused, "serving v2, not paused"
