"""Chapter 09, differential: the learner's comparison, snapshot and promote-or-rollback
policy beside the reference's, on the same random inputs and engine scenarios (requests in
flight, every pause mode, refused, corrupted and missing checkpoints, quality metrics that
pass, fail, raise or read the weights); every observation compared. See ``shared/``.
"""
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from engine_ops import (DIFFERENTIAL, MODES, cont, engine_kwargs, pause, same_as_reference,
                        same_call_as_reference, scenario, snapshot, step, steps, submit, update)
from engine_scenarios import make_paths

A, B = [1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5]
TWO = {"block_size": 4, "max_num_seqs": 2}

tokens = st.lists(st.integers(0, 5), max_size=6)
# Two answers that often share a prefix: b is a copied, cut, extended or edited.
pairs = st.tuples(tokens, st.sampled_from(["same", "cut", "longer", "edit", "other"]), st.integers(0, 5)).map(
    lambda t: (t[0], {"same": t[0], "cut": t[0][:t[2]], "longer": t[0] + [t[2]],
                      "edit": t[0][:t[2]] + [9] + t[0][t[2] + 1:], "other": [t[2]]}[t[1]]))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return make_paths(tmp_path_factory.mktemp("ch09-differential"))


@pytest.mark.exercise("ch09.first_divergence")
@DIFFERENTIAL
@given(pair=pairs)
@example(pair=([], []))
@example(pair=([], [3]))
@example(pair=([1, 2], [1, 2, 3]))
@example(pair=([1, 2, 3], [1, 2]))
@example(pair=([1, 2, 3], [1, 5, 3]))
def test_first_divergence_matches_the_reference(reference, pair):
    same_call_as_reference(reference, "course_lib.production:first_divergence", list(pair),
                           explain="see Exercise 1 of chapter 09 (where two answers part)")


@pytest.mark.exercise("ch09.compare_outputs")
@DIFFERENTIAL
@given(sets=st.lists(pairs, max_size=5), drop=st.sampled_from([None, None, None, "expected", "got"]))
@example(sets=[], drop=None)
@example(sets=[([], []), ([1], [])], drop=None)
@example(sets=[([1, 2], [1, 2])], drop="got")
@example(sets=[([1, 2, 3, 4], [1, 2, 7, 4]), ([5], [5])], drop=None)
def test_compare_outputs_matches_the_reference(reference, sets, drop):
    expected, got = [list(e) for e, _ in sets], [list(g) for _, g in sets]
    if drop == "expected" and expected:
        expected.pop()
    if drop == "got" and got:
        got.pop()
    same_call_as_reference(reference, "course_lib.production:compare_outputs", [expected, got],
                           explain="see Exercise 2 of chapter 09 (comparing two output sets)")


@pytest.mark.exercise("ch09.host_snapshot")
@DIFFERENTIAL
@given(ops=scenario(submit, step, steps, snapshot, pause("keep", "retract", "abort"), update, cont,
                    st.tuples(st.just("rollback"), st.fixed_dictionaries(
                        {}, optional={"abort_all_requests": st.booleans(), "flush_cache": st.booleans()})).map(list)),
       kwargs=engine_kwargs)
@example(ops=[["snapshot"], ["update", 1, {}], ["update", 2, {}], ["rollback", {}], ["submit", A, 4],
              ["steps", 6]], kwargs=TWO)
@example(ops=[["submit", A, 8], ["step"], ["snapshot"], ["rollback", {}], ["pause", "keep"], ["rollback", {}],
              ["continue"], ["steps", 8]], kwargs=TWO)
def test_snapshot_and_rollback_match_the_reference(reference, paths, ops, kwargs):
    same_as_reference(reference, paths, ops, kwargs, "see the chapter 09 section on host snapshots")


promote_options = st.fixed_dictionaries(
    {"pause_mode": st.sampled_from(MODES)},
    optional={"min_agreement": st.sampled_from([0.0, 0.5, 1.0]), "max_new_tokens": st.integers(1, 6),
              "quality": st.sampled_from(["high", "low", "raises", "logit"]),
              "min_quality": st.sampled_from([-0.5, 0.0, 0.5]), "partial": st.booleans()})
promote = st.tuples(st.just("promote"), st.integers(1, 5), st.integers(0, 2), promote_options).map(list)


@pytest.mark.exercise("ch09.rollback")
@DIFFERENTIAL
@given(ops=scenario(submit, step, steps, promote, pause(), cont, max_size=10), kwargs=engine_kwargs)
@example(ops=[["submit", A, 12], ["step"], ["pause", "keep"], ["promote", 1, 1, {"pause_mode": "retract"}],
              ["steps", 2], ["continue"], ["steps", 12]], kwargs=TWO)
@example(ops=[["submit", A, 12], ["step"], ["promote", 1, 2, {"pause_mode": "retract"}], ["steps", 12]], kwargs=TWO)
@example(ops=[["submit", A, 12], ["step"], ["promote", 1, 1, {"pause_mode": "keep"}], ["steps", 12]], kwargs=TWO)
@example(ops=[["submit", A, 12], ["submit", B, 3], ["step"], ["promote", 3, 2, {"pause_mode": "abort"}],
              ["steps", 3]], kwargs=TWO)
@example(ops=[["submit", A, 12], ["step"], ["promote", 4, 1, {"pause_mode": "wait"}], ["steps", 12]], kwargs=TWO)
@example(ops=[["submit", A, 12], ["step"], ["promote", 1, 1, {"pause_mode": "bogus"}], ["steps", 3]], kwargs=TWO)
@example(ops=[["submit", A, 12], ["step"], ["promote", 5, 1, {"pause_mode": "retract"}], ["steps", 3]], kwargs=TWO)
@example(ops=[["promote", 1, 1, {"pause_mode": "retract", "quality": "raises", "min_quality": 0.0}],
              ["submit", A, 3], ["steps", 4]], kwargs=TWO)
@example(ops=[["promote", 1, 2, {"pause_mode": "retract", "min_agreement": 1.0, "quality": "low",
                                 "min_quality": 0.0}], ["submit", A, 3], ["steps", 4]], kwargs=TWO)
@example(ops=[["promote", 1, 1, {"pause_mode": "keep", "quality": "logit", "min_quality": 0.5}],
              ["submit", A, 3], ["steps", 4]], kwargs=TWO)
@example(ops=[["promote", 2, 0, {"pause_mode": "retract", "min_quality": 0.0}], ["steps", 1]], kwargs=TWO)
def test_promote_or_rollback_matches_the_reference(reference, paths, ops, kwargs):
    same_as_reference(reference, paths, ops, kwargs, "see the chapter 09 exercise on promote or roll back")
