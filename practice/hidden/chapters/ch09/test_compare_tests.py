"""Hidden cases of chapter 09's test-writing part (ch09.compare_tests): the learner's tests of
the canary comparison pass on the reference comparison and fail on each buggy comparison
below (suites.py says how the share is scored). The buggy comparisons are plausible designs,
each breaking one promise of ``compare_outputs``; the learner has seen two others (the
public cases), not these.
"""
import statistics

import numpy as np
import pytest

from course_lib import production, production_checks
from suites import as_function, reference_body, run_tests

TESTS = pytest.mark.exercise("ch09.compare_tests")


def _part(expected, got):
    """Where two answers part, as exercise 1 defines it (None: identical)."""
    for k, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return k
    return None if len(expected) == len(got) else min(len(expected), len(got))


def _refuse(expected, got):
    if len(expected) != len(got):
        raise ValueError(f"cannot compare {len(expected)} expected answers with {len(got)} answers")
    if not expected:
        raise ValueError("an empty request set has no agreement")


def _shares(firsts, expected):
    return [1.0 if f is None else (f / len(e) if e else 0.0) for f, e in zip(firsts, expected)]


def _result(firsts, agreement, shares):
    return {"first_divergence": firsts, "agreement": agreement, "matched_fraction": statistics.fmean(shares)}


def equal_lengths_agree(expected, got):
    """Counts a request as agreeing when its answer has the expected length."""
    _refuse(expected, got)
    firsts = [_part(e, g) for e, g in zip(expected, got)]
    same = sum(len(e) == len(g) for e, g in zip(expected, got))
    return _result(firsts, same / len(expected), _shares(firsts, expected))


def matched_over_got(expected, got):
    """Divides the tokens reproduced by the length of the answer given, not of the one expected."""
    _refuse(expected, got)
    firsts = [_part(e, g) for e, g in zip(expected, got)]
    shares = [1.0 if f is None else (f / len(g) if g else 0.0) for f, g in zip(firsts, got)]
    return _result(firsts, sum(f is None for f in firsts) / len(firsts), shares)


def compares_the_common_part(expected, got):
    """Compares the requests both sets have: a missing or extra answer goes unnoticed."""
    if not expected or not got:
        raise ValueError("an empty request set has no agreement")
    pairs = list(zip(expected, got))
    firsts = [_part(e, g) for e, g in pairs]
    return _result(firsts, sum(f is None for f in firsts) / len(firsts), _shares(firsts, [e for e, _ in pairs]))


def refuses_missing_answers_only(expected, got):
    """Refuses a set with answers missing; one with extra answers is compared over the expected ones."""
    if len(got) < len(expected):
        raise ValueError(f"only {len(got)} answers for {len(expected)} expected: some are missing")
    if not expected:
        raise ValueError("an empty request set has no agreement")
    firsts = [_part(e, g) for e, g in zip(expected, got)]
    return _result(firsts, sum(f is None for f in firsts) / len(firsts), _shares(firsts, expected))


def silent_about_counts(expected, got):
    """Refuses sets of different sizes with a message that says neither size."""
    if len(expected) != len(got):
        raise ValueError("the expected and given answer sets differ in size")
    if not expected:
        raise ValueError("an empty request set has no agreement")
    firsts = [_part(e, g) for e, g in zip(expected, got)]
    return _result(firsts, sum(f is None for f in firsts) / len(firsts), _shares(firsts, expected))


def empty_set_agrees(expected, got):
    """Answers an empty request set with full agreement instead of refusing it."""
    if len(expected) != len(got):
        raise ValueError(f"cannot compare {len(expected)} expected answers with {len(got)} answers")
    if not expected:
        return {"first_divergence": [], "agreement": 1.0, "matched_fraction": 1.0}
    firsts = [_part(e, g) for e, g in zip(expected, got)]
    return _result(firsts, sum(f is None for f in firsts) / len(firsts), _shares(firsts, expected))


def floor_division(expected, got):
    """Counts the agreement with //: 0 unless every request agrees, and an int."""
    _refuse(expected, got)
    firsts = [_part(e, g) for e, g in zip(expected, got)]
    return _result(firsts, sum(f is None for f in firsts) // len(firsts), _shares(firsts, expected))


def pads_in_place(expected, got):
    """Pads the shorter answer of each pair with None to read both position by position:
    the right figures, but the caller's answers come back longer."""
    _refuse(expected, got)
    lengths = [len(e) for e in expected]
    for e, g in zip(expected, got):
        longest = max(len(e), len(g))
        e.extend([None] * (longest - len(e)))
        g.extend([None] * (longest - len(g)))
    firsts = [next((k for k, (a, b) in enumerate(zip(e, g)) if a != b), None) for e, g in zip(expected, got)]
    shares = [1.0 if f is None else (f / n if n else 0.0) for f, n in zip(firsts, lengths)]
    return _result(firsts, sum(f is None for f in firsts) / len(firsts), shares)


def _part_along_expected(expected, got):
    for k, token in enumerate(expected):
        if k >= len(got) or got[k] != token:
            return k
    return None


def reads_along_expected(expected, got):
    """Walks each expected answer: one cut short diverges, one that ran on agrees."""
    _refuse(expected, got)
    firsts = [_part_along_expected(e, g) for e, g in zip(expected, got)]
    return _result(firsts, sum(f is None for f in firsts) / len(firsts), _shares(firsts, expected))


def empty_answer_reproduces_nothing(expected, got):
    """Takes an empty expected answer as nothing reproduced (0.0), identical or not."""
    _refuse(expected, got)
    firsts = [_part(e, g) for e, g in zip(expected, got)]
    shares = [(len(e) if f is None else f) / len(e) if e else 0.0 for f, e in zip(firsts, expected)]
    return _result(firsts, sum(f is None for f in firsts) / len(firsts), shares)


def _part_counted_from_one(expected, got):
    for k, (a, b) in enumerate(zip(expected, got), start=1):
        if a != b:
            return k
    return None if len(expected) == len(got) else min(len(expected), len(got))


def counts_positions_from_one(expected, got):
    """Numbers a differing token from 1, as an editor numbers columns."""
    _refuse(expected, got)
    firsts = [_part_counted_from_one(e, g) for e, g in zip(expected, got)]
    return _result(firsts, sum(f is None for f in firsts) / len(firsts), _shares(firsts, expected))


def _part_vectorised(expected, got):
    n = min(len(expected), len(got))
    differ = np.flatnonzero(np.asarray(expected[:n]) != np.asarray(got[:n]))
    if differ.size:
        return differ[0]
    return None if len(expected) == len(got) else n


def numpy_positions(expected, got):
    """Finds each divergence with NumPy: the right positions, as numpy.int64, not int."""
    _refuse(expected, got)
    firsts = [_part_vectorised(e, g) for e, g in zip(expected, got)]
    return _result(firsts, sum(f is None for f in firsts) / len(firsts), _shares(firsts, expected))


BUGGY = [equal_lengths_agree, matched_over_got, compares_the_common_part, refuses_missing_answers_only,
         silent_about_counts, empty_set_agrees, floor_division, pads_in_place, reads_along_expected,
         empty_answer_reproduces_nothing, counts_positions_from_one, numpy_positions]


def reference_comparison(root):
    """The reference's compare_outputs, calling the reference's first_divergence (not the learner's)."""
    first = as_function(production.first_divergence, reference_body(root, "production.py", "ch09.first_divergence"))
    compare = as_function(production.compare_outputs, reference_body(root, "production.py", "ch09.compare_outputs"))
    compare.__globals__["first_divergence"] = first  # as_function's namespace is the variant's own
    return compare


@TESTS
def test_compare_tests__pass_on_the_reference_comparison(reference_root):
    failed = run_tests(production_checks.check_compare_outputs, reference_comparison(reference_root))
    assert failed is None, (f"your check_compare_outputs fails on the reference comparison, which keeps the whole "
                            f"contract: {failed}; a test must pass on every right design")


# Neutral case names: a learner's report says how many buggy comparisons passed, not which bug each has.
@TESTS
@pytest.mark.parametrize("buggy", BUGGY, ids=[f"hidden variant {i + 1}" for i in range(len(BUGGY))])
def test_compare_tests_catches_a_buggy_comparison(buggy):
    failed = run_tests(production_checks.check_compare_outputs, buggy)
    assert failed is not None, ("your check_compare_outputs passes on a comparison that breaks a promise of "
                                "compare_outputs' contract: which promise does none of your checks test?")
