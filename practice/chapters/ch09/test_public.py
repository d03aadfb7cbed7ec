"""Public tests for chapter 09's exercises (run them: python practice/judge.py test ch09).

ch09.first_divergence: ``first_divergence`` in course_lib/production.py.
ch09.compare_outputs: ``compare_outputs`` in course_lib/production.py.
ch09.compare_tests: ``check_compare_outputs`` in course_lib/production_checks.py (your tests
must pass on a right comparison and fail on wrong ones: two are below, the judge holds more).
ch09.host_snapshot: ``take_snapshot`` in course_lib/update/updater.py.
ch09.rollback: ``promote_or_rollback`` in course_lib/production.py.
Each case reports what it expected in words.
"""
import pytest
import torch

from course_lib import Engine
from course_lib import production
from course_lib.production_checks import check_compare_outputs
from course_lib.testing import assert_hot_equals_cold, verdict
from course_lib.weights.commit.audit import kernel_tensors
from course_lib.weights.checkpoint import CheckpointReader, make_random, preset, write_checkpoint

FIRST, COMPARE, TESTS, SNAPSHOT, ROLLBACK = (pytest.mark.exercise(f"ch09.{n}") for n in (
    "first_divergence", "compare_outputs", "compare_tests", "host_snapshot", "rollback"))
PROMPTS = ["canary one", "a second fixed request", "three", "the fourth request of the set"]


# ---- ch09.first_divergence ----------------------------------------------------------------

@FIRST
def test_first_divergence__identical_answers_give_none():
    assert production.first_divergence([4, 5, 6], [4, 5, 6]) is None, "identical answers: None"
    assert production.first_divergence([], []) is None, "two empty answers are identical: None, not 0"


@FIRST
def test_first_divergence__the_first_differing_token():
    assert production.first_divergence([1, 2, 3, 4], [1, 2, 9, 4]) == 2, "token 2 differs first: 2"
    assert production.first_divergence([1, 2, 3], [7, 2, 9]) == 0, "token 0 differs first: 0"


@FIRST
def test_first_divergence__cut_short_run_long_and_empty():
    assert production.first_divergence([1, 2, 3], [1, 2]) == 2, "an answer cut short diverges where it ends: 2"
    assert production.first_divergence([1, 2], [1, 2, 3]) == 2, "an answer that ran on diverges at 2"
    assert production.first_divergence([5, 6], []) == 0, "an empty answer where tokens were expected: 0"


# ---- ch09.compare_outputs -----------------------------------------------------------------

@COMPARE
def test_compare_outputs__per_request_and_overall():
    got = production.compare_outputs([[1, 2, 3, 4], [5, 6], [7], [1, 1]], [[1, 2, 0, 4], [5, 6], [8], [1, 1, 1]])
    assert got["first_divergence"] == [2, None, 0, 2], "first divergences [2, None, 0, 2]"
    assert got["agreement"] == pytest.approx(1 / 4), "one request of four is identical: agreement 0.25"
    assert got["matched_fraction"] == pytest.approx((0.5 + 1 + 0 + 1) / 4), \
        "matched_fraction: mean share of each expected answer reproduced before it diverged"


@COMPARE
def test_compare_outputs__same_length_is_not_agreement():
    got = production.compare_outputs([[1, 2, 3], [4, 5]], [[3, 2, 1], [4, 5]])
    assert got["agreement"] == pytest.approx(0.5), "answers of the right length but other tokens do not agree"


@COMPARE
def test_compare_outputs__empty_answers():
    got = production.compare_outputs([[], [3, 4]], [[], []])
    assert got["first_divergence"] == [None, 0], "empty vs empty agrees (None); empty vs [3, 4] diverges at 0"
    assert got["agreement"] == pytest.approx(0.5) and got["matched_fraction"] == pytest.approx(0.5)


@COMPARE
def test_compare_outputs__refuses_mismatched_or_empty_sets():
    with pytest.raises(ValueError):
        production.compare_outputs([[1], [2]], [[1]])  # a missing answer is not "the common part agrees"
    with pytest.raises(ValueError):
        production.compare_outputs([], [])


# ---- ch09.compare_tests -------------------------------------------------------------------


def lengths_only(expected, got):
    """Looks at the lengths only: an answer of the expected length agrees, any other parts
    where the shorter one ends."""
    if not expected or len(got) != len(expected):
        raise ValueError(f"expected {len(expected)} answers, got {len(got)}")
    parts = [None if len(g) == len(e) else min(len(g), len(e)) for e, g in zip(expected, got)]
    reproduced = [1.0 if p is None else (p / len(e) if e else 0.0) for p, e in zip(parts, expected)]
    return {"first_divergence": parts, "agreement": parts.count(None) / len(parts),
            "matched_fraction": sum(reproduced) / len(reproduced)}


def prefix_agrees(expected, got):
    """Compares the tokens both answers have: an answer cut short, or one that ran on, agrees."""
    if not expected or len(got) != len(expected):
        raise ValueError(f"expected {len(expected)} answers, got {len(got)}")
    parts = [next((k for k, pair in enumerate(zip(e, g)) if pair[0] != pair[1]), None) for e, g in zip(expected, got)]
    reproduced = [1.0 if p is None else (p / len(e) if e else 0.0) for p, e in zip(parts, expected)]
    return {"first_divergence": parts, "agreement": parts.count(None) / len(parts),
            "matched_fraction": sum(reproduced) / len(reproduced)}


@TESTS
def test_compare_tests__pass_on_your_own_comparison():
    # Your comparison passes its own public cases above; a right test passes on it.
    failed = verdict(check_compare_outputs, production.compare_outputs)
    assert failed is None, (f"check_compare_outputs fails on your own compare_outputs: {type(failed).__name__}: "
                            f"{failed}. If your comparison passes its cases above, the test is asking for more "
                            "than the contract says")


@TESTS
@pytest.mark.parametrize("compare", [lengths_only, prefix_agrees], ids=["lengths only", "a prefix agrees"])
def test_compare_tests__catches_a_public_buggy_comparison(compare):
    assert verdict(check_compare_outputs, compare) is not None, \
        f"check_compare_outputs passes on a wrong comparison: {compare.__doc__}"


# ---- ch09.rollback ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ch09")
    old, new = make_random(root / "old", "tiny", seed=11), make_random(root / "new", "tiny", seed=12)
    reader = CheckpointReader(new)
    tensors = dict(reader.iter_tensors())
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = torch.randn(tensors[name].shape, generator=torch.Generator().manual_seed(3)) * tensors[name].std()
    bad = write_checkpoint(root / "bad", reader.config, tensors)
    return {"old": old, "new": new, "bad": bad, "reference": production.greedy_outputs(Engine(new), PROMPTS, 10)}


def weights(engine):
    return {n: t.clone() for n, t in kernel_tensors(engine.model).items()}


@SNAPSHOT
def test_host_snapshot__copies_every_kernel_tensor_with_the_version(ckpts):
    engine = Engine(ckpts["old"])
    live = kernel_tensors(engine.model)
    snap = engine.take_snapshot()
    assert snap is engine.snapshot, "take_snapshot sets engine.snapshot and returns it"
    assert snap.weight_version == engine.weight_version, "the snapshot carries the current version label"
    assert set(snap.tensors) == set(live), "one host tensor per kernel tensor, under the same name"
    for name, t in live.items():
        host = snap.tensors[name]
        assert host.device.type == "cpu" and host.dtype == t.dtype and host.shape == t.shape, name
        assert torch.equal(host, t.cpu()), f"{name}: the snapshot holds the live values"
        assert host.untyped_storage().data_ptr() != t.untyped_storage().data_ptr(), \
            f"{name}: the snapshot is a copy, not the live tensor"


@SNAPSHOT
def test_host_snapshot__restored_after_an_update_gives_back_weights_and_version(ckpts):
    engine = Engine(ckpts["old"])
    before = weights(engine)
    engine.take_snapshot()
    engine.update_weights_from_disk(ckpts["new"], weight_version="v2")  # no new snapshot: the old one stays
    engine.rollback()
    assert engine.weight_version == "default", "the snapshot's version label is back"
    assert all(torch.equal(before[n], t) for n, t in weights(engine).items()), "bitwise the old weights"
    assert_hot_equals_cold(engine, ckpts["old"], PROMPTS[:2], max_new_tokens=4)


@SNAPSHOT
def test_host_snapshot__restores_the_runtime_config_an_update_changed(ckpts, tmp_path):
    """The chapter's warning: an update may change ``rope_theta`` (and the token ids) in
    place; a rollback that put the old weights back with the new ``rope_theta`` would serve
    wrong outputs and raise nothing."""
    engine = Engine(ckpts["old"])
    reader = CheckpointReader(ckpts["new"])
    config = reader.config
    config.rope_theta = engine.model_config.rope_theta * 4
    new = write_checkpoint(tmp_path / "new-theta", config, dict(reader.iter_tensors()))
    engine.take_snapshot()
    engine.update_weights_from_disk(new, weight_version="v2")
    assert engine.model_config.rope_theta == config.rope_theta, "the update applied the new rope_theta"
    engine.rollback()
    assert engine.model_config.rope_theta == CheckpointReader(ckpts["old"]).config.rope_theta, \
        "after the rollback the runtime config is the snapshot's: take a copy of it, not the live object"
    assert_hot_equals_cold(engine, ckpts["old"], PROMPTS[:2], max_new_tokens=4)


@ROLLBACK
def test_rollback__a_bad_version_is_rolled_back(ckpts):
    engine = Engine(ckpts["old"])
    before = weights(engine)
    got = production.promote_or_rollback(engine, ckpts["bad"], PROMPTS, ckpts["reference"], "v2", max_new_tokens=10)
    assert got["decision"] == "rolled_back", f"a corrupted layer is rolled back, not {got['decision']!r}"
    assert not engine.paused, "the engine serves again after the rollback (not paused)"
    assert engine.weight_version == "default", "the old version label is back"
    assert all(torch.equal(before[n], t) for n, t in weights(engine).items()), "bitwise the old weights"
    assert_hot_equals_cold(engine, ckpts["old"], PROMPTS[:2], max_new_tokens=4)


@ROLLBACK
def test_rollback__a_good_version_is_promoted(ckpts):
    engine = Engine(ckpts["old"])
    got = production.promote_or_rollback(engine, ckpts["new"], PROMPTS, ckpts["reference"], "v2", max_new_tokens=10)
    assert got["decision"] == "promoted" and got["agreement"] == 1.0, \
        f"the intended version is promoted with agreement 1.0, not {got['decision']!r} {got['reasons']}"
    assert engine.weight_version == "v2" and not engine.paused, "serving v2, not paused"
    assert_hot_equals_cold(engine, ckpts["new"], PROMPTS[:2], max_new_tokens=4)


@ROLLBACK
def test_rollback__a_refused_checkpoint_leaves_the_engine_serving(ckpts, tmp_path):
    engine = Engine(ckpts["old"])
    wrong = make_random(tmp_path / "wrong", preset("tiny", hidden_size=32, head_dim=8), seed=13)
    got = production.promote_or_rollback(engine, wrong, PROMPTS, ckpts["reference"], "v2", max_new_tokens=10)
    assert got["decision"] == "rejected", f"a checkpoint of another shape is rejected, not {got['decision']!r}"
    assert not engine.paused, "a refused update must not leave the engine paused"
    assert engine.weight_version == "default"
